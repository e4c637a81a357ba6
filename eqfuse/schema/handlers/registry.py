"""The table of op handlers: FX target -> the function that writes its terms."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import ops
from ..ops import dtype_name
from ..values import BufferView, Computed, node_meta

# --- op handlers -----------------------------------------------------------------------------
# Each handler gets the translator, the FX node (for its meta) and the resolved arguments,
# and returns a Computed value (or a BufferView, for views of inputs).

HANDLERS: dict[Any, Callable] = {}


def handler_for(target) -> Callable | None:
    return HANDLERS.get(target) or HANDLERS.get(getattr(target, "overloadpacket", None))


def has_kernel_form(target) -> bool:
    """Whether eqfuse translates ``target`` into kernels (the rest runs in eager)."""
    return handler_for(target) is not None


def handles(*targets):
    def deco(fn):
        for t in targets:
            HANDLERS[t] = fn
        return fn
    return deco


def out_type(node):
    m = node_meta(node)
    return tuple(m.shape), dtype_name(m.dtype)


def promotion_meta(arg):
    """A stand-in tensor for torch's type promotion."""
    if isinstance(arg, (BufferView, Computed)):
        return torch.empty((1,) * max(len(arg.shape), 1), dtype=ops.DTYPES[arg.dtype], device="meta") \
            if len(arg.shape) else torch.empty((), dtype=ops.DTYPES[arg.dtype], device="meta")
    return arg


# Handlers that only move values (views, copies, concatenations): under
# emulate_precision_casts their results need no rounding, their operands having had theirs,
# and a rounding left out keeps the views rules free to compose them.
MOVES: set[Callable] = set()


def moves_values(fn):
    MOVES.add(fn)
    return fn
