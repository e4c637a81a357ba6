"""Launching one generated kernel with as little host work per call as possible.

A generated kernel's sizes, block sizes and grid are all fixed when it is generated, so
once Triton has compiled it nothing about a launch is left to decide but the tensors'
addresses. ``kernel[grid](*args, **constexprs)`` still binds every argument, computes a
specialisation key and hashes it, and its launcher asks the driver about every pointer,
on each call. ``KernelLauncher`` goes through Triton's JIT only for the first call with a
given pointer alignment (Triton specialises pointers on 16-byte alignment); later calls
hand the addresses straight to the compiled kernel's C launcher. Under Triton's
interpreter (CPU) it is the plain JIT call.

A kernel that reads or writes through TMA descriptors it makes itself (a matmul's TMA
form) needs those addresses 16-byte aligned, and global scratch memory for the
descriptors. ``aligned`` names the tensors that must be (one bit each) and ``otherwise``
the launcher of the same kernel without TMA, which runs when one is not. Scratch memory
is one buffer per stream, kept for the kernel's life (launches on one stream do not
overlap); Triton's own launches (the first, and any with a profiler listening) get it
through Triton's allocator hook, set around the call only.
"""

from __future__ import annotations

import contextlib
import logging
import threading

import torch
from triton import knobs
from triton.runtime import _allocation

from ..errors import one_line

log = logging.getLogger("eqfuse")

_RUNTIME_KNOBS = knobs.runtime  # launch hooks a profiler sets: read on every launch, as Triton does
# Triton's interpreter patches triton.language's functions for the length of a launch and
# puts them back after: two launches at once in two threads left one kernel calling the
# unpatched functions ("Did you forget to add @triton.jit ?"). Interpreted launches take
# turns; compiled kernels on a GPU do not need to.
INTERPRETER_LOCK = threading.Lock()


def _current_device() -> int:
    """torch.cuda.current_device() without its lazy-init check (a launch has a GPU set up)."""
    return torch._C._cuda_getDevice()


def _listening(hook) -> bool:
    """Triton 3.6 keeps launch hooks in a HookChain, empty unless a profiler added one."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    return torch.empty(size, dtype=torch.uint8, device="cuda")  # the caching allocator aligns to 512 bytes


@contextlib.contextmanager
def triton_scratch():
    """Triton's allocator hook set to torch's allocator for the calls inside (kernels that
    make TMA descriptors ask it for scratch memory); the caller's own hook after."""
    token = _allocation._allocator.set(_scratch)
    try:
        yield
    finally:
        _allocation._allocator.reset(token)


class _Compiled:
    """One compiled specialisation of a kernel, and how to call its C launcher."""

    def __init__(self, kernel, grid: tuple, tail: tuple):
        self.kernel = kernel
        runner = kernel.run  # Triton's CudaLauncher (loads the binary on first access)
        self.prefix = (*grid,)
        self.tail = tail
        # The C entry point takes the addresses as ints (Triton's Python wrapper would also
        # allocate scratch memory, which the kernels eqfuse generates never ask for; the
        # wrapper stays in use where one does, or in a Triton that lays things out otherwise).
        direct = all(hasattr(runner, a) for a in ("launch", "global_scratch_size", "profile_scratch_size",
                                                  "launch_cooperative_grid", "launch_pdl", "num_ctas"))
        self.scratch_bytes = 0
        self.scratch: dict[int, torch.Tensor] = {}  # stream -> global scratch buffer
        if direct and not runner.profile_scratch_size:
            self.c_launch = runner.launch
            self.flags = (runner.launch_cooperative_grid, runner.launch_pdl)
            # Sized as Triton sizes it: per program, per CTA
            self.scratch_bytes = runner.global_scratch_size * runner.num_ctas * grid[0] * grid[1] * grid[2]
        else:
            self.c_launch = None
        self.needs_allocator = bool(getattr(runner, "global_scratch_size", 0))

    def __call__(self, stream, ptrs, tensors):
        k = self.kernel
        enter, leave = _RUNTIME_KNOBS.launch_enter_hook, _RUNTIME_KNOBS.launch_exit_hook
        if _listening(enter) or _listening(leave):  # a profiler: tell it about the launch, as Triton's JIT does
            args = tensors + self.tail
            with triton_scratch() if self.needs_allocator else contextlib.nullcontext():
                k.run(*self.prefix, stream, k.function, k.packed_metadata,
                      k.launch_metadata(self.prefix, stream, *args), enter, leave, *args)
        elif self.c_launch is not None:
            scratch = None
            if self.scratch_bytes:
                buf = self.scratch.get(stream)
                if buf is None:
                    buf = self.scratch[stream] = torch.empty(self.scratch_bytes, dtype=torch.uint8, device="cuda")
                scratch = buf.data_ptr()
            self.c_launch(*self.prefix, stream, k.function, *self.flags, scratch, None, k.packed_metadata,
                          None, None, None, *ptrs, *self.tail)
        else:
            with triton_scratch() if self.needs_allocator else contextlib.nullcontext():
                k.run(*self.prefix, stream, k.function, k.packed_metadata, None, None, None, *tensors, *self.tail)


