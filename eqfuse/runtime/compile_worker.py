"""A worker of eqfuse's compile pool (``python -m eqfuse.runtime.compile_worker``).

Reads pickled ``parallel_compile.Job`` objects from stdin until it closes; for each,
imports the generated module the job names (once), compiles the kernel with
``triton.compile`` as Triton's JIT would (same source, specialisation, options, target
and cache-invalidating environment), which files it in Triton's cache, builds its C
launcher (also cached) and writes a pickled reply to stdout: ``{"hash": ..., "seconds":
...}``, or ``{"error": "..."}`` for a kernel Triton refuses. It uses no GPU.
"""

from __future__ import annotations

import importlib.util
import os
import pickle
import sys
import time


def _load(path: str, modules: dict):
    module = modules.get(path)
    if module is None:
        name = f"eqfuse_compile_worker_{len(modules)}"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
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


def compile_job(job, modules: dict) -> dict:
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    knobs.cache.dir = job.cache_dir
    fn = getattr(_load(job.path, modules), job.name)
    src = ASTSource(fn, job.signature, job.constexprs, job.attrs)
    t0 = time.perf_counter()
    kernel = triton.compile(src, target=GPUTarget(*job.target), options=job.options, _env_vars=job.env_vars)
    launcher = _build_launcher(kernel)
    reply = {"hash": kernel.hash, "seconds": time.perf_counter() - t0}
    if launcher:
        reply["launcher"] = launcher
    return reply


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
