"""Compiling generated kernels with Triton ahead of time, for a named NVIDIA architecture.

``compile_kernels`` hands each kernel of a generated module to ``triton.compile`` with an
explicit ``GPUTarget``, every constexpr fixed and the pointer arguments marked 16-byte
aligned (what the JIT assumes of torch's allocations), and writes every stage Triton
produces (TTIR, TTGIR, LLVM IR, PTX, cubin) to a directory. No GPU is needed: Triton's
bundled ptxas makes the cubin.

Triton decides when it is first imported whether ``tl.sum`` and friends are interpreted
(eqfuse turns the interpreter on when there is no GPU), and an interpreting process cannot
compile. There the compilation runs in a child process with the interpreter off
(``python -m eqfuse.runtime.triton_aot REQUEST.json``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import EqfuseError

STAGES = ("ttir", "ttgir", "llir", "ptx", "cubin")  # Triton's CompiledKernel.asm keys, in order
# Metadata the launcher needs, copied from Triton's KernelMetadata.
METADATA_KEYS = ("name", "shared", "num_warps", "num_ctas", "num_stages", "global_scratch_size",
                 "global_scratch_align", "profile_scratch_size", "profile_scratch_align",
                 "launch_cooperative_grid", "launch_pdl", "tmem_size", "hash", "triton_version")
POINTER_ALIGN = 16  # bytes; pointers are compiled as divisible by this (tt.divisibility)


class AotCompileError(EqfuseError):
    """Triton could not compile a kernel for the named architecture."""


@dataclass
class KernelRequest:
    """One kernel to compile: its function name in the module, a Triton signature by
    parameter name ("*fp16" or "constexpr"), the constexpr values, and launch options."""
    name: str
    signature: dict
    constexprs: dict
    options: dict = field(default_factory=dict)


KERNELS_HEADER = '''"""The Triton kernels of an eqfuse graph, as compiled ahead of time: each kernel's sizes
are constexprs fixed at compile time; see manifest.json / summary.txt beside this file."""
import triton
import triton.language as tl

'''


def kernels_module(kernel_sources: list[str]) -> str:
    """A module of the kernels alone, to compile from: the generated module also holds the
    launcher, which imports eqfuse's runtime; the stages' line numbers refer to this one.
    With the helpers the kernels call (a row's product: codegen/kernel.PRODUCT)."""
    from ..codegen.kernel import PRODUCT, PRODUCT_SOURCE

    helpers = [PRODUCT_SOURCE] if any(PRODUCT in source for source in kernel_sources) else []
    return KERNELS_HEADER + "\n\n".join(helpers + kernel_sources)


def parse_arch(arch) -> int:
    """``"sm_90"``, ``"sm_90a"``, ``"90"`` or ``90`` -> 90."""
    text = str(arch).strip().lower()
    m = re.fullmatch(r"(?:sm_?)?(\d{2,3})a?", text)
    if not m:
        raise AotCompileError(f"unknown GPU architecture {arch!r}; name one like sm_80, sm_90 or sm_100")
    return int(m.group(1))


def sm_name(arch: int) -> str:
    """The cubin's architecture as Triton names it: sm_90 and later use the 'a' variant."""
    return f"sm_{arch}{'a' if arch >= 90 else ''}"


def compile_kernels(module_path: Path, requests: list[KernelRequest], arch: int, out_dir: Path) -> dict:
    """kernel name -> metadata dict; writes ``<name>.<stage>`` for every stage into ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if _interpreting():
        return _compile_in_child(Path(module_path), requests, arch, out_dir)
    return _compile_here(Path(module_path), requests, arch, out_dir)


def _interpreting() -> bool:
    """Whether this process's Triton is (or will be, once imported) the interpreter."""
    if "triton.language" in sys.modules:
        import triton.language as tl
        return type(tl.sum).__name__ == "InterpretedFunction"
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _compile_in_child(module_path: Path, requests, arch: int, out_dir: Path) -> dict:
    request = {"module": str(module_path), "arch": arch, "out_dir": str(out_dir),
               "kernels": [asdict(r) for r in requests]}
    request_path = out_dir / "aot_request.json"
    request_path.write_text(json.dumps(request, indent=1))
    env = dict(os.environ, TRITON_INTERPRET="0")
    package_root = str(Path(__file__).resolve().parents[2])  # the child imports this eqfuse
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-m", "eqfuse.runtime.triton_aot", str(request_path)],
                          capture_output=True, text=True, env=env)
    request_path.unlink(missing_ok=True)
    lines = proc.stdout.strip().splitlines()
    try:
        reply = json.loads(lines[-1]) if lines else {}
    except ValueError:
        reply = {}
    if proc.returncode != 0 or "error" in reply or "kernels" not in reply:
        detail = reply.get("error") or (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise AotCompileError(f"Triton could not compile for {sm_name(arch)}: {detail}")
    return reply["kernels"]


def _compile_here(module_path: Path, requests, arch: int, out_dir: Path) -> dict:
    import importlib.util

    import triton
    from triton.backends.compiler import GPUTarget

    from . import ptx_loops
    from .compile_worker import ast_source

    ptx_loops.install(also=(module_path, Path(module_path).resolve()))
    name = f"eqfuse_aot_{abs(hash(str(module_path)))}"
    spec = importlib.util.spec_from_file_location(name, module_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    target = GPUTarget("cuda", arch, 32)
    results = {}
    for req in requests:
        fn = getattr(module, req.name)
        unknown = [p for p in fn.arg_names if p not in req.signature]
        if unknown:
            raise AotCompileError(f"kernel {req.name}: no type for parameter(s) {', '.join(unknown)}")
        signature = {p: req.signature[p] for p in fn.arg_names}
        attrs = {(i,): [["tt.divisibility", POINTER_ALIGN]]
                 for i, p in enumerate(fn.arg_names) if signature[p].startswith("*")}
        src = ast_source(fn, signature, dict(req.constexprs), attrs)
        try:
            kernel = triton.compile(src, target=target, options=dict(req.options))
        except Exception as e:  # noqa: BLE001 - Triton's errors are many; name the kernel
            first = str(e).strip().splitlines()
            raise AotCompileError(f"kernel {req.name} for {sm_name(arch)}: {type(e).__name__}: "
                                  f"{first[-1] if first else ''}") from e
        files = {}
        for stage in STAGES:
            if stage not in kernel.asm:
                continue
            path = out_dir / f"{req.name}.{stage}"
            data = kernel.asm[stage]
            if isinstance(data, bytes):
                path.write_bytes(data)
            else:
                path.write_text(data)
            files[stage] = path.name
        meta = {k: getattr(kernel.metadata, k) for k in METADATA_KEYS if hasattr(kernel.metadata, k)}
        meta.update(arch=sm_name(arch), signature=signature, files=files)
        results[req.name] = meta
    return results


def _main(argv) -> int:
    request = json.loads(Path(argv[0]).read_text())
    try:
        reqs = [KernelRequest(**k) for k in request["kernels"]]
        kernels = _compile_here(Path(request["module"]), reqs, int(request["arch"]), Path(request["out_dir"]))
        print(json.dumps({"kernels": kernels}))
    except AotCompileError as e:
        print(json.dumps({"error": str(e)}))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