class KernelLauncher:
    """``launcher(*tensors)`` runs ``fn[grid](*tensors, **constexprs, **options)``, or
    ``otherwise(*tensors)`` where a tensor whose bit is set in ``aligned`` (the first
    tensor the highest bit) does not start on a 16-byte boundary; ``picks``: the positions
    of the tensors ``otherwise`` takes, where it takes others (a template's operands may
    share a buffer the other kernel takes once). While ``deferred`` (a template still
    compiling in the background: parallel_compile._deferrable), ``otherwise`` runs; such a
    kernel skipped the first call's launch check (autotune.choose_configs), so while
    ``unchecked``, a kernel that fails to load gives way to ``otherwise`` for good.
    ``on_checked``: called once, after the kernel's own first launch has run (the build
    stores its plan cache entry then: pipeline._store_once_run)."""

    def __init__(self, fn, grid: tuple, constexprs: dict, *, aligned: int = 0, otherwise=None,
                 picks: tuple | None = None, **options):
        self.fn = fn
        self.need = aligned
        self.otherwise = otherwise
        self.picks = picks
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.constexprs = constexprs
        self.options = options
        self.interpreted = type(fn).__name__ == "InterpretedFunction"
        self.deferred = False
        self.unchecked = False
        self.on_checked = None
        self._compiled: dict[tuple, _Compiled] = {}  # (device, each pointer 16-byte aligned?) -> kernel

    def __call__(self, *tensors):
        if self.interpreted:
            if self.deferred or self.need and self._alignment(tensors) & self.need != self.need:
                return self.otherwise(*self._otherwise_args(tensors))
            with INTERPRETER_LOCK:
                self.fn[self.grid](*tensors, **self.constexprs, **self.options)
            if self.on_checked is not None:
                self._ran()
            return
        # Keyed like Triton's own cache: by the current device (kernels are loaded per device,
        # and, as with Triton's JIT, eqfuse launches on the current one) and pointer alignment,
        # one bit per pointer. A plain loop: this runs on every launch.
        ptrs = []
        aligned = 0
        for t in tensors:
            p = t.data_ptr()
            ptrs.append(p)
            aligned = aligned << 1 | (p & 15 == 0)
        if aligned & self.need != self.need or self.deferred:
            return self.otherwise(*self._otherwise_args(tensors))
        device = _current_device()
        key = (device, aligned)
        compiled = self._compiled.get(key)
        if compiled is None:  # through the JIT, which compiles if needed
            try:
                with triton_scratch():
                    kernel = self.fn[self.grid](*tensors, **self.constexprs, **self.options)
            except Exception as e:
                if not self.unchecked:
                    raise
                log.warning("eqfuse: a kernel does not run on this device, its twin runs instead: %s", one_line(e))
                self.deferred = True
                return self.otherwise(*self._otherwise_args(tensors))
            self._ran()
            tail = tuple(self.constexprs[name] for name in self.fn.arg_names[len(tensors):])
            self._compiled[key] = _Compiled(kernel, self.grid, tail)
            return
        compiled(torch._C._cuda_getCurrentRawStream(device), ptrs, tensors)

    def _ran(self) -> None:
        """The kernel's own launch has run: checked, ``on_checked`` told (once)."""
        self.unchecked = False
        hook, self.on_checked = self.on_checked, None
        if hook is not None:
            try:
                hook()
            except Exception as e:  # noqa: BLE001 - the user's call must not fail over bookkeeping
                log.warning("eqfuse: after %s first ran: %s", getattr(self.fn, "__name__", "a kernel"), one_line(e))

    def resolve(self, tensors) -> tuple[KernelLauncher, tuple]:
        """The launcher that runs for ``tensors``, and its arguments: this one, or, where an
        address TMA needs aligned is not, the twin without TMA (what parallel_compile
        compiles ahead)."""
        if self.need and self._alignment(tensors) & self.need != self.need:
            return self.otherwise.resolve(self._otherwise_args(tensors))
        return self, tuple(tensors)

    def _otherwise_args(self, tensors) -> tuple:
        return tuple(tensors) if self.picks is None else tuple(tensors[i] for i in self.picks)

    @staticmethod
    def _alignment(tensors) -> int:
        bits = 0
        for t in tensors:
            bits = bits << 1 | (t.data_ptr() & 15 == 0)
        return bits


