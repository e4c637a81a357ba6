"""Running an exported graph (``eqfuse export``) without Triton.

    graph = load_exported("out/")   # reads manifest.json, loads each cubin into the GPU
    graph(*inputs)                  # allocates the buffers, launches the kernels in order

The kernels are launched through the CUDA driver API (cuda_driver.py) on torch's current
stream; nothing here imports Triton or compiles anything. As with the JIT path, calls
whose inputs come back at the same addresses replay a CUDA graph of the launches
(graphs.py; ``cuda_graphs=False`` launches kernel by kernel every call). The manifest is checked against
what it is used with: the device's compute capability, every file it names, and the
shapes, dtypes and strides of the inputs (the kernels are specialised to them).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
from pathlib import Path

import torch

from ..errors import EqfuseError

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1


class ExportedGraphError(EqfuseError):
    """An exported graph that cannot run here: a missing file, another GPU, other inputs."""


def load_exported(directory, device=None, cuda_graphs: bool = True) -> ExportedGraph:
    """The graph exported to ``directory``, ready to run on ``device`` (default: the current CUDA device)."""
    return ExportedGraph(Manifest.read(directory), device, cuda_graphs)


def _dtype(name: str) -> torch.dtype:
    return torch.bool if name == "bool" else getattr(torch, name)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class Manifest:
    """manifest.json of an export directory, checked for what it needs to be run."""

    def __init__(self, data: dict, directory: Path):
        self.data, self.directory = data, directory

    @classmethod
    def read(cls, directory) -> Manifest:
        directory = Path(directory)
        path = directory / MANIFEST
        if not path.is_file():
            raise ExportedGraphError(f"{path} is missing: {directory} is not an eqfuse export directory "
                                     "(make one with `eqfuse export`)")
        try:
            data = json.loads(path.read_text())
        except ValueError as e:
            raise ExportedGraphError(f"{path} is not valid JSON: {e}") from e
        if data.get("format") != "eqfuse-export" or data.get("manifest_version") != MANIFEST_VERSION:
            raise ExportedGraphError(f"{path} is not an eqfuse export manifest of version {MANIFEST_VERSION} "
                                     f"(format {data.get('format')!r}, version {data.get('manifest_version')!r})")
        manifest = cls(data, directory)
        missing = [f for f in manifest.files() if not (directory / f).is_file()]
        if missing:
            raise ExportedGraphError(f"{directory}: file(s) named in the manifest are missing: {', '.join(missing)}")
        return manifest

    def files(self) -> list[str]:
        names = [k["cubin"] for k in self.data["kernels"] if "cubin" in k]
        return names + [c["file"] for c in self.data["constants"]]

    @property
    def target(self) -> dict:
        return self.data["target"]

    def check_device(self, capability: tuple, device_name: str) -> None:
        """Raises unless a cubin for the manifest's architecture runs on ``capability``: the
        same (sm_90a and later are specific to one), or a later minor of the same major."""
        arch = self.target["arch"]
        have = capability[0] * 10 + capability[1]
        ok = have == arch if self.target.get("exact", arch >= 90) else (
            capability[0] == arch // 10 and capability[1] >= arch % 10)
        if not ok:
            raise ExportedGraphError(
                f"this graph was exported for {self.target['sm']} (compute capability {arch // 10}.{arch % 10}); "
                f"{device_name} has compute capability {capability[0]}.{capability[1]}. Export again with "
                f"--arch sm_{have}")

    def check_inputs(self, inputs) -> None:
        """Raises, naming the first difference, unless ``inputs`` have the exported shapes,
        dtypes and strides."""
        expected = self.data["inputs"]
        if len(inputs) != len(expected):
            raise ExportedGraphError(f"the exported graph takes {len(expected)} input(s), got {len(inputs)}")
        for i, (x, e) in enumerate(zip(inputs, expected)):
            if not isinstance(x, torch.Tensor):
                raise ExportedGraphError(f"input {i} is a {type(x).__name__}, not a tensor")
            got = {"shape": list(x.shape), "dtype": _dtype_name(x.dtype), "strides": list(x.stride())}
            for key in ("shape", "dtype", "strides"):
                if got[key] != e[key]:
                    raise ExportedGraphError(
                        f"input {i} ({e['name']}): {key} {got[key]}, but the graph was exported for {e[key]}; "
                        "exported kernels are specialised to their shapes, dtypes and strides: export again "
                        "for these inputs")


class _Launch:
    """One kernel launch with its argument block built once: each call writes the
    buffers' addresses into ``values``; ``pointers`` points at them for cuLaunchKernel."""

    def __init__(self, record: dict, function):
        self.name = record["name"]
        self.function = function
        self.grid = tuple(record["grid"])
        self.block = record["block"][0]
        self.shared = record["shared"]
        self.buffers = [p["buffer"] for p in record["params"] if "buffer" in p]
        self.scratch = [(i, p["bytes_per_program"], p["align"]) for i, p in enumerate(record["params"])
                        if p.get("scratch") and p["bytes_per_program"]]
        n = len(record["params"])
        self.values = (ctypes.c_uint64 * n)()
        base = ctypes.addressof(self.values)
        self.pointers = (ctypes.c_void_p * n)(*[base + 8 * i for i in range(n)])
        # cuLaunchKernel's arguments up to the stream, as the C types it takes, built once.
        U = ctypes.c_uint
        self.fixed = (function, *[U(g) for g in self.grid], U(self.block), U(1), U(1), U(self.shared))


