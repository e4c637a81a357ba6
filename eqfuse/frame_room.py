"""Room on CPython's frame stack for a build's hot loops.

CPython 3.11 and 3.12 keep Python frames in chunks of 16 KiB, each mapped with mmap: a
call whose frame does not fit in the chunk in hand maps a new chunk, and the return that
empties that chunk unmaps it (CPython gh-142183; 3.13 and 3.14 keep one chunk cached
since their 2026 fixes). A loop whose calls cross that boundary maps and unmaps a chunk
per call. Where the boundary falls depends on how deep the caller stands: dynamo's
frames, the autograd engine's, a script's own. GPT-NeoX's training backward built from a
plain script made 350 000 mmap/munmap pairs, 2-6 s of system time, and took 1.3-1.5 s to
translate and 2.4-8 s to extract; run from one frame deeper (``runpy``), 1.7 s to extract.

``with_frame_room`` calls a function from a frame that reserves 32 KiB of stack slots.
That frame fits no 16 KiB chunk, so it starts a fresh chunk of 64 KiB, and the frames
the function pushes have about 31 KiB before the next boundary, wherever the caller
stood: the same backward translated in 0.56-0.65 s and extracted in 1.6-1.8 s, with no
system time to speak of. It costs one mapped chunk per call, so it is for a build's
entry, never for a compiled graph's per-call path.
"""

from __future__ import annotations

ROOM_SLOTS = 4096  # stack slots of 8 bytes: a 32 KiB frame, in a chunk of 64 KiB


def _call(fn, args, kwargs):
    return fn(*args, **kwargs)


# The code's declared stack depth sets its frame's size; a deeper one than the code uses
# is only unused room (the interpreter reserves it and never reads it).
_call.__code__ = _call.__code__.replace(co_stacksize=ROOM_SLOTS)


def with_frame_room(fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, its frames at the start of a fresh chunk of CPython's frame stack."""
    return _call(fn, args, kwargs)
