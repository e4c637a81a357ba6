"""Compiling a module's Triton kernels in worker processes before their first launch.

Triton compiles a ``@jit`` kernel lazily, at its first launch, in the launching process:
a graph of 36 kernels compiled them one after the other, about 24 s of a Llama layer's
cold compile on an H100. As Inductor does, eqfuse hands them to a pool of worker
processes instead: each worker runs ``triton.compile`` for a kernel exactly as the JIT
would, which fills Triton's on-disk cache (and builds the kernel's C launcher), so the
first launch in this process only loads the binary.

"Exactly as the JIT would" is what makes this work: the specialisation key must be the
same or the first launch compiles again. ``specialisation`` reads it with the JIT's own
binder and argument packing (Triton 3.6's ``JITFunction.run`` and ``_pack_args``) from
the launch's arguments: the dtype of every pointer, whether its address is 16-byte
aligned (real tensors, or ``Pointer`` for a launch whose tensors do not exist yet), the
constexprs and num_warps/num_stages. The worker loads the same generated file (Triton
hashes the kernel's source and its line number) and gets this process's cache-
invalidating environment and ptxas (the version in the key and the binary run, see
``_ptxas``), so both hash the same key. A worker whose key differs all the same sends its
parts, and the report names those that differ.

The pool starts once per process, when the first CUDA graph is built (its workers import
Triton, not torch, while the graph is captured), with one worker per CPU (at most 32;
``EQFUSE_COMPILE_WORKERS`` sets the number), and stops at exit. What Triton does once a
process (hashing its own files for the key, building its driver's C module) is done by
child processes beside the build (``ready_triton_ahead``). Kernels already
in Triton's cache are not sent. A build's first call waits for its kernels, all but a
template that takes seconds and has a portable twin: that one compiles on while the twin
runs (``_deferrable``). Whatever goes wrong (a worker that does not start or
dies, a Triton that packs arguments otherwise) leaves the kernels to the JIT, compiled at
their first launch as before, with a one-line note in the graph's report. Off on the
CPU (the interpreter compiles nothing), with ``parallel_compile=False`` or
``EQFUSE_PARALLEL_COMPILE=0``.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import os
import pickle
import select
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import one_line
from .cache import switched_on

ENV_SWITCH = "EQFUSE_PARALLEL_COMPILE"  # "0" turns the pool off
ENV_WORKERS = "EQFUSE_COMPILE_WORKERS"  # number of worker processes
ENV_TIMEOUT = "EQFUSE_COMPILE_TIMEOUT"  # seconds one kernel may take in a worker
MAX_WORKERS = 32  # as Inductor caps its compile threads
DEFAULT_TIMEOUT_S = 600.0


def enabled(option: bool = True) -> bool:
    """The option, unless ``EQFUSE_PARALLEL_COMPILE=0`` turns it off."""
    return switched_on(ENV_SWITCH, option)


def worker_count() -> int:
    env = os.environ.get(ENV_WORKERS)
    if env:
        try:
            return max(0, int(env))
        except ValueError:
            pass
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return min(MAX_WORKERS, cpus)


class Pointer:
    """What Triton's JIT reads of a tensor argument to specialise a kernel on it: the dtype,
    and whether the address is a multiple of 16 bytes."""

    def __init__(self, dtype, aligned: bool = True):
        self.dtype = dtype
        self.aligned = aligned

    def data_ptr(self) -> int:
        return 0 if self.aligned else 8

    def __repr__(self):
        return f"Pointer({self.dtype}, aligned={self.aligned})"


@dataclass
class Job:
    """One kernel to compile: where its function lives, and its specialisation."""
    path: str  # the generated module's file
    name: str  # the @jit function in it
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict  # the backend options' fields, as the JIT passes them to triton.compile
    target: tuple  # GPUTarget's (backend, arch, warp_size)
    env_vars: dict  # Triton's cache-invalidating environment, as this process sees it
    cache_dir: str
    hash: str = ""  # the cache key triton.compile will file it under
    ptxas_version: str = ""  # CUDA: the ptxas version this process's JIT keys kernels by (see _ptxas)
    ptxas_path: str = ""  # and the ptxas it would run
    triton_key: tuple = ()  # (Triton's files, their hash in every key): see _triton_key


@dataclass
class Outcome:
    """What one precompile did, for the graph's report."""
    kernels: int = 0  # distinct kernel specialisations asked for
    cached: int = 0  # already in Triton's cache
    compiled: int = 0  # compiled by the pool
    workers: int = 0
    seconds: float = 0.0
    prepare_seconds: float = 0.0  # of which making the jobs, before the first is sent
    slowest_reply: float = 0.0  # the longest a job took from being sent to its reply
    failed: list = field(default_factory=list)  # "kernel: why": left to compile at first launch
    worker_seconds: float = 0.0  # the compiles' own seconds, added up (what one process would take)
    launcher_seconds: float = 0.0  # of which waiting for C launchers (a C compile per new signature)
    slowest: tuple = ()  # (kernel, seconds) of the longest compile: the least a batch can take
    note: str = ""  # why the pool was not used, where it was meant to be
    background: list = field(default_factory=list)  # templates not waited for (see _deferrable)

    def as_dict(self) -> dict:
        d = {"kernels": self.kernels, "cached": self.cached, "compiled_in_pool": self.compiled,
             "workers": self.workers, "seconds": round(self.seconds, 4)}
        if self.compiled:
            d["prepare_seconds"] = round(self.prepare_seconds, 3)
            d["slowest_reply_seconds"] = round(self.slowest_reply, 2)
            d["worker_seconds"] = round(self.worker_seconds, 2)
            d["launcher_seconds"] = round(self.launcher_seconds, 2)
            d["slowest"] = f"{self.slowest[0]} {self.slowest[1]:.2f} s"
        if self.failed:
            d["failed"] = list(self.failed)
        if self.background:
            d["compiling_in_background"] = list(self.background)
        if self.note:
            d["note"] = self.note
        return d


