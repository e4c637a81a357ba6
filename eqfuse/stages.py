"""What each generated kernel becomes at each stage of Triton's compiler (``eqfuse inspect``,
``CompiledGraph.inspect()``).

For every kernel the directory gets its Triton source and every stage the installed Triton
produces for the target (TTIR, TTGIR, LLVM IR, PTX, cubin), the SASS (nvdisasm or
cuobjdump, from PATH or bundled with Triton), and under ``annotated/`` each text stage
with the source line it comes from written above each run of lines (from the stage's own
location info). ``summary.txt`` / ``summary.json`` give per kernel: registers, spills,
shared memory, num_warps, the PTX ``.reqntid``, and per source line how many
operations / instructions each stage holds for it.

The target is the current GPU when there is one. Without one, the kernels are compiled
ahead of time for ``arch`` (sm_90 by default): Triton's compiler and its bundled ptxas
need no GPU; what does need one (launching, timing, the driver's own count of
registers) is said in the summary.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from .runtime import triton_aot
from .runtime.nv_tools import reqntid, resource_usage, sass

TEXT_STAGES = ("ttir", "ttgir", "llir", "ptx", "sass")
LIBRARY = -1  # "line" of code from Triton's own library (tl.sum's body...) that a stage lists without its caller
COMMENT = {"ttir": "//", "ttgir": "//", "llir": ";", "ptx": "//", "sass": "//"}


@dataclass
class Inspection:
    directory: Path
    target: str  # "sm_90a", as the cubins are built
    note: str  # how the stages were made (on this GPU / ahead of time without one / not at all)
    kernels: list = field(default_factory=list)  # one summary dict per kernel
    library_calls: list = field(default_factory=list)  # "name: torch.mm, shapes", nothing of eqfuse's to inspect

    def __str__(self) -> str:
        return (self.directory / "summary.txt").read_text()


def inspect_graph(compiled, directory=None, arch=None) -> Inspection:
    """Writes every kernel's stages into ``directory`` (default: a folder in eqfuse's cache
    named after the module's content) and returns the summary."""
    import torch

    from .runtime.cache import cache_dir, cache_key

    source = triton_aot.kernels_module([k.source for k in compiled.kernels])
    if directory is None:
        directory = cache_dir() / "inspect" / cache_key(source)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    module_path = directory / "kernels.py"
    module_path.write_text(source)

    on_gpu = torch.cuda.is_available() and arch is None
    if on_gpu:
        major, minor = torch.cuda.get_device_capability()
        arch_num = major * 10 + minor
        note = f"compiled for this GPU ({torch.cuda.get_device_name()})"
    else:
        arch_num = triton_aot.parse_arch(arch or "sm_90")
        note = (f"compiled ahead of time for {triton_aot.sm_name(arch_num)}"
                + ("" if torch.cuda.is_available() else " (no GPU here: Triton's compiler and bundled ptxas "
                   "need none); launching, timing and the driver's own register count need a GPU"))
    result = Inspection(directory, triton_aot.sm_name(arch_num), note,
                        library_calls=[str(c) for c in compiled.library_calls])
    infos = [k for k in compiled.kernels if 0 not in k.grid]
    requests = [triton_aot.KernelRequest(k.name, _signature(k, compiled.plan), dict(k.constexprs), dict(k.launch))
                for k in infos]
    meta = {}
    if requests:
        try:
            meta = triton_aot.compile_kernels(module_path, requests, arch_num, directory)
        except triton_aot.AotCompileError as e:
            result.note = (f"only the Triton source: {e}. The stages TTIR, TTGIR, LLVM IR, PTX, cubin and SASS "
                           "need Triton's compiler for a GPU target")
    for info in compiled.kernels:
        (directory / f"{info.name}.py").write_text(info.source)
        result.kernels.append(_kernel_summary(info, meta.get(info.name), directory, module_path, source))
    (directory / "summary.json").write_text(json.dumps(
        {"target": result.target, "note": result.note, "kernels": result.kernels,
         "cublas_calls": result.library_calls}, indent=1))
    (directory / "summary.txt").write_text(_summary_text(result, source))
    return result


def _signature(info, plan) -> dict:
    from .export import POINTER_TYPES
    sig = {k: "constexpr" for k in info.constexprs}
    sig.update({p: POINTER_TYPES.get(plan.buffers[p].dtype, "*fp32") for p in info.params})
    return sig


