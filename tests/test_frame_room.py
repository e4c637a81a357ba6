"""with_frame_room: a build's calls never straddle a boundary of CPython's frame stack.

CPython 3.11 and 3.12 map a chunk of frame stack for a call that does not fit the chunk in
hand and unmap it on return: a loop of calls at that depth faults in a fresh page per call
(CPython gh-142183). Which depth it is depends on the caller, so the test looks for it."""

import resource
import sys

import pytest

from eqfuse.frame_room import with_frame_room


def _leaf():
    return None


# A frame of 64 stack slots (512 bytes), more than a step of ``_descend`` moves the stack
# by: some depth leaves less room in its chunk than ``_leaf`` needs.
_leaf.__code__ = _leaf.__code__.replace(co_stacksize=64)

CALLS = 2000


def _calls():
    for _ in range(CALLS):
        _leaf()


def _descend(depth, body):
    return body() if depth == 0 else _descend(depth - 1, body)


def _page_faults(depth, body) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    _descend(depth, body)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def _straddling_depths() -> list[int]:
    """The depths (in ``_descend`` frames, over more than a 16 KiB chunk) at which a loop of
    calls faults a page in per call or so."""
    return [d for d in range(600) if _page_faults(d, _calls) > CALLS // 2]


def test_a_call_loop_placed_anywhere_runs_in_room():
    straddling = _straddling_depths()
    if sys.version_info >= (3, 13):  # the interpreter caches a chunk: no depth thrashes
        assert straddling == []
        return
    assert straddling, "no depth found at which calls map a chunk each (has CPython's frame stack changed?)"
    for d in straddling:
        assert _page_faults(d, lambda: with_frame_room(_calls)) < CALLS // 10


def test_with_frame_room_passes_arguments_results_and_errors():
    assert with_frame_room(lambda a, b=0: (a, b), 1, b=2) == (1, 2)
    with pytest.raises(KeyError, match="gone"):
        with_frame_room(lambda: {}["gone"])
