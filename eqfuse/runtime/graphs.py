"""Replaying a compiled graph's launches from CUDA graphs.

A CUDA graph launches every kernel of a recording with one call, but it bakes in the
addresses it was recorded with: the inputs' and those of every buffer it allocated. So a
recording serves only calls whose inputs live at the same addresses as when it was made
(model weights, a static input buffer, a tensor reused in a loop): the first call with a
set of addresses launches kernel by kernel, the second records. Up to ADDRESS_SETS sets
are recorded; a new one lets go of the least recently used (a generation's static cache,
new tensors on each call, is used for the call's every token, then never again).

Except for inputs that move from call to call while the rest stay (a training step's
upstream gradient, a new batch beside the weights): where copying them costs little
against the graph's own time (``copy_bytes``), they are copied into buffers of the
recording before each replay. Which inputs those are is settled at the first recording,
by comparing the call with the ones before it.

A recording's outputs are its own buffers, which its next replay overwrites. So a
recording is replayed only when the caller no longer holds any of its outputs (nor a view
of one, nor the parameter's .grad that autograd made of one); each set of addresses keeps
up to two recordings, enough for ``y = f(x)`` in a loop, where the previous ``y`` is still
held during the call. When the caller holds the outputs of both, the call launches kernel
by kernel into fresh buffers.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..errors import one_line
from ..frontend.writes import strided_copy

log = logging.getLogger("eqfuse")

# Eager ops a recording may hold: each only launches kernels on the current stream, with
# its memory from the caching allocator, and never waits for the GPU (an op that reads a
# result on the host, such as nonzero or .item(), or one that draws random numbers, is not
# here). The attention ops draw random numbers only for dropout: recordable without it.
# index.Tensor is, with integer indices (a bool mask calls nonzero); the embedding's
# backward is, without scale_grad_by_freq (ATen's sums runs of sorted indices with a
# bound on their count instead of reading it: recorded on an H200 with torch 2.11).
# A recording that fails anyway runs kernel by kernel, with a warning.
RECORDABLE_EAGER_OPS = frozenset({
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
    "embedding", "index_select", "gather", "index", "embedding_dense_backward",
    # ViT's patch embedding (cuDNN, its workspace from the caching allocator); padding,
    # scans, sorts and selections of a fixed size (OPT's positions, a mixture of experts' routing)
    "convolution", "constant_pad_nd", "cumsum", "sort", "topk", "div",
    "empty", "empty_permuted",  # allocations from the caching allocator (empty: from_fx.EmptyTensor)
    "copy_", "index_copy_", "index_put_",  # writes into an input (frontend/writes.py)
})

_CONSTANTS = (type(None), bool, int, float)

RECORDINGS_PER_ADDRESS_SET = 2
ADDRESS_SETS = 4  # recorded per compiled variant; a new one lets go of the least recently used
SEEN_LIMIT = 64  # address sets remembered while waiting for a second sighting
RECENT_CALLS = 4  # calls compared with the next one for inputs to copy in


_storage_use_count = torch._C._storage_Use_Count


@dataclass
class _Recording:
    graph: torch.cuda.CUDAGraph
    outputs: list  # the tensors every replay returns
    owned: list  # those of them in the recording's memory (not views of inputs)
    storages: list  # their storages
    copied_inputs: list  # where the inputs that move between calls are copied before a replay
    # output position -> (input position, None or the view's (shape, strides, offset)): outputs
    # that are inputs, or views of them, which a replay returns of the call's own inputs
    aliases: dict = field(default_factory=dict)
    alone: list | None = None  # reference counts when only the recording holds them: see seal()
    storage_handles: list = field(default_factory=list)  # the storages' C handles, read once

    def seal(self) -> None:
        """Count references now: to be called where nothing but the recording holds its outputs."""
        self.storage_handles = [s._cdata for s in self.storages]
        self.alone = self.references()

    def references(self) -> list:
        """Who holds the outputs: the caller may hold a tensor we returned (its Python
        references, or C++ ones such as autograd's), or a view of one (its storage's).
        Checked on every replay, so a plain loop (a comprehension costs a frame each)."""
        counts = []
        for t in self.owned:
            counts.append(sys.getrefcount(t))
            counts.append(t._use_count())
        for handle in self.storage_handles:
            counts.append(_storage_use_count(handle))
        return counts

    def free(self) -> bool:
        """No one but this recording holds its outputs' memory: a replay may overwrite it."""
        return self.references() == self.alone