def _kernel_summary(info, meta, directory: Path, module_path: Path, source: str) -> dict:
    summary = {"name": info.name, "fx_nodes": list(info.fx_nodes), "schedule": info.schedule.describe(),
               "grid": list(info.grid), "constexprs": dict(info.constexprs), "source": f"{info.name}.py",
               "num_warps": info.launch.get("num_warps", 4), "num_stages": info.launch.get("num_stages")}
    if meta is None:
        summary["stages"] = {}
        if 0 in info.grid:
            summary["note"] = "zero-size: never launched, not compiled"
        return summary
    stages = dict(meta["files"])
    cubin = (directory / stages["cubin"]).read_bytes() if "cubin" in stages else b""
    disassembly = sass(cubin) if cubin else None
    if disassembly is not None:
        (directory / f"{info.name}.sass").write_text(disassembly)
        stages["sass"] = f"{info.name}.sass"
    usage = resource_usage(cubin) if cubin else None
    ptx = (directory / stages["ptx"]).read_text() if "ptx" in stages else ""
    summary.update(stages=stages, num_warps=meta["num_warps"], num_stages=meta.get("num_stages"),
                   shared=meta["shared"], reqntid=list(reqntid(ptx) or ()),
                   registers=usage and usage["registers"], spills=usage and usage["spills"],
                   local_bytes=usage and usage["local"])
    first = _first_line(source, info.source)
    last = first + info.source.count("\n") - 1
    lines: dict = {}
    (directory / "annotated").mkdir(exist_ok=True)
    for stage in TEXT_STAGES:
        if stage not in stages:
            continue
        text = (directory / stages[stage]).read_text()
        refs = source_lines(stage, text, module_path.name)
        counts = Counter(r for r in refs if r is not None and (first <= r <= last or r == LIBRARY))
        for line, n in counts.items():
            lines.setdefault(line, {})[stage] = n
        (directory / "annotated" / stages[stage]).write_text(_annotate(stage, text, refs, source))
    summary["lines"] = {str(k): lines[k] for k in sorted(lines, key=lambda n: (n == LIBRARY, n))}
    summary["source_lines"] = [first, last]
    return summary


def _first_line(module_source: str, kernel_source: str) -> int:
    at = module_source.find(kernel_source)
    return module_source.count("\n", 0, at) + 1 if at >= 0 else 1


# --- which source line each line of a stage refers to ------------------------------------------
_MLIR_DEF = re.compile(r"^#loc(\d*) = loc\((.*)\)\s*$")
_MLIR_USE = re.compile(r'loc\((#loc\d*|"[^"]*":\d+:\d+)\)')
_FILE_LINE = re.compile(r'"([^"]*)":(\d+):\d+')


def source_lines(stage: str, text: str, module_file: str) -> list:
    """For each line of ``text`` (a stage's listing), the line of ``module_file`` it was
    generated from, or None (declarations, lines from Triton's own library)."""
    return {"ttir": _mlir, "ttgir": _mlir, "llir": _llir, "ptx": _ptx, "sass": _sass}[stage](text, module_file)


def _ours(path: str, module_file: str) -> bool:
    return Path(path).name == module_file


def _mlir(text: str, module_file: str) -> list:
    defs = {}
    for line in text.splitlines():
        m = _MLIR_DEF.match(line)
        if m:
            defs["#loc" + m.group(1)] = m.group(2)

    def resolve(ref: str, depth=0):
        """The first location in our file, following named and call-site locations."""
        body = defs.get(ref, ref) if ref.startswith("#loc") else ref
        for m in re.finditer(r'"([^"]*)":(\d+):\d+|(#loc\d*)', body):
            if m.group(3):
                if depth < 50 and m.group(3) != ref:
                    found = resolve(m.group(3), depth + 1)
                    if found:
                        return found
            elif _ours(m.group(1), module_file):
                return int(m.group(2))
        return None

    out = []
    for line in text.splitlines():
        uses = _MLIR_USE.findall(line)
        if line.startswith("#loc") or not uses or line.lstrip().startswith(("module", "tt.func", "}")):
            out.append(None)
        else:
            out.append(resolve(uses[-1]))
    return out