# --- the specialisation, read as the JIT reads it -------------------------------------------

def current_target() -> tuple:
    from triton.runtime import driver
    t = driver.active.get_current_target()
    return (t.backend, t.arch, t.warp_size)


def _backend(target: tuple):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    return make_backend(GPUTarget(*target))


def specialisation(launcher, args, target: tuple, backend=None) -> Job:
    """The job that compiles what ``launcher(*args)`` would compile at its first launch:
    the launcher's own kernel, or its twin without TMA where an address is not aligned."""
    from triton import knobs
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.runtime.jit import create_function_from_signature

    launcher, args = launcher.resolve(args)
    fn = launcher.fn
    backend = backend or _backend(target)
    # JITFunction.run: the call's keywords, with the two it adds itself
    kwargs = {**launcher.constexprs, **launcher.options}
    kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound_args, spec, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound_args, spec, options)
    job = Job(path=fn.fn.__code__.co_filename, name=fn.fn.__name__, signature=signature, constexprs=constexprs,
              attrs=attrs, options=dict(options.__dict__), target=tuple(target),
              env_vars=get_cache_invalidating_env_vars(), cache_dir=knobs.cache.dir)
    job.hash = _cache_hash(fn, job, backend)
    return job


def _key_inputs(fn, job: Job, backend):
    """The source and options triton.compile builds its key from (its first lines, as of
    Triton 3.6)."""
    from .compile_worker import ast_source

    src = ast_source(fn, job.signature, job.constexprs, job.attrs)
    return src, backend.parse_options(dict(job.options, **src.parse_options()))


def _cache_hash(fn, job: Job, backend) -> str:
    """The key triton.compile files the kernel under."""
    from triton.runtime.cache import get_cache_key

    src, options = _key_inputs(fn, job, backend)
    return hashlib.sha256(get_cache_key(src, backend, options, env_vars=job.env_vars).encode("utf-8")).hexdigest()


