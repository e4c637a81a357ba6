"""A worker of eqfuse's compile pool, run as a script (parallel_compile starts it).

Reads pickled jobs (dicts of ``parallel_compile.Job``'s fields) from stdin until it
closes; for each, loads the generated module the job names (once), compiles the kernel
with ``triton.compile`` as Triton's JIT would (same source and line, specialisation,
options, target, cache-invalidating environment and ptxas), which files it in Triton's cache,
builds its C launcher (also cached) and writes a pickled reply to stdout: ``{"hash":
..., "seconds": ...}`` (with ``key_parts`` where the hash is not the one the job expects,
so that the process that sent it can say which part of the key differs), or ``{"error":
"..."}`` for a kernel Triton refuses. It uses no GPU.

It imports neither torch nor eqfuse: with them a worker took 2.5 s and 220 MB more to
start (16 of them slowed the graph's extraction by 3 s on an H100 host), and Triton needs
only the kernels. The generated module's lines that import them are replaced by stubs
of the same names when it is loaded; every other line, the kernels' included, is
executed as written, at its own line number (Triton hashes a kernel's source and first
line), and ``inspect`` reads the kernels' source from the file itself.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import re
import sys
import threading
import time
import types

# Whole lines of the generated module (codegen/module.py) -> their stand-ins: torch, and
# each name it imports from eqfuse (the launchers; a template kernel, codegen/flash_hopper.py,
# whose compile jobs name the template's own file).
STUBS = {"import torch": "torch = None"}
_EQFUSE_IMPORT = re.compile(r"from (eqfuse\.[\w.]+) import (\w+)(?: as (\w+))?$")


def _stub(*args, **kwargs):
    return None


# eqfuse's template modules that a generated kernel calls into (codegen/matmul_hopper.py: the
# ping-pong template around a generated epilogue); they import only Triton, so the worker
# loads them from their files, as the JIT of the process that sent the job imported them.
TEMPLATES = {"eqfuse.codegen.matmul_hopper": "codegen/matmul_hopper.py"}


def _stubbed(line: str) -> str:
    if line in STUBS:
        return STUBS[line]
    m = _EQFUSE_IMPORT.match(line)
    if m and m.group(1) in TEMPLATES:
        return f"{m.group(3) or m.group(2)} = _eqfuse_template({m.group(1)!r}).{m.group(2)}"
    return f"{m.group(3) or m.group(2)} = _eqfuse_stub" if m else line


def _template(module: str):
    """The template module ``module`` (one of TEMPLATES), loaded once from its file."""
    return _load_file(TEMPLATES[module])


def ast_source(fn, signature, constexprs, attrs):
    """Triton's compile source for ``fn``: Gluon's for a Gluon kernel (its IR is built
    another way), as Triton's JIT chooses."""
    from triton.compiler import ASTSource
    if getattr(fn, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource
        return GluonASTSource(fn, signature, constexprs, attrs)
    return ASTSource(fn, signature, constexprs, attrs)


def load_kernels(path: str, modules: dict):
    """The generated module at ``path``, its torch and eqfuse imports stubbed."""
    module = modules.get(path)
    if module is None:
        with open(path) as f:
            lines = f.read().split("\n")
        text = "\n".join(_stubbed(line) for line in lines)  # one line for one: same numbering
        module = types.ModuleType(f"eqfuse_compile_worker_{len(modules)}")
        module.__file__ = path
        module.__dict__["_eqfuse_stub"] = _stub
        module.__dict__["_eqfuse_template"] = _template
        sys.modules[module.__name__] = module
        exec(compile(text, path, "exec"), module.__dict__)
        modules[path] = module
    return module


def _build_launcher(kernel) -> str:
    """Builds (into Triton's cache) the C launcher the first launch would build; a failure
    only means the launching process builds it."""
    try:
        from triton.backends.nvidia.driver import CudaLauncher
        CudaLauncher(kernel.src, kernel.metadata)
    except Exception as e:  # noqa: BLE001 - an optional step (no libcuda on a CPU host, say)
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    return ""


def key_parts(src, backend, options, env_vars: dict) -> dict:
    """The parts of the key ``triton.compile`` files a kernel under (``get_cache_key``, as of
    Triton 3.6), each shortened: Triton's own files, the kernel's source and specialisation,
    the backend (for CUDA, the version of the ptxas it runs and the arch), the options,
    the cache-invalidating environment. Also imported by parallel_compile, so that both
    processes describe their keys alike."""
    from triton.runtime.cache import triton_key

    backend_key = backend.hash()
    version, _, arch = backend_key.rpartition("-")  # CUDA: ptxas --version's output, the arch
    release = re.search(r"release [^\n]*", version)
    parts = {"triton": triton_key(), "source": src.hash(), "options": options.hash(),
             "environment": str(sorted(env_vars.items()))}
    short = {k: hashlib.sha256(v.encode("utf-8")).hexdigest()[:12] for k, v in parts.items()}
    short["backend"] = f"ptxas {release.group(0)}, {arch}" if release else backend_key[-80:]
    return short


def _ptxas_of_the_jit(job: dict) -> None:
    """Keys the kernel by the ptxas version the sending process's JIT keys by, and runs the
    ptxas it would run (parallel_compile._ptxas says why they can differ, and differ from
    what this worker's environment names). Triton 3.6's CUDA backend reads the version for
    its key through ``get_ptxas_version`` and the binary through its knob at each compile."""
    version, path = job.get("ptxas_version"), job.get("ptxas_path")
    if not version:
        return
    from triton import knobs
    from triton.backends.nvidia import compiler as nvidia

    nvidia.get_ptxas_version = lambda arch=80: version
    setattr(knobs.nvidia, "ptxas_blackwell" if job["target"][1] >= 100 else "ptxas", path)


def _triton_key_of_the_sender(job: dict) -> None:
    """Triton's hash of its own files as the sending process computed it (see
    parallel_compile._triton_key), where this worker's Triton is the same install."""
    import triton
    from triton.runtime import cache

    own = _OWN_TRITON_KEY.setdefault("function", cache.triton_key)
    where, key = job.get("triton_key") or ("", "")
    taken = key and where == os.path.dirname(triton.__file__)
    cache.triton_key = (lambda: key) if taken else own


_OWN_TRITON_KEY: dict = {}  # Triton's function, for a job without a key this worker can take


class _LauncherAhead:
    """The C launcher built on a thread while the kernel compiles, where its source is known
    before the compile (Triton 3.6 writes it from the signature and constants, and from the
    compile's metadata only for tensor-descriptor arguments): a C compile of 0.2-0.3 s that
    otherwise follows the kernel's. ``wait()``: what ``_build_launcher`` returns."""

    def __init__(self, src):
        self.problem = None
        self.thread = None
        if any("tensordesc" in str(ty) for ty in src.signature.values()):
            return
        self.thread = threading.Thread(target=self._build, args=(src,), daemon=True)
        self.thread.start()

    def _build(self, src):
        self.problem = _build_launcher(types.SimpleNamespace(src=src, metadata=_LAUNCH_METADATA))

    def wait(self, kernel) -> str:
        if self.thread is None:
            return _build_launcher(kernel)
        self.thread.join()
        return self.problem


# What CudaLauncher reads of a compile's metadata besides the tensor descriptors: only to
# launch, never into the launcher's source (which alone keys the launcher in the cache).
_LAUNCH_METADATA = types.SimpleNamespace(num_ctas=1, global_scratch_size=0, global_scratch_align=1,
                                         profile_scratch_size=0, profile_scratch_align=1,
                                         launch_cooperative_grid=False, launch_pdl=False)


def compile_job(job: dict, modules: dict) -> dict:
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    knobs.cache.dir = job["cache_dir"]
    _ptxas_of_the_jit(job)
    _triton_key_of_the_sender(job)
    fn = getattr(load_kernels(job["path"], modules), job["name"])
    src = ast_source(fn, job["signature"], job["constexprs"], job["attrs"])
    t0 = time.perf_counter()
    ahead = _LauncherAhead(src) if job["target"][0] == "cuda" else None
    kernel = triton.compile(src, target=GPUTarget(*job["target"]), options=job["options"],
                            _env_vars=job["env_vars"])
    t1 = time.perf_counter()
    launcher = ahead.wait(kernel) if ahead else _build_launcher(kernel)
    t2 = time.perf_counter()
    reply = {"hash": kernel.hash, "seconds": t2 - t0, "launcher_seconds": t2 - t1}
    if kernel.hash != job.get("hash"):  # the JIT will not find it: say what made it differ
        backend = make_backend(GPUTarget(*job["target"]))
        options = backend.parse_options(dict(job["options"], **src.parse_options()))
        reply["key_parts"] = key_parts(src, backend, options, job["env_vars"])
    if launcher:
        reply["launcher"] = launcher
    return reply


def _load_file(path: str):
    """The module at ``path`` within the eqfuse package, loaded once from its file (no
    package import: it imports no eqfuse)."""
    import importlib.util

    name = f"eqfuse_compile_worker_{os.path.splitext(os.path.basename(path))[0]}"
    if name not in sys.modules:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        spec = importlib.util.spec_from_file_location(name, os.path.join(root, path))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def main() -> int:
    try:  # a worker yields to the process it works for, which builds the graph meanwhile
        os.nice(5)
    except OSError:
        pass
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # whatever Triton or ptxas prints goes to stderr, not into the replies
    sys.stdout = sys.stderr
    jobs = sys.stdin.buffer
    modules: dict = {}
    import triton.compiler  # noqa: F401 - imported while the graph is still being built
    _load_file("runtime/ptx_loops.py").install()  # the K loops' nounroll mark (it imports no eqfuse)
    while True:
        try:
            job = pickle.load(jobs)
        except EOFError:
            return 0
        try:
            reply = compile_job(job, modules)
        except Exception as e:  # noqa: BLE001 - a kernel Triton refuses: say why, go on
            lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
            reply = {"error": f"{type(e).__name__}: {lines[-1].strip() if lines else ''}"}
        pickle.dump(reply, replies)
        replies.flush()


if __name__ == "__main__":
    sys.exit(main())
