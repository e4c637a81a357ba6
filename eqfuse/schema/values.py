"""What a translation is made of: values (terms computed in kernels, views of buffers
the kernels do not compute), the eager steps and their arguments, and the finished
Translation that extraction reads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class BufferView:
    """A strided view of a buffer the kernels do not compute (input or eager result)."""
    buf: str
    shape: tuple
    strides: tuple
    offset: int
    dtype: str
    foldable: bool  # views of it may fold into its strides (inputs, eager steps' dense results)


@dataclass
class Computed:
    term: Any  # a Value term
    shape: tuple
    dtype: str


@dataclass
class Fallback:
    node: str
    target: Any
    args: Any  # args with FX nodes replaced by ArgRef / BufRef
    kwargs: Any
    reason: str
    outputs: list  # names of the external buffers it produces (one per tensor result)
    multi: bool
    out_info: list = field(default_factory=list)  # (shape, dtype) per output; dtype None if opaque
    writes: str | None = None  # the input buffer it writes in place (frontend/writes.py)


@dataclass(frozen=True)
class ArgRef:
    """A computed value, materialised under let-name ``name``, passed to an eager op;
    with ``view`` (shape, strides, offset), that view of its contiguous buffer."""
    name: str
    view: tuple | None = None


@dataclass(frozen=True)
class BufRef:
    """An input / external buffer viewed with (shape, strides, offset), passed to an eager op."""
    buf: str
    shape: tuple
    strides: tuple
    offset: int


@dataclass
class Translation:
    egraph: Any
    inputs: list[tuple[str, tuple, str]]  # (buffer name, shape, dtype) per placeholder
    # per flat output: ("value", let, shape, dtype, strides) | ("buffer", BufRef) | ("const", v)
    # | ("alias", j, shape, strides): output j's tensor again, viewed so (contiguous both)
    outputs: list
    fallbacks: list[Fallback]
    roots: list[str]  # let-names that must be materialised (outputs, fallback args)
    node_names: list[str] = field(default_factory=list)
    # fallback argument let-name -> the strides its buffer is written with: eager's layout
    # of the argument where that is not the contiguous one, so that the step takes the
    # buffer as it is (EagerCall) instead of a copy in that layout
    arg_strides: dict[str, tuple] = field(default_factory=dict)


def node_meta(node):
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None