def _key_difference(job: Job, fn, backend, theirs: dict) -> str:
    """Which parts of the cache key a worker computed otherwise than this process, with
    both values: why the JIT would not find what it compiled."""
    from .compile_worker import key_parts

    src, options = _key_inputs(fn, job, backend)
    ours = key_parts(src, backend, options, job.env_vars)
    diff = [f"{k} {theirs.get(k)!r} in the worker, {v!r} here" for k, v in ours.items() if theirs.get(k) != v]
    return "; ".join(diff) or "no part differs"


def _ptxas(target: tuple) -> tuple[str, str]:
    """For a CUDA target, the ptxas this process's JIT would key a kernel by and the one it
    would run, which need not be the same binary: Triton's CUDA backend puts in the key the
    ``ptxas --version`` it read first in the process (``get_ptxas_version`` is cached) but
    runs the ptxas ``TRITON_PTXAS_PATH`` names at each compile. Inductor sets that variable
    to torch's own ptxas at its first compile, after Triton has read its bundled one: in
    the models benchmark on an H100 (torch.compile, then eqfuse, in one process) the key
    said ptxas 12.8 and 13.0 ran. Workers started after that read 13.0 for both, and not
    one kernel they compiled was found by the JIT. A worker takes both from the job."""
    if target[0] != "cuda":
        return "", ""
    from triton.backends.nvidia import compiler as nvidia

    return nvidia.get_ptxas_version(target[1]), nvidia.get_ptxas(target[1]).path


# --- what Triton does once a process, done ahead -----------------------------------------
#
# Every kernel's cache key begins with Triton's hash of its own files (``triton_key``),
# which a process computes once, hashing the 415 MB library: 0.35 s. This process needs
# it for the jobs' keys; each worker would need it at its first compile, and with one
# kernel a worker, that was the slowest kernel's time too. On a thread of this process
# it took 2-6 s: each 1 MB chunk waited for the GIL while the main thread built the graph.
# So a child process computes it beside the build, from the dynamo backend's first call
# (before AOTAutograd traces) or ``prestart``; this process takes its answer where the
# child loaded Triton from the same place, and sends it with each job.
# Likewise Triton's CUDA driver builds its C module (a C compile, into Triton's cache) at
# its first use in a process, here the jobs' target: another child builds it beforehand.

_KEY_SCRIPT = ("import os, sys, triton; from triton.runtime.cache import triton_key; "
               "sys.stdout.write(os.path.dirname(triton.__file__) + '\\n' + triton_key())")
_DRIVER_SCRIPT = ("import sys; from triton import knobs; knobs.cache.dir = sys.argv[1]; "
                  "from triton.backends.nvidia.driver import CudaUtils; CudaUtils()")
_key_child: subprocess.Popen | None = None
_driver_child: subprocess.Popen | None = None
_key_lock = threading.Lock()


def ready_triton_ahead() -> None:
    """Starts the children that compute Triton's key and build its CUDA driver's C module,
    each unless this process has it, and neither without a pool (one CPU: a child would
    take this process's)."""
    global _key_child, _driver_child
    if worker_count() < 2:
        return
    from triton import knobs
    from triton.runtime import cache

    def child(*args, **kwargs):
        try:
            return subprocess.Popen([sys.executable, "-c", *args], stdin=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL, **kwargs)
        except OSError:
            return None  # done here when needed

    with _key_lock:
        if _key_child is None and not cache.triton_key.cache_info().currsize:
            _key_child = child(_KEY_SCRIPT, stdout=subprocess.PIPE, text=True)
        if _driver_child is None and not _driver_loaded():
            _driver_child = child(_DRIVER_SCRIPT, knobs.cache.dir, stdout=subprocess.DEVNULL)


def _driver_loaded() -> bool:
    """Whether this process's Triton has made its driver (and so built its C module)."""
    from triton.runtime.driver import driver
    return getattr(driver, "_default", True) is not None  # a Triton without the attribute: skip


