"""Plan objects: what extraction hands to code generation. Plain data, printable.

A ``PNode`` is one kernel-level operation with its shape and dtype; a kernel is a set of
root PNodes, each stored to a buffer. Loads name the buffer they read and the strided
view they read it through.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


def contiguous_strides(shape) -> tuple:
    """Row-major element strides of ``shape``."""
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(int(s), 1)
    return tuple(reversed(strides))


@dataclass(eq=False)
class PNode:
    op: str  # load const iota unary binary where cast reduce broadcast reshape permute slice cat
    #          dot expdot expsum
    attrs: tuple
    args: tuple
    shape: tuple
    dtype: str
    eclass: str = ""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def walk(self):
        """Each distinct node once, children before parents."""
        seen, order = set(), []

        def go(n):
            if id(n) in seen:
                return
            seen.add(id(n))
            for a in n.args:
                go(a)
            order.append(n)
        go(self)
        return order

    def __repr__(self):
        inner = ", ".join([repr(a) for a in self.attrs] + [f"<{a.op}>" for a in self.args])
        return f"{self.op}({inner}) : {list(self.shape)} {self.dtype}"


@dataclass(frozen=True)
class BufArg:
    """A plan buffer passed as an argument to an eager fallback."""
    name: str


@dataclass
class Buffer:
    name: str
    shape: tuple
    dtype: str
    kind: str  # input | temp | output | external
    strides: tuple | None = None  # None: contiguous (graph outputs keep eager's strides)

    @property
    def layout(self) -> tuple:
        return self.strides if self.strides is not None else contiguous_strides(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class KernelSpec:
    name: str
    roots: list  # [(PNode, buffer name)]
    fx_nodes: list = field(default_factory=list)

    def walk(self):
        seen, order = set(), []
        for root, _ in self.roots:
            for n in root.walk():
                if id(n) not in seen:
                    seen.add(id(n))
                    order.append(n)
        return order


@dataclass
class FallbackStep:
    node: str
    target: Any
    args: Any
    kwargs: Any
    reason: str
    outputs: list  # external buffer names
    multi: bool


@dataclass
class Plan:
    inputs: list  # [Buffer] in call order
    buffers: dict  # name -> Buffer
    steps: list  # KernelSpec | FallbackStep, in execution order
    outputs: list  # per flat output: ("buffer", name) | ("view", BufRef) | ("const", v) | ("opaque", name)
    cost: float = 0.0
    cost_unfused: float = 0.0

    @property
    def kernels(self) -> list[KernelSpec]:
        return [s for s in self.steps if isinstance(s, KernelSpec)]

    @property
    def fallbacks(self) -> list[FallbackStep]:
        return [s for s in self.steps if isinstance(s, FallbackStep)]
