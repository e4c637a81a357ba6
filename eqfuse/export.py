"""Ahead-of-time export: a compiled graph's kernels as cubin and PTX for a named GPU
architecture, with one JSON manifest that says how to run them without Triton.

    compiled = eqfuse.compile(fn, example_inputs)
    export_graph(compiled, "out/", arch="sm_90")       # or: eqfuse export NAME --arch sm_90
    graph = eqfuse.runtime.load_exported("out/")       # on the GPU, without Triton
    graph(*inputs)

Everything is fixed at export: shapes, dtypes and strides are constexprs in eqfuse's
kernels, so the manifest records the grid each kernel launches with and the input
signature it is valid for (with the grid's formula over the kernel's sizes, for the
reader). The directory holds:

    manifest.json           the format below (``manifest_version`` 1)
    kernels.py              the Triton source the kernels were compiled from
    <kernel>.cubin/.ptx     each kernel, compiled by Triton for the architecture
    constants/<name>.bin    tensors the graph captured (module parameters), raw bytes

A graph with eager fallbacks or cuBLAS calls is refused: the exported runner launches
kernels only (compile with ``cublas=False`` for generated products, as
``eqfuse export`` does).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import replace
from pathlib import Path

from .errors import EqfuseError
from .runtime import triton_aot
from .runtime.exported import MANIFEST, MANIFEST_VERSION
from .runtime.nv_tools import reqntid, resource_usage
from .schema.plan import KernelSpec

# Triton's pointer types by eqfuse dtype name.
POINTER_TYPES = {"float16": "*fp16", "bfloat16": "*bf16", "float32": "*fp32", "float64": "*fp64",
                 "int8": "*i8", "int16": "*i16", "int32": "*i32", "int64": "*i64", "uint8": "*u8",
                 "bool": "*i1"}
# Largest dynamic shared memory a block may opt in to, bytes (CUDA programming guide,
# compute capabilities table). A kernel over the limit would compile and never launch.
MAX_SHARED = {70: 98304, 75: 65536, 80: 166912, 86: 101376, 87: 166912, 89: 101376,
              90: 232448, 100: 232448, 103: 232448, 120: 101376}
KEPT_STAGES = ("cubin", "ptx")  # the other stages are `eqfuse inspect`'s business


class ExportError(EqfuseError):
    """A graph that cannot be exported (eager fallbacks, a kernel over the device's limits)."""


def export_graph(compiled, directory, arch="sm_90") -> Path:
    """Compile ``compiled``'s kernels for ``arch`` into ``directory``; returns the manifest's path."""
    arch_num = triton_aot.parse_arch(arch)
    variant = _exportable_variant(compiled)
    plan = variant.plan
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    infos = {k.name: k for k in variant.kernels}
    module_path = directory / "kernels.py"
    module_path.write_text(triton_aot.kernels_module([k.source for k in variant.kernels]))

    runnable = [infos[s.name] for s in plan.steps if 0 not in infos[s.name].grid]
    requests = [triton_aot.KernelRequest(info.name, _signature(info, plan), dict(info.constexprs),
                                         dict(info.launch)) for info in runnable]
    compiled_meta = triton_aot.compile_kernels(module_path, requests, arch_num, directory) if requests else {}

    kernels = []
    for step in plan.steps:
        info = infos[step.name]
        if info.name not in compiled_meta:
            kernels.append(_kernel_record(info, None, plan, directory))
        else:
            kernels.append(_kernel_record(info, compiled_meta[info.name], plan, directory))
            _keep_stages(directory, info.name)

    n_user = len(variant.example_inputs)
    manifest = {
        "format": "eqfuse-export",
        "manifest_version": MANIFEST_VERSION,
        "title": getattr(compiled.fn, "__name__", type(compiled.fn).__name__),
        "eqfuse_version": _eqfuse_version(),
        "triton_version": _triton_version(),
        "target": {"backend": "cuda", "arch": arch_num, "sm": triton_aot.sm_name(arch_num), "warp_size": 32,
                   "exact": arch_num >= 90},
        "pointer_align": triton_aot.POINTER_ALIGN,
        "inputs": [_tensor_record(b.name, x) for b, x in zip(plan.inputs[:n_user], variant.example_inputs)],
        "constants": [_write_constant(directory, b.name, t) for b, t in zip(plan.inputs[n_user:], variant.constants)],
        "buffers": _buffer_plan(plan),
        "kernels": kernels,
        "outputs": [_output_record(o) for o in plan.outputs],
        "out_spec": _out_spec(variant.out_spec),
    }
    path = directory / MANIFEST
    path.write_text(json.dumps(manifest, indent=1))
    return path


def _exportable_variant(compiled):
    """The compiled graph's main variant, refused if anything in it runs in eager."""
    if not hasattr(compiled, "_main"):  # a LayeredGraph: one module per part
        raise ExportError("export takes a graph compiled whole; this one was compiled in parts (its identical "
                          "layers once): compile it with share_layers=False to export it")
    variant = compiled._main  # the variant compiled for the example inputs
    if getattr(variant, "whole_graph_eager", False):
        reason = variant.fallbacks[0].reason if variant.fallbacks else "unknown reason"
        raise ExportError(f"nothing to export: the whole graph runs in eager ({reason})")
    if variant.fallbacks:
        ops = "; ".join(str(f) for f in variant.fallbacks)
        raise ExportError(f"cannot export a graph with eager fallbacks (the exported runner launches kernels "
                          f"only): {ops}")
    if variant.library_calls:
        names = ", ".join(c.name for c in variant.library_calls)
        raise ExportError(f"cannot export cuBLAS calls ({names}; the exported runner launches kernels only): "
                          "compile with cublas=False to generate those products as kernels")
    return variant


def _signature(info, plan) -> dict:
    sig = {k: "constexpr" for k in info.constexprs}
    for name in info.params:
        dtype = plan.buffers[name].dtype
        if dtype not in POINTER_TYPES:
            raise ExportError(f"kernel {info.name}: buffer {name} has dtype {dtype}, which export does not cover")
        sig[name] = POINTER_TYPES[dtype]
    return sig


def _kernel_record(info, meta, plan, directory: Path) -> dict:
    grid = tuple(info.grid) + (1,) * (3 - len(info.grid))
    record = {"name": info.name, "fx_nodes": list(info.fx_nodes), "schedule": info.schedule.describe(),
              "constexprs": dict(info.constexprs), "grid": list(grid),
              "grid_formula": grid_formula(info), "grid_sizes": grid_sizes(info),
              "num_warps": info.launch.get("num_warps", 4), "num_stages": info.launch.get("num_stages")}
    if meta is None:
        record["skip"] = "zero-size: nothing to compute"
        return record
    _check_launchable(info.name, meta)
    cubin = (directory / meta["files"]["cubin"]).read_bytes()
    ptx = (directory / meta["files"]["ptx"]).read_text()
    params = [{"name": p, "type": t, "buffer": p} for p, t in meta["signature"].items() if t != "constexpr"]
    # Triton appends two pointers to every kernel (make_launcher in
    # triton/backends/nvidia/driver.py): global scratch and profile scratch, each null
    # when the kernel needs none, else grid-size * size bytes.
    params.append({"name": "global_scratch", "type": "*i8", "scratch": "global",
                   "bytes_per_program": meta.get("global_scratch_size", 0),
                   "align": meta.get("global_scratch_align", 1)})
    params.append({"name": "profile_scratch", "type": "*i8", "scratch": "profile",
                   "bytes_per_program": meta.get("profile_scratch_size", 0),
                   "align": meta.get("profile_scratch_align", 1)})
    for p in params:
        if "buffer" in p and p["buffer"] not in plan.buffers:
            raise ExportError(f"kernel {info.name}: parameter {p['name']} names no buffer of the plan")
    threads = 32 * meta["num_warps"]
    record.update(
        entry=meta["name"], cubin=meta["files"]["cubin"], ptx=meta["files"]["ptx"],
        cubin_sha256=hashlib.sha256(cubin).hexdigest(), params=params,
        num_warps=meta["num_warps"], num_ctas=meta.get("num_ctas", 1), num_stages=meta.get("num_stages"),
        block=[threads, 1, 1], shared=meta["shared"], reqntid=list(reqntid(ptx) or ()),
        resources=resource_usage(cubin), triton_hash=meta.get("hash"))
    if record["reqntid"] and math.prod(record["reqntid"]) != threads:
        raise ExportError(f"kernel {info.name}: the PTX asks for {record['reqntid']} threads, "
                          f"num_warps={meta['num_warps']} launches {threads}")
    return record


def _check_launchable(name: str, meta: dict) -> None:
    arch = int(meta["arch"][3:].rstrip("a"))
    limit = MAX_SHARED.get(arch)
    if limit is not None and meta["shared"] > limit:
        raise ExportError(f"kernel {name} needs {meta['shared']} bytes of shared memory; {meta['arch']} allows "
                          f"{limit}. Export on a GPU of that architecture (its autotuner picks tiles that fit)")
    if meta.get("num_ctas", 1) != 1 or meta.get("launch_cooperative_grid") or meta.get("launch_pdl"):
        raise ExportError(f"kernel {name}: clusters, cooperative or PDL launches are not covered by export")


def _keep_stages(directory: Path, name: str) -> None:
    for stage in triton_aot.STAGES:
        if stage not in KEPT_STAGES:
            (directory / f"{name}.{stage}").unlink(missing_ok=True)


def _tensor_record(name, t) -> dict:
    from .schema.ops import dtype_name
    return {"name": name, "shape": list(t.shape), "dtype": dtype_name(t.dtype), "strides": list(t.stride())}


def _write_constant(directory: Path, name: str, t) -> dict:
    """Raw bytes of the tensor's elements in row-major order; the loader lays them out
    with the recorded strides again."""
    import torch
    folder = directory / "constants"
    folder.mkdir(exist_ok=True)
    data = t.detach().to("cpu").contiguous()
    (folder / f"{name}.bin").write_bytes(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return {**_tensor_record(name, t), "file": f"constants/{name}.bin"}


def _buffer_plan(plan) -> list:
    """Buffers the runner allocates on each call, in the order kernels first write them;
    a view of another buffer (a concatenation's part) after that buffer, as that view."""
    inputs = {b.name for b in plan.inputs}
    order = []

    def add(name):
        view_of = plan.buffers[name].view_of
        if view_of is not None and view_of[0] not in order:
            add(view_of[0])
        order.append(name)
    for step in plan.steps:
        assert isinstance(step, KernelSpec)
        for _, buf in step.roots:
            if buf not in inputs and buf not in order:
                add(buf)
    return [{"name": n, "shape": list(plan.buffers[n].shape), "dtype": plan.buffers[n].dtype,
             "strides": list(plan.buffers[n].layout), "kind": plan.buffers[n].kind,
             **({"view_of": list(plan.buffers[n].view_of)} if plan.buffers[n].view_of else {})} for n in order]


def _output_record(out) -> dict:
    kind = out[0]
    if kind == "buffer":
        return {"kind": "buffer", "buffer": out[1]}
    if kind == "view":
        r = out[1]
        return {"kind": "view", "buffer": r.buf, "shape": list(r.shape), "strides": list(r.strides),
                "offset": r.offset}
    if kind == "const" and (out[1] is None or isinstance(out[1], (bool, int, float))):
        return {"kind": "const", "value": out[1]}
    raise ExportError(f"an output of kind {kind} ({out[1]!r}) cannot be exported")


def _out_spec(spec) -> str:
    import torch.utils._pytree as pytree
    return pytree.treespec_dumps(spec)


# --- the grid as a formula --------------------------------------------------------------------
class _Sym:
    """A size by name: the schedule's own grid function, run on these, writes its formula.
    ``-(-a // b)`` (how eqfuse spells a ceiling division) reads back as ``cdiv(a, b)``."""

    def __init__(self, text: str, value: int, atomic: bool = True, negated=None):
        self.text, self.value, self.atomic, self.negated = text, value, atomic, negated

    @staticmethod
    def _of(x):
        return x if isinstance(x, _Sym) else _Sym(str(x), x)

    def _operand(self) -> str:
        return self.text if self.atomic else f"({self.text})"

    def __mul__(self, other):
        o = self._of(other)
        if o.text == "1":
            return self
        return _Sym(f"{self._operand()} * {o._operand()}", self.value * o.value, atomic=False)

    def __rmul__(self, other):
        return self if other == 1 else self._of(other).__mul__(self)

    def __neg__(self):
        if self.negated is not None:
            return self.negated
        return _Sym(f"-{self._operand()}", -self.value, atomic=False, negated=self)

    def __floordiv__(self, other):
        o = self._of(other)
        if self.negated is not None:  # -a // b == -cdiv(a, b)
            up = _Sym(f"cdiv({self.negated.text}, {o.text})", -(-self.negated.value // o.value))
            return -up
        return _Sym(f"{self._operand()} // {o._operand()}", self.value // o.value, atomic=False)


def grid_formula(info) -> list | None:
    """The kernel's grid as formulas over its size constexprs (``cdiv(R, BLOCK_R)``) and
    batch sizes (``B0``...), computed by running the schedule's own grid function on named
    sizes; None when that function is not plain arithmetic on them."""
    sched = info.schedule
    sizes = {k: _Sym(k, v) for k, v in info.constexprs.items() if isinstance(v, int)}
    try:
        fields = {}
        for attr, key in (("numel", "xnumel"), ("inner", "X"), ("rows", "R"), ("m", "M"), ("n", "N")):
            if getattr(sched, attr) and key in sizes:
                fields[attr] = sizes[key]
        if sched.batch:
            fields["batch"] = tuple(_Sym(f"B{i}", b) for i, b in enumerate(sched.batch))
        result = replace(sched, **fields).grid(sizes)
    except (TypeError, KeyError, AttributeError):
        return None
    values = [r.value if isinstance(r, _Sym) else r for r in result]
    if tuple(values) != tuple(info.grid):
        return None  # the formula does not reproduce the grid: say nothing rather than something wrong
    return [r.text if isinstance(r, _Sym) else str(r) for r in result]


def grid_sizes(info) -> dict:
    """The names a grid formula uses, with their values for this kernel."""
    sizes = {k: v for k, v in info.constexprs.items() if isinstance(v, int)}
    sizes.update({f"B{i}": b for i, b in enumerate(info.schedule.batch)})
    return sizes


def evaluate_grid_formula(formula: list, sizes: dict) -> tuple:
    """The grid a formula gives for ``sizes`` (a kernel's constexprs and batch sizes)."""
    env = {"cdiv": lambda a, b: -(-a // b), "__builtins__": {}}
    return tuple(eval(f, env, dict(sizes)) for f in formula)  # noqa: S307 - our own formulas


def _eqfuse_version() -> str:
    from .runtime.compiled import VERSION
    return VERSION


def _triton_version() -> str:
    import importlib.metadata
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return "none"
