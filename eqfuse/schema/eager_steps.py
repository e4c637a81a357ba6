"""Eager steps that run another implementation of their op.

An eager step runs the ATen op its graph names, except where an implementation of the
same op, as exact, serves its cases better: it is listed in ``SUBSTITUTES`` (op ->
function with the op's signature), and the step's target becomes ``Substitute(op, fn)``.
Reports and the CUDA-graph policy still see the op (``underlying_op``).

The embedding's backward: ATen sorts the token indices and sums each run of equal ones,
about 120 us on an H200 whatever the table (BERT's token-type table of 2 rows took as
long as its vocabulary). Adding each token's gradient row into a float32 table with
atomics (``index_add_``) and rounding once is as exact (both sum in float32 and round
once; the order of the additions differs) and faster for small tables: 2 x 768 rows
50 us against 120, 512 x 768 43 against 125, 30522 x 768 121 against 171, 50257 x 768
(8192 tokens) 165 against 238; for Llama's 128256 x 2048 the float32 table costs more
than the sort (680 against 383 us): ATen's stays there (H200, torch 2.11, bf16, 4096
tokens unless said).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

aten = torch.ops.aten

# Tables up to this many elements take the atomic adds (the crossover above: a float32
# table of V x D costs a fill, the adds and a rounding pass, about 10 bytes an element)
ATOMIC_TABLE_ELEMENTS = 64 * 2**20


def embedding_backward(grad, indices, num_weights: int, padding_idx: int, scale_grad_by_freq: bool):
    """``aten.embedding_dense_backward``, by atomic adds into a float32 table where it is small."""
    width = grad.shape[-1]
    if (scale_grad_by_freq or num_weights * width > ATOMIC_TABLE_ELEMENTS
            or torch.are_deterministic_algorithms_enabled()):
        return aten.embedding_dense_backward(grad, indices, num_weights, padding_idx, scale_grad_by_freq)
    flat = indices.reshape(-1)
    rows = grad.reshape(-1, width).float()
    if padding_idx >= 0:  # the padding row's gradient stays 0 (-1: no padding row)
        rows = rows.masked_fill((flat == padding_idx).unsqueeze(1), 0.0)
    table = torch.zeros((num_weights, width), dtype=torch.float32, device=grad.device)
    return table.index_add_(0, flat, rows).to(grad.dtype)


SUBSTITUTES: dict[Any, Callable] = {
    aten.embedding_dense_backward.default: embedding_backward,
}


@dataclass(frozen=True)
class Substitute:
    """An eager step's op run by another implementation of it."""
    target: Any  # the op the graph names
    run: Callable

    def __call__(self, *args, **kwargs):
        return self.run(*args, **kwargs)


def substituted(target):
    """The step target that runs ``target``: itself, or its substitute."""
    run = SUBSTITUTES.get(target)
    return Substitute(target, run) if run is not None else target


def underlying_op(target):
    """The op a step target runs (through EagerCall's and Substitute's wrapping)."""
    while hasattr(target, "target"):
        target = target.target
    return target


def leaves(value) -> list:
    """The results nested in ``value``'s lists and tuples, in order."""
    if isinstance(value, (list, tuple)):
        return [leaf for v in value for leaf in leaves(v)]
    return [value]


def nested_as(value, entries) -> list:
    """``entries`` (an iterator, one per leaf of ``value``, in order) nested as ``value``'s
    leaves are, in lists. (torch's pytree drops a None, which a result may hold.)"""
    if isinstance(value, (list, tuple)):
        return [nested_as(v, entries) for v in value]
    return next(entries)


def nested(value) -> bool:
    """Whether a result holds a list or tuple inside its own."""
    return isinstance(value, (list, tuple)) and any(isinstance(v, (list, tuple)) for v in value)


@dataclass(frozen=True)
class Flattened:
    """An eager step whose op nests its results (activation checkpointing's random-state
    op returns ``(rng_state, (out, lse))``), run with them flat: one buffer a result."""
    target: Any

    def __call__(self, *args, **kwargs):
        return tuple(leaves(self.target(*args, **kwargs)))