class ExportedGraph:
    """The exported kernels loaded on one CUDA device; call it like the compiled function."""

    def __init__(self, manifest: Manifest, device=None, cuda_graphs: bool = True):
        from . import cuda_driver
        from .graphs import GraphReplayer

        if not torch.cuda.is_available():
            raise ExportedGraphError("an exported graph runs on a CUDA GPU, and torch sees none here")
        self.manifest = manifest
        data = manifest.data
        self.device = torch.device("cuda", torch.cuda.current_device() if device is None
                                   else torch.device(device).index or 0)
        index = self.device.index
        manifest.check_device(torch.cuda.get_device_capability(index), torch.cuda.get_device_name(index))
        self._driver = cuda_driver.driver()
        self._driver.use_primary_context(index)
        self._modules = []
        self._launches = []
        for record in data["kernels"]:
            if "skip" in record:
                continue
            image = (manifest.directory / record["cubin"]).read_bytes()
            if hashlib.sha256(image).hexdigest() != record["cubin_sha256"]:
                raise ExportedGraphError(f"{manifest.directory / record['cubin']} differs from the one exported "
                                         "(its sha256 does not match the manifest's)")
            module, function = self._driver.load_function(image, record["entry"], record["shared"], index)
            self._modules.append(module)
            self._launches.append(_Launch(record, function))
        self._input_names = [e["name"] for e in data["inputs"]]
        self._signature = [(torch.Size(e["shape"]), _dtype(e["dtype"]), tuple(e["strides"]), self.device)
                           for e in data["inputs"]]
        self._align = data.get("pointer_align", 16)
        self._constants = {c["name"]: self._read_constant(c) for c in data["constants"]}
        self._buffers = [(b["name"], tuple(b["shape"]), tuple(b["strides"]), _dtype(b["dtype"]), b.get("view_of"))
                         for b in data["buffers"]]
        self._outputs = data["outputs"]
        import torch.utils._pytree as pytree
        self._out_spec = pytree.treespec_loads(data["out_spec"])
        self._leaf = self._out_spec.is_leaf()
        self._raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        self.replayer = GraphReplayer(self._launch, tuple(self._constants.values())) if cuda_graphs else None

    def _read_constant(self, record: dict) -> torch.Tensor:
        raw = (self.manifest.directory / record["file"]).read_bytes()
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        values = flat.view(_dtype(record["dtype"])).reshape(record["shape"])
        out = torch.empty_strided(record["shape"], record["strides"], dtype=values.dtype, device=self.device)
        return out.copy_(values)

    def _stream(self) -> int:
        if self._raw_stream is not None:
            return self._raw_stream(self.device.index)
        return torch.cuda.current_stream(self.device).cuda_stream

    def __call__(self, *inputs):
        if len(inputs) != len(self._signature):
            self.manifest.check_inputs(inputs)
        align = self._align
        for x, (shape, dtype, strides, device) in zip(inputs, self._signature):  # a plain loop: every call
            if (x.shape != shape or x.dtype != dtype or x.stride() != strides or x.device != device
                    or x.data_ptr() % align):
                self._refuse(inputs)
        flat = self._launch(*inputs) if self.replayer is None else self.replayer(inputs)
        if self._leaf:
            return flat[0]
        import torch.utils._pytree as pytree
        return pytree.tree_unflatten(flat, self._out_spec)

    def _refuse(self, inputs):
        """Raises, naming what about ``inputs`` the exported kernels cannot take."""
        self.manifest.check_inputs(inputs)
        for i, x in enumerate(inputs):
            if x.device != self.device:
                raise ExportedGraphError(f"input {i} is on {x.device}; the graph was loaded on {self.device}")
            if x.data_ptr() % self._align:
                raise ExportedGraphError(f"input {i} starts at an address not a multiple of {self._align} bytes "
                                         "(the kernels were compiled for aligned pointers): pass x.clone()")
        raise ExportedGraphError("inputs differ from the exported signature")  # not reached

    def _launch(self, *inputs) -> list:
        """Launches every kernel on checked inputs; the flat outputs."""
        bufs = dict(zip(self._input_names, inputs))
        bufs.update(self._constants)
        for name, shape, strides, dtype, view_of in self._buffers:  # a view's base comes before it
            bufs[name] = torch.empty_strided(shape, strides, dtype=dtype, device=self.device) if view_of is None \
                else torch.as_strided(bufs[view_of[0]], shape, strides, view_of[1])
        stream = ctypes.c_void_p(self._stream())
        launch_kernel, check = self._driver.launch_prepared, self._driver.check
        for ln in self._launches:
            values = ln.values
            for i, name in enumerate(ln.buffers):
                values[i] = bufs[name].data_ptr()
            scratch = []
            for i, per_program, _align in ln.scratch:  # torch's allocations are 512-byte aligned
                s = torch.empty(per_program * ln.grid[0] * ln.grid[1] * ln.grid[2], dtype=torch.uint8,
                                device=self.device)
                scratch.append(s)
                values[i] = s.data_ptr()
            result = launch_kernel(*ln.fixed, stream, ln.pointers, None)
            if result:
                check(result, f"cuLaunchKernel({ln.name})")
        return [self._output(o, bufs) for o in self._outputs]

    @staticmethod
    def _output(record: dict, bufs: dict):
        kind = record["kind"]
        if kind == "buffer":
            return bufs[record["buffer"]]
        if kind == "view":
            base = bufs[record["buffer"]]
            return torch.as_strided(base, record["shape"], record["strides"], base.storage_offset() + record["offset"])
        return record["value"]