def unrecordable(steps, dtypes: dict | None = None) -> str | None:
    """Why a graph with these eager steps (plan.FallbackStep) cannot be recorded, or None.
    ``dtypes``: buffer name -> dtype name, for the indices an ``index`` step reads."""
    from torch.fx.operator_schemas import normalize_function

    from ..schema.eager_steps import underlying_op
    from ..schema.from_fx import step_op

    for step in steps:
        name = step_op(step.target)
        if name not in RECORDABLE_EAGER_OPS:
            return f"its eager step {step.node} ({name}) may wait for the GPU or allocate outside a recording"
        if name == "empty":
            continue
        arguments = normalize_function(underlying_op(step.target), step.args, step.kwargs,
                                       normalize_to_only_use_kwargs=True).kwargs
        if arguments.get("dropout_p"):
            return f"its eager step {step.node} draws random numbers (dropout)"
        if name == "index_put_" and arguments.get("accumulate"):
            return f"its eager step {step.node} (index_put_) accumulates, sorting its indices"
        if arguments.get("scale_grad_by_freq"):
            return f"its eager step {step.node} ({name}) counts the indices on the host (scale_grad_by_freq)"
        indices = (arguments.get("indices") or ()) if name in ("index", "index_put_") else ()
        if not all(_integer(i, dtypes or {}) for i in indices if i is not None):
            return f"its eager step {step.node} ({name}) may take a bool mask, which waits for the GPU (nonzero)"
    return None


def _integer(ref, dtypes: dict) -> bool:
    """Whether the buffer an eager step reads (values.BufRef / plan.BufArg) holds integers."""
    from ..schema import ops

    dtype = dtypes.get(getattr(ref, "buf", None) or getattr(ref, "name", None))
    return dtype in ops.DTYPES and not ops.is_float(dtype) and dtype not in ("bool", "uint8")  # uint8: a mask