def _llir(text: str, module_file: str) -> list:
    files, scopes, locs = {}, {}, {}
    for line in text.splitlines():
        if m := re.match(r'^(!\d+) = !DIFile\(filename: "([^"]*)"', line):
            files[m.group(1)] = m.group(2)
        elif m := re.match(r"^(!\d+) = (?:distinct )?!DI(?:Subprogram|LexicalBlock\w*)\(.*?file: (!\d+)", line):
            scopes[m.group(1)] = m.group(2)
        elif m := re.match(r"^(!\d+) = !DILocation\(line: (\d+).*?scope: (!\d+)(?:, inlinedAt: (!\d+))?", line):
            locs[m.group(1)] = (int(m.group(2)), m.group(3), m.group(4))

    def resolve(ref, depth=0):
        if ref not in locs or depth > 50:
            return None
        line, scope, inlined_at = locs[ref]
        if inlined_at:  # inlined from Triton's library: the call in our kernel is what counts
            return resolve(inlined_at, depth + 1)
        file = files.get(scopes.get(scope, ""), module_file)
        return line if _ours(file, module_file) else None

    out = []
    for line in text.splitlines():
        m = re.search(r"!dbg (!\d+)", line)
        out.append(resolve(m.group(1)) if m and not line.startswith("define") else None)
    return out


def _ptx(text: str, module_file: str) -> list:
    # .file directives come at the end, in the debug sections
    files = {m.group(1): m.group(3) or m.group(2) for m in re.finditer(
        r'^\s*\.file\s+(\d+)\s+"([^"]*)"(?:\s*,\s*\d+\s*,\s*\d+)?(?:\s+"([^"]*)")?', text, re.M)}
    current, out = None, []
    for line in text.splitlines():
        s = line.strip()
        if m := re.match(r"\.loc\s+(\d+)\s+(\d+)\s+\d+", s):
            file = files.get(m.group(1), "")
            current = int(m.group(2)) if _ours(file, module_file) else (LIBRARY if file else None)
            out.append(None)
            continue
        is_instruction = s.endswith(";") and not s.startswith((".", "//"))
        out.append(current if is_instruction else None)
    return out


def _sass(text: str, module_file: str) -> list:
    current, out = None, []
    for line in text.splitlines():
        if "//##" in line:
            pairs = re.findall(r'"([^"]*)", line (\d+)', line)
            ours = [int(n) for f, n in pairs if _ours(f, module_file)]
            current = ours[-1] if ours else (LIBRARY if pairs else None)
            out.append(None)
        else:
            out.append(current if re.search(r"/\*[0-9a-f]{4,}\*/\s+\S", line) else None)
    return out


def _annotate(stage: str, text: str, refs: list, source: str) -> str:
    """The listing with ``// kernels.py:17: <that line>`` above each run of lines from one source line."""
    src = source.splitlines()
    mark = COMMENT[stage]
    out, last = [], None
    for line, ref in zip(text.splitlines(), refs):
        if ref is not None and ref != last and (0 < ref <= len(src) or ref == LIBRARY):
            where = "Triton's library (inlined; the stage does not say from where)" if ref == LIBRARY \
                else f"kernels.py:{ref}: {src[ref - 1].strip()}"
            out.append(f"{mark} ---- {where}")
            last = ref
        out.append(line)
    return "\n".join(out) + "\n"


def _summary_text(result: Inspection, source: str) -> str:
    src = source.splitlines()
    out = [f"eqfuse inspect: {len(result.kernels)} kernel(s), target {result.target}: {result.note}",
           f"directory: {result.directory}", ""]
    if result.library_calls:  # plain products: cuBLAS's kernels, not eqfuse's
        out += [f"cuBLAS call {c}" for c in result.library_calls] + [""]
    for k in result.kernels:
        out.append(f"kernel {k['name']}: {k['schedule']}; grid {tuple(k['grid'])}")
        out.append(f"  FX nodes: {', '.join(k['fx_nodes']) or '-'}")
        if not k.get("stages"):
            out.append(f"  source: {k['source']}; {k.get('note', 'no compiled stages')}")
            out.append("")
            continue
        out.append(f"  registers {k['registers']}, spills {k['spills']}, shared memory {k['shared']} bytes, "
                   f"num_warps {k['num_warps']}, num_stages {k['num_stages']}, .reqntid {k['reqntid']}")
        out.append(f"  files: {k['source']} " + " ".join(k["stages"].values()) + " (annotated/: with source lines)")
        stages = [s for s in TEXT_STAGES if s in k["stages"]]
        out.append("  " + "line".rjust(5) + "".join(s.rjust(7) for s in stages) + "  source")
        for line, counts in k["lines"].items():
            text = "(Triton's library, inlined)" if int(line) == LIBRARY else \
                src[int(line) - 1].strip() if int(line) <= len(src) else ""
            out.append("  " + line.rjust(5) + "".join(str(counts.get(s, "")).rjust(7) for s in stages)
                       + "  " + text[:90])
        out.append("")
    return "\n".join(out)