def _triton_key() -> tuple:
    """(where Triton's files are, Triton's key), from the child where it has it."""
    global _key_child
    import triton
    from triton.runtime import cache

    where = os.path.dirname(triton.__file__)
    with _key_lock:
        child, _key_child = _key_child, None
        if child is not None and not cache.triton_key.cache_info().currsize:
            try:
                out, _ = child.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                child.kill()
                out = ""
            child_where, _, key = out.partition("\n")
            if child.returncode == 0 and child_where == where and key:
                cache.triton_key = functools.lru_cache(lambda: key)  # what its own would return
        return where, cache.triton_key()


def is_cached(job: Job) -> bool:
    """Whether Triton's cache holds the compiled kernel (its metadata file, written last)."""
    from triton.runtime.cache import get_cache_manager

    metadata = f"{job.name[:150]}.json"  # triton.compile's file name for it
    group = get_cache_manager(job.hash).get_group(metadata)
    return bool(group) and metadata in group


# --- the pool -------------------------------------------------------------------------------

def _worker_command() -> list[str]:
    # A script, not ``-m eqfuse.runtime.compile_worker``: importing the package imports torch
    script = str(Path(__file__).with_name("compile_worker.py"))
    return [sys.executable, "-c", f"import runpy; runpy.run_path({script!r}, run_name='__main__')"]


def _worker_env() -> dict:
    env = dict(os.environ)
    env["TRITON_INTERPRET"] = "0"  # a worker compiles: never Triton's interpreter
    env["CUDA_VISIBLE_DEVICES"] = ""  # and needs no GPU: the target is explicit, no context is made
    package_root = str(Path(__file__).resolve().parents[2])  # should a module import this eqfuse
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    return env


class _Worker:
    def __init__(self):
        self.log = tempfile.TemporaryFile()  # its stderr: the reason, should it die
        self.proc = subprocess.Popen(_worker_command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, env=_worker_env(), close_fds=True)

    def compile(self, job: Job, timeout: float) -> dict:
        """The worker's reply to ``job``; raises OSError when the worker is gone or stuck."""
        try:
            pickle.dump(asdict(job), self.proc.stdin)  # plain data: the worker imports no eqfuse
            self.proc.stdin.flush()
        except (OSError, ValueError) as e:
            raise OSError(f"compile worker gone: {self.why()}") from e
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            self.kill()
            raise OSError(f"compile worker took more than {timeout:.0f} s on {job.name}; stopped")
        try:
            return pickle.load(self.proc.stdout)
        except (EOFError, pickle.UnpicklingError, OSError) as e:
            raise OSError(f"compile worker died on {job.name}: {self.why()}") from e

    def why(self) -> str:
        try:
            code = self.proc.wait(2)  # it closed its end: it is exiting
        except subprocess.TimeoutExpired:
            code = None
        try:
            self.log.seek(0)
            lines = [ln for ln in self.log.read().decode(errors="replace").splitlines() if ln.strip()]
        except (OSError, ValueError):
            lines = []
        last = lines[-1].strip() if lines else "no message"
        return f"exit code {code}, {last}" if code is not None else last

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def close(self, timeout: float = 2.0):
        try:
            self.proc.stdin.close()  # a worker stops at the end of its input
            self.proc.wait(timeout)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            self.kill()
        self.log.close()