def deferred_launchers(module) -> dict:
    """kernel name -> launcher, for a loaded generated module's launchers that run their
    twin while their own kernel still compiles (parallel_compile._deferrable)."""
    return {name[:-len("_launch")]: x for name, x in vars(module).items()
            if name.endswith("_launch") and getattr(x, "deferred", False)}


def at_size(rule, size: int) -> int:
    """A number of a sized module at ``size`` by its rule: ``(c, k)``, k + c * size, or
    ``c``, c * size."""
    c, k = rule if isinstance(rule, tuple) else (rule, 0)
    return k + c * size


class SizedLauncher:
    """``launcher(size, *tensors)``: a kernel of a sized module (codegen/sized.py), whose
    sizes along the graph's dynamic dimension are ``at_size(per_size[name], size)``. The kernel
    takes those as runtime arguments, so every size runs the same compiled kernel (Triton
    compiles one more where an argument's divisibility by 16 changes, as its JIT does for
    any int). The grid is ``grid`` (formulas over the sizes, export.grid_formula) at that
    size; each size gets its own KernelLauncher, made at its first launch."""

    def __init__(self, fn, grid: list, sizes: dict, per_size: dict, args: tuple, *, aligned: int = 0,
                 otherwise=None, **options):
        self.fn = fn
        self.grid = grid
        self.sizes = sizes  # every name the grid or the kernel reads, at the size the module was made at
        self.per_size = per_size
        self.args = args  # the names passed to the kernel (sizes, block sizes), in its order
        self.need = aligned
        self.otherwise = otherwise
        self.options = options
        self._at: dict[int, KernelLauncher] = {}

    def at(self, size: int) -> KernelLauncher:
        launcher = self._at.get(size)
        if launcher is None:
            from ..export import evaluate_grid_formula
            sizes = {**self.sizes, **{k: at_size(rule, size) for k, rule in self.per_size.items()}}
            otherwise = self.otherwise.at(size) if self.otherwise is not None else None
            launcher = self._at[size] = KernelLauncher(
                self.fn, evaluate_grid_formula(self.grid, sizes), {k: sizes[k] for k in self.args},
                aligned=self.need, otherwise=otherwise, **self.options)
        return launcher

    def __call__(self, size: int, *tensors):
        self.at(size)(*tensors)