class GraphReplayer:
    """``replayer(inputs)`` returns what ``launch(*inputs)`` would (a flat list of tensors)."""

    def __init__(self, launch: Callable, fixed_inputs: tuple = (), copy_bytes: int = 0, copy_count: int = 0,
                 deferred: list = (), name: str = "graph", written: tuple = ()):
        self.launch = launch
        # The inputs the graph writes (frontend/writes.py): never copied in, where the write
        # would land in the recording's copy instead of the caller's tensor
        self.written = frozenset(written)
        self.name = name  # for the debug log
        # Launchers running a twin while their own kernel compiles (parallel_compile._deferrable):
        # a recording made meanwhile would replay the twin for good, so none is made until they run their own
        self.deferred = list(deferred)
        self.fixed_inputs = fixed_inputs  # constants the graph also reads (their addresses never change)
        self.copy_limits = (copy_count, copy_bytes)  # the most inputs, and bytes, a replay may copy in
        self.copied: tuple = ()  # positions of the inputs copied in; settled at the first recording
        self._kept: tuple | None = None  # the other positions, which key the recordings (None: all)
        self._recordings: dict[tuple, list[_Recording]] = {}  # least recently used first
        self._last: tuple | None = None  # the key of the last call served from a recording
        self._seen: set[tuple] = set()  # keys of calls not recorded yet
        self._recent: list[tuple] = []  # every input's address, for the last few calls before a recording
        self.disabled: str | None = None  # why this graph does not record, once it failed to
        self.replays = 0  # calls served by a replay (tests and benchmarks read it)

    def __call__(self, inputs: tuple) -> list:
        if self.disabled is not None or torch._C._cuda_isCurrentStreamCapturing():
            return self.launch(*inputs)  # inside the caller's own capture: just launch
        if self.deferred:
            ready = not any(launcher.deferred for launcher in self.deferred)
            if ready:  # their kernels' first launch, outside a recording (it loads them)
                self.deferred = []
            return self.launch(*inputs)
        ptrs = tuple([x.data_ptr() for x in inputs])
        key = self._key(ptrs)
        recordings = self._recordings.get(key)
        if recordings is None:
            if not self._second_sighting(ptrs, inputs) or not self._room():
                log.debug("eqfuse: %s: inputs at new addresses (%d sets recorded): launching kernel by kernel",
                          self.name, len(self._recordings))
                return self.launch(*inputs)
            recordings = self._recordings[self._key(ptrs)] = []  # keyed anew: copying in may have just been settled
        elif key != self._last:  # the most recently used set last: the first is the one to let go of
            self._recordings[key] = self._recordings.pop(key)
        self._last = key
        for rec in recordings:
            if rec.free():
                return self._replay(rec, inputs)
        if len(recordings) < RECORDINGS_PER_ADDRESS_SET:
            log.debug("eqfuse: %s: recording a CUDA graph (%d at these addresses)", self.name, len(recordings))
            rec = self._record(inputs)
            if rec is not None:
                rec.seal()  # the recording's frame is gone: only ``rec`` holds the outputs
                recordings.append(rec)
                return self._replay(rec, inputs)
        log.debug("eqfuse: %s: the caller holds the outputs of every recording: launching kernel by kernel",
                  self.name)
        return self.launch(*inputs)

    def _room(self) -> bool:
        """Whether a new set of addresses may be recorded: under ADDRESS_SETS, or once the
        least recently used set whose outputs no one holds is let go of (its graphs' memory
        with it). A set is often used for a while, then never again: transformers' static
        cache is new tensors on each ``generate`` call, so that a decode step recorded
        for the first four calls launched kernel by kernel from the fifth on."""
        if len(self._recordings) < ADDRESS_SETS:
            return True
        for key, recordings in self._recordings.items():
            if all(rec.free() for rec in recordings):
                del self._recordings[key]
                log.debug("eqfuse: %s: letting go of the recordings of addresses not used lately", self.name)
                return True
        return False

    def _replay(self, rec: _Recording, inputs) -> list:
        for i, buffer in zip(self.copied, rec.copied_inputs):
            buffer.copy_(inputs[i])
        rec.graph.replay()
        self.replays += 1
        # New tensors over the recording's memory, not the recording's own tensors: autograd
        # adopts a gradient as the parameter's .grad only where nothing else holds that
        # tensor, and copies it otherwise (GPT-NeoX's backward on an H200: 24 copies of
        # every weight's gradient a step). Who holds the memory, the recording tells by its
        # storages' use counts (_Recording.free), which the new tensors count in. (By
        # identity: a tensor the graph returns twice is one new tensor, twice.)
        fresh: dict[int, torch.Tensor] = {}
        outputs = [fresh.setdefault(id(o), o.detach()) if isinstance(o, torch.Tensor) else o for o in rec.outputs]
        for position, (i, view) in rec.aliases.items():
            outputs[position] = inputs[i] if view is None else inputs[i].as_strided(*view)
        return outputs

    def _key(self, ptrs: tuple) -> tuple:
        """The addresses that key a recording: all, or those of the inputs not copied in."""
        return ptrs if self._kept is None else tuple([ptrs[i] for i in self._kept])

    def _second_sighting(self, ptrs: tuple, inputs) -> bool:
        """Whether a call at these addresses has come before (so it is worth recording),
        taking its moving inputs to copy in if no recording has settled them yet."""
        key = self._key(ptrs)
        if key in self._seen:
            return True
        if not self._recordings and self.copy_limits[0]:
            for before in self._recent:
                moved = tuple(i for i, (a, b) in enumerate(zip(before, ptrs)) if a != b)
                if not self.written.intersection(moved) and _copyable(inputs, moved, *self.copy_limits):
                    self._copy_in(moved, len(ptrs))
                    return True
            self._recent = [ptrs, *self._recent[:RECENT_CALLS - 1]]
        if len(self._seen) >= SEEN_LIMIT:
            self._seen.clear()
        self._seen.add(key)
        return False

    def _copy_in(self, positions: tuple, count: int) -> None:
        self.copied = positions
        self._kept = tuple(i for i in range(count) if i not in positions)
        self._seen = set()
        self._recent = []

    def _record(self, inputs) -> _Recording | None:
        copied_inputs = [strided_copy(inputs[i]) for i in self.copied]
        staged = list(inputs)
        for i, buffer in zip(self.copied, copied_inputs):
            staged[i] = buffer
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                outputs = self.launch(*staged)
        except Exception as e:  # noqa: BLE001 - a graph that cannot be recorded still runs
            self.disabled = one_line(e)
            log.warning("eqfuse: CUDA graph recording failed, launching kernel by kernel: %s", self.disabled)
            return None
        # Besides tensors, a graph returns constants (None for a gradient that no input
        # needs, sizes an attention op reports), the same on every call of one signature
        odd = next((o for o in outputs if not isinstance(o, (torch.Tensor, *_CONSTANTS))), None)
        if odd is not None:
            self.disabled = f"an output is a {type(odd).__name__}"
            return None
        tensors = [o for o in outputs if isinstance(o, torch.Tensor)]
        if {o.untyped_storage().data_ptr() for o in tensors} & {b.untyped_storage().data_ptr() for b in copied_inputs}:
            # An output is a view of an input that moves (a training forward saving its
            # token ids): it must be the caller's, not our copy. Copy nothing then: record
            # where every address comes back
            self.copy_limits, self.copied, self._kept = (0, 0), (), None
            self._recordings.clear()
            return None
        caller_owned = {x.untyped_storage().data_ptr() for x in (*inputs, *self.fixed_inputs)}
        # An output that is a view of an input is the caller's memory, not the recording's.
        owned = [o for o in tensors if o.untyped_storage().data_ptr() not in caller_owned]
        storages = list({o.untyped_storage().data_ptr(): o.untyped_storage() for o in owned}.values())
        # Nor does the recording keep it: a replay returns it of that call's inputs (at the
        # same addresses). Kept, it would hold the caller's tensor of the recorded call, and
        # with it the memory of whatever recording made that tensor: a training step's
        # logits, which the loss's graph returns for its backward, kept the model's forward
        # from replaying at all (GPT-2 on an H200: every step launched kernel by kernel).
        by_storage = {x.untyped_storage().data_ptr(): i for i, x in enumerate(inputs)}
        by_identity = {id(x): i for i, x in enumerate(inputs)}
        aliases, kept = {}, list(outputs)
        for position, o in enumerate(outputs):
            if not isinstance(o, torch.Tensor):
                continue
            if id(o) in by_identity:
                aliases[position] = (by_identity[id(o)], None)
            elif o.untyped_storage().data_ptr() in by_storage:
                aliases[position] = (by_storage[o.untyped_storage().data_ptr()],
                                     (tuple(o.shape), o.stride(), o.storage_offset()))
            else:
                continue
            kept[position] = None
        return _Recording(graph, kept, owned, storages, copied_inputs=copied_inputs, aliases=aliases)


def _copyable(inputs, positions: tuple, count: int, budget: int) -> bool:
    """Whether the inputs at ``positions`` (some, not all) can be copied in: at most ``count``
    of them and ``budget`` bytes, none a view that overlaps itself (an expanded tensor),
    which a copy could not be written into."""
    if not positions or len(positions) > count or len(positions) == len(inputs):
        return False
    if not all(_non_overlapping(inputs[i]) for i in positions):
        return False
    return sum(inputs[i].numel() * inputs[i].element_size() for i in positions) <= budget


def _non_overlapping(x: torch.Tensor) -> bool:
    """No two elements of ``x`` share an address: along its dims by increasing stride, each
    stride reaches past every element of the dims inside it."""
    reach = 0
    for stride, size in sorted((st, n) for st, n in zip(x.stride(), x.shape) if n > 1):
        if stride <= reach:
            return False
        reach += stride * (size - 1)
    return True