class CompilePool:
    """Worker processes that compile kernels into Triton's cache, started once. A worker
    that dies is not replaced: the pool is then broken, and its callers compile serially."""

    def __init__(self, size: int):
        self.size = size
        self.workers: list[_Worker] = []
        self.broken = ""  # why the pool cannot be used, once it cannot
        self.lock = threading.Lock()  # one batch at a time
        self.timeout = float(os.environ.get(ENV_TIMEOUT, DEFAULT_TIMEOUT_S))

    def start(self) -> None:
        """Starts the workers without waiting for them (they import torch and Triton)."""
        if self.workers or self.broken:
            return
        try:
            self.workers = [_Worker() for _ in range(self.size)]
        except OSError as e:
            self.broken = f"could not start compile workers: {e}"
            self.close()

    def compile(self, jobs: list[Job], on_reply=None) -> list[dict]:
        """A reply for every job, in order: ``{"hash": ...}`` or ``{"error": ...}``.
        ``on_reply(i, reply)``, where given, hears of each as it comes (on a thread of the pool)."""
        with self.lock:
            self.start()
            if self.broken:
                replies = [{"error": self.broken} for _ in jobs]
                for i, reply in enumerate(replies if on_reply is not None else ()):
                    on_reply(i, reply)
                return replies
            replies: list[dict | None] = [None] * len(jobs)
            queue = list(range(len(jobs)))
            queue_lock = threading.Lock()

            def serve(worker: _Worker):
                while True:
                    with queue_lock:
                        if not queue or self.broken:
                            return
                        i = queue.pop(0)
                    try:
                        sent = time.perf_counter()
                        replies[i] = worker.compile(jobs[i], self.timeout)
                        replies[i]["reply_seconds"] = time.perf_counter() - sent
                    except OSError as e:
                        replies[i] = {"error": str(e)}
                        self.broken = str(e)  # a dead worker: the next graphs compile serially
                    if on_reply is not None:
                        on_reply(i, replies[i])
                    if self.broken:
                        return

            threads = [threading.Thread(target=serve, args=(w,), daemon=True) for w in self.workers]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if self.broken:
                self.close()
            left = self.broken or "not compiled"
            unanswered = [i for i, r in enumerate(replies) if r is None]
            for i in unanswered:
                replies[i] = {"error": left}
                if on_reply is not None:
                    on_reply(i, replies[i])
            return replies

    def close(self) -> None:
        for w in self.workers:
            w.close()
        self.workers = []


_pool: CompilePool | None = None
_pool_pid = 0
_pool_lock = threading.Lock()


def pool() -> CompilePool:
    """This process's pool (a forked child makes its own: the pipes are its parent's)."""
    global _pool, _pool_pid
    with _pool_lock:
        if _pool is None or _pool_pid != os.getpid():
            _pool, _pool_pid = CompilePool(worker_count()), os.getpid()
            atexit.register(_pool.close)
        return _pool


def prestart() -> None:
    """Starts the pool's workers now, so that they are ready when the kernels are, and what
    ``ready_triton_ahead`` starts, where the backend has not already."""
    if worker_count() >= 2:
        pool().start()
        ready_triton_ahead()


def shutdown() -> None:
    """Stops the pool's workers (a later precompile starts new ones)."""
    global _pool
    with _pool_lock:
        if _pool is not None and _pool_pid == os.getpid():
            _pool.close()
        _pool = None


# --- the entry point ------------------------------------------------------------------------

def precompile(launches, target: tuple | None = None) -> Outcome:
    """Compiles, in the pool, every kernel ``launcher(*args)`` would compile at its first
    launch, for each ``(launcher, args)`` of ``launches``; ``args`` are tensors or
    ``Pointer``. Never raises: what it cannot do, the JIT does at the first launch."""
    return _prepare(launches, target).compile()


@dataclass
class _Batch:
    """The kernels of one precompile, their jobs made, to be sent to the pool."""
    out: Outcome
    start: float
    todo: list = field(default_factory=list)
    explain: object = None  # (job, reply) -> which parts of the key differ
    deferred: dict = field(default_factory=dict)  # job hash -> the launchers running their twin until it compiles

    def compile(self, main_done: threading.Event | None = None) -> Outcome:
        """Compiles the jobs; ``main_done`` is set once every job but the deferred ones
        has its reply (``out.seconds`` is then the time they took)."""
        if self.todo:
            self._compile_in_pool(main_done)
        if not self.out.seconds:
            self.out.seconds = time.perf_counter() - self.start
        return self.out

    def _compile_in_pool(self, main_done) -> None:
        out, todo = self.out, self.todo
        size = worker_count()
        if size < 2:
            out.note = f"kernels compile at first launch: {size} compile worker(s) (one CPU or {ENV_WORKERS})"
            return
        p = pool()
        out.workers = p.size
        waiting = [sum(job.hash not in self.deferred for job in todo)]
        lock = threading.Lock()

        def on_reply(i: int, reply: dict) -> None:
            job = todo[i]
            with lock:
                compiled = _account(out, job, reply, p, self.explain)
                if job.hash in self.deferred:
                    out.background.remove(_in_background(job))  # counted above, or failed
                    # The template from now on, compiled or left to the JIT like any kernel
                    # the pool did not compile; one Triton refused keeps its twin (the JIT
                    # would refuse it too)
                    if compiled or "error" not in reply or reply["error"] == p.broken:
                        for launcher in self.deferred[job.hash]:
                            launcher.deferred = False
                    return
                waiting[0] -= 1
                if waiting[0] == 0:
                    out.seconds = time.perf_counter() - self.start
                    if main_done is not None:
                        main_done.set()
        if not waiting[0] and main_done is not None:
            main_done.set()
        p.compile(todo, on_reply)
        if p.broken:
            out.note = f"compile pool failed, kernels compile serially at first launch: {p.broken}"


