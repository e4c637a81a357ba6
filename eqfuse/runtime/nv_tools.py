"""NVIDIA's binary tools (cuobjdump, nvdisasm) on a cubin: SASS and resource usage.

Triton's wheel bundles both (triton/backends/nvidia/bin); one on PATH is used first. They
run on any x86-64 machine, GPU or not. Each helper returns None when no tool is found.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import tempfile
from pathlib import Path


def find_tool(name: str) -> str | None:
    """PATH first, then Triton's bundled copy (found without importing Triton)."""
    found = shutil.which(name)
    if found:
        return found
    spec = importlib.util.find_spec("triton")
    for root in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(root) / "backends" / "nvidia" / "bin" / name
        if candidate.is_file():
            return str(candidate)
    return None


def _run_on_cubin(tool: str, args: list, cubin: bytes) -> str | None:
    path = find_tool(tool)
    if path is None:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        proc = subprocess.run([path, *args, f.name], capture_output=True, text=True)
    return proc.stdout if proc.returncode == 0 else None


def sass(cubin: bytes) -> str | None:
    """The SASS, with ``//## File "...", line N`` markers (nvdisasm -g) where nvdisasm is found."""
    text = _run_on_cubin("nvdisasm", ["-g", "-c"], cubin)
    if text is None:
        text = _run_on_cubin("cuobjdump", ["-sass"], cubin)
    return text


def resource_usage(cubin: bytes) -> dict | None:
    """{"registers", "stack", "shared", "local"} (bytes, but registers) of the cubin's one
    function, from ``cuobjdump -res-usage``. Spilled registers = local bytes / 4, as Triton counts."""
    text = _run_on_cubin("cuobjdump", ["-res-usage"], cubin)
    if not text:
        return None
    fields = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", text))
    if "REG" not in fields:
        return None
    return {"registers": int(fields["REG"]), "stack": int(fields.get("STACK", 0)),
            "shared": int(fields.get("SHARED", 0)), "local": int(fields.get("LOCAL", 0)),
            "spills": int(fields.get("LOCAL", 0)) // 4}


def reqntid(ptx: str) -> tuple | None:
    """The ``.reqntid`` of the PTX entry: the threads per block the kernel was compiled for."""
    m = re.search(r"\.reqntid\s+(\d+(?:\s*,\s*\d+)*)", ptx)
    return tuple(int(x) for x in m.group(1).split(",")) if m else None
