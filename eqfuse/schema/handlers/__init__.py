"""FX op -> egglog terms, one handler per op, by room. Each handler gets the translator,
the FX node (for its meta) and the resolved arguments, and returns a Computed value (or a
BufferView, for views of inputs); importing the rooms fills the table."""

from . import indexing, pointwise, products, reductions, views  # noqa: F401 - each registers its handlers
from .registry import MOVES, handler_for, has_kernel_form

__all__ = ["MOVES", "handler_for", "has_kernel_form"]
