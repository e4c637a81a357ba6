"""Replaying a compiled graph's launches from CUDA graphs.

A CUDA graph launches every kernel of a recording with one call, but it bakes in the
addresses it was recorded with: the inputs' and those of every buffer it allocated. So a
recording serves only calls whose inputs live at the same addresses as when it was made
(model weights, a static input buffer, a tensor reused in a loop): the first call with a
set of addresses launches kernel by kernel, the second records. Calls with other
addresses launch kernel by kernel, as without CUDA graphs; nothing is copied in.

A recording's outputs are its own buffers, which its next replay overwrites. So a
recording is replayed only when the caller no longer holds any of its outputs (nor a view
of one); each set of addresses keeps up to two recordings, enough for
``y = f(x)`` in a loop, where the previous ``y`` is still held during the call. When the
caller holds the outputs of both, the call launches kernel by kernel into fresh buffers.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

log = logging.getLogger("eqfuse")

RECORDINGS_PER_ADDRESS_SET = 2
ADDRESS_SETS = 4  # recorded per compiled variant; more addresses launch kernel by kernel
SEEN_LIMIT = 64  # address sets remembered while waiting for a second sighting


_storage_use_count = torch._C._storage_Use_Count


@dataclass
class _Recording:
    graph: torch.cuda.CUDAGraph
    outputs: list  # the tensors every replay returns
    owned: list  # those of them in the recording's memory (not views of inputs)
    storages: list  # their storages
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


class GraphReplayer:
    """``replayer(inputs)`` returns what ``launch(*inputs)`` would (a flat list of tensors)."""

    def __init__(self, launch: Callable, fixed_inputs: tuple = ()):
        self.launch = launch
        self.fixed_inputs = fixed_inputs  # constants the graph also reads (their addresses never change)
        self._recordings: dict[tuple, list[_Recording]] = {}
        self._seen: set[tuple] = set()
        self.disabled: str | None = None  # why this graph does not record, once it failed to
        self.replays = 0  # calls served by a replay (tests and benchmarks read it)

    def __call__(self, inputs: tuple) -> list:
        if self.disabled is not None or torch._C._cuda_isCurrentStreamCapturing():
            return self.launch(*inputs)  # inside the caller's own capture: just launch
        key = tuple([x.data_ptr() for x in inputs])
        recordings = self._recordings.get(key)
        if recordings is None:
            if key not in self._seen or len(self._recordings) >= ADDRESS_SETS:
                if len(self._seen) >= SEEN_LIMIT:
                    self._seen.clear()
                self._seen.add(key)
                return self.launch(*inputs)
            recordings = self._recordings[key] = []
        for rec in recordings:
            if rec.free():
                rec.graph.replay()
                self.replays += 1
                return rec.outputs
        if len(recordings) < RECORDINGS_PER_ADDRESS_SET:
            rec = self._record(inputs)
            if rec is not None:
                rec.seal()  # the recording's frame is gone: only ``rec`` holds the outputs
                recordings.append(rec)
                rec.graph.replay()
                self.replays += 1
                return rec.outputs
        return self.launch(*inputs)

    def _record(self, inputs) -> _Recording | None:
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                outputs = self.launch(*inputs)
        except Exception as e:  # noqa: BLE001 - a graph that cannot be recorded still runs
            self.disabled = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            log.warning("eqfuse: CUDA graph recording failed, launching kernel by kernel: %s", self.disabled)
            return None
        if not all(isinstance(o, torch.Tensor) for o in outputs):
            self.disabled = "an output is not a tensor"
            return None
        caller_owned = {x.untyped_storage().data_ptr() for x in (*inputs, *self.fixed_inputs)}
        # An output that is a view of an input is the caller's memory, not the recording's.
        owned = [o for o in outputs if o.untyped_storage().data_ptr() not in caller_owned]
        storages = list({o.untyped_storage().data_ptr(): o.untyped_storage() for o in owned}.values())
        return _Recording(graph, list(outputs), owned, storages)