# A kernel whose compile takes seconds and that has a portable twin (the flash template,
# codegen/flash_hopper.py: 3.0-3.1 s in a worker on an H100 host, where the portable
# attention kernel takes under one) is not waited for: the twin runs until it is ready.
# Llama's forward waited 2.7 s for it at its first call, most of the time its cold compile
# lost to torch.compile's.
def _deferrable(launcher, args) -> bool:
    return (getattr(launcher, "otherwise", None) is not None and getattr(launcher.fn, "is_gluon", lambda: False)()
            and launcher.resolve(args)[0] is launcher)


def _prepare(launches, target: tuple | None = None, defer: bool = False) -> _Batch:
    """The jobs for the kernels of ``launches`` that Triton's cache does not hold: Python
    work of this process, which ``Pending`` does before its thread starts (on the thread,
    beside validation, it waited for the GIL at every step). A batch with nothing to do and
    a note where the specialisations or ptxas cannot be read. ``defer``: a slow template's
    launcher (``_deferrable``) runs its twin until the template compiles, and the twin is
    compiled too."""
    batch = _Batch(Outcome(), time.perf_counter())
    out = batch.out
    deferred: dict = {}
    defer = defer and worker_count() >= 2  # without a pool, nothing compiles in the background
    try:
        target = target or current_target()
        backend = _backend(target)
        key = _triton_key()  # the specialisations' hashes begin with it
        jobs, fns = {}, {}
        for launcher, args in launches:
            job = specialisation(launcher, args, target, backend)
            jobs.setdefault(job.hash, job)
            fns.setdefault(job.hash, launcher.resolve(args)[0].fn)
            if defer and _deferrable(launcher, args):
                twin, twin_args = launcher.otherwise, launcher._otherwise_args(args)
                twin_job = specialisation(twin, twin_args, target, backend)
                jobs.setdefault(twin_job.hash, twin_job)
                fns.setdefault(twin_job.hash, twin.resolve(twin_args)[0].fn)
                deferred.setdefault(job.hash, []).append(launcher)
    except Exception as e:  # noqa: BLE001 - a Triton that binds arguments otherwise: compile serially
        out.note = f"kernels compile at first launch: could not read their specialisation ({one_line(e)})"
        return batch
    out.kernels = len(jobs)
    todo = [j for j in jobs.values() if not is_cached(j)]
    out.cached = out.kernels - len(todo)
    if todo:
        try:
            ptxas = _ptxas(target)
        except Exception as e:  # noqa: BLE001 - no ptxas to be found: the JIT would fail alike
            out.note = f"kernels compile at first launch: could not find ptxas ({one_line(e)})"
            return batch
        for job in todo:
            job.ptxas_version, job.ptxas_path = ptxas
            job.triton_key = key
    # Only a template that is to compile waits; it is sent first, being the longest
    batch.deferred = {h: ls for h, ls in deferred.items() if any(j.hash == h for j in todo)}
    batch.todo = sorted(todo, key=lambda j: j.hash not in batch.deferred)
    for h, launchers in batch.deferred.items():
        for launcher in launchers:
            launcher.deferred = launcher.unchecked = True
        out.background.append(_in_background(jobs[h]))
    batch.explain = lambda job, reply: _key_difference(job, fns[job.hash], backend, reply)
    out.prepare_seconds = time.perf_counter() - batch.start
    return batch


def _in_background(job: Job) -> str:
    """The report's line for a template compiling on in the background (until its reply)."""
    return f"{job.name}: its portable twin runs until it compiles"


class Pending:
    """``precompile(launches)``, its jobs made here and sent from a thread of its own, which
    mostly waits on the workers' pipes: the caller goes on (validating the plan, building a
    training step's backward) while the kernels compile. ``wait()`` gives the Outcome once
    every kernel but a deferred template (``_deferrable``) has compiled."""

    def __init__(self, launches):
        self._outcome: Outcome | None = None
        self._main_done = threading.Event()
        try:
            batch = _prepare(list(launches), defer=True)
        except Exception as e:  # noqa: BLE001 - _prepare should not raise; if it does, the JIT compiles
            batch = _Batch(Outcome(note=f"kernels compile at first launch: {one_line(e)}"), time.perf_counter())
        self._batch = batch
        self._thread = threading.Thread(target=self._run, daemon=True, name="eqfuse-precompile")
        self._thread.start()

    def _run(self):
        try:
            self._outcome = self._batch.compile(self._main_done)
        except Exception as e:  # noqa: BLE001 - compile should not raise; if it does, the JIT compiles
            self._outcome = Outcome(note=f"kernels compile at first launch: {one_line(e)}")
        finally:
            self._main_done.set()

    def wait(self) -> Outcome:
        self._main_done.wait()
        return self._outcome or self._batch.out


def _account(out: Outcome, job: Job, reply: dict, p, explain) -> bool:
    """``reply`` to ``job`` counted in ``out``; whether the kernel is now where the JIT
    will find it."""
    if "error" in reply:
        if reply["error"] != p.broken:  # a kernel Triton refused (the JIT will say why again)
            out.failed.append(f"{job.name}: {reply['error']}")
        return False
    if reply.get("hash") != job.hash:  # it would compile again at first launch
        out.failed.append(f"{job.name}: compiled under another key than the JIT's "
                          f"({_explained(explain, job, reply)})")
        return False
    out.compiled += 1
    out.worker_seconds += reply["seconds"]
    out.launcher_seconds += reply.get("launcher_seconds", 0.0)
    out.slowest_reply = max(out.slowest_reply, reply.get("reply_seconds", 0.0))
    if not out.slowest or reply["seconds"] > out.slowest[1]:
        out.slowest = (job.name, reply["seconds"])
    return True


def _explained(explain, job: Job, reply: dict) -> str:
    try:
        return explain(job, reply.get("key_parts", {}))
    except Exception as e:  # noqa: BLE001 - only a diagnosis: the failure is reported anyway
        return f"could not compare the keys: {one_line(e)}"


# --- launches of a loaded module ------------------------------------------------------------

def _aligned(t) -> bool:
    """Whether a tensor's address is 16-byte aligned; for a fake tensor, its offset in a
    storage that is (torch's allocator aligns storages to 512 bytes)."""
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(t, FakeTensor):
        return t.storage_offset() * t.element_size() % 16 == 0
    return t.data_ptr() % 16 == 0


def module_launches(module, infos, plan, inputs, size: int | None = None) -> list:
    """``(launcher, args)`` for every kernel of a loaded generated module, as ``call`` will
    first launch it: buffers the module allocates are aligned, the graph's inputs (and
    constants) as the example inputs are. An eager step's output is taken to be aligned;
    where it is not, the kernel that reads it compiles at its first launch. ``size``: a
    sized module's launchers at that size (codegen/sized.py)."""
    from ..schema import ops

    aligned = {b.name: _aligned(t) for b, t in zip(plan.inputs, inputs)}
    launches = []
    for info in infos:
        launcher = getattr(module, f"{info.name}_launch", None)
        if launcher is None:  # a zero-size kernel: never launched
            continue
        if size is not None:
            launcher = launcher.at(size)
        args = [Pointer(ops.DTYPES[plan.buffers[p].dtype], aligned.get(p, True)) for p in info.params]
        launches.append((launcher, args))
    return launches
