"""The plan cache: what a compile decided, kept on disk so that a later compile of the same
graph (in this process or another) skips translation, saturation, extraction, validation,
code generation and the choice of block sizes.

An entry holds the extracted plan, the generated module's source (with the block sizes
chosen on this device) and its kernel list, and the report figures ``explain()`` prints.
Capture still runs on a hit: the entry is keyed by the captured graph, and the graph's
constants and output structure come from it.

The key holds everything a plan depends on (``plan_key``): the captured graph's code and
its placeholders' shapes, strides, dtypes and devices, the options that change a plan, the
device and what the code generator reads of it, and eqfuse's version with a digest of its
own source, so that editing eqfuse invalidates every entry. Constant tensors (module
parameters) enter by their metadata, not their values: no step that makes a plan reads a
tensor's memory. Translation works on fake tensors, and the attention schedule's
compile-time mask analysis (codegen/attention.py, ``_static``) folds only constants and
indices written in the graph, never a load. (Validation does run the plan on the values;
a plan is cached only once it passed, or was built with validation off, which the key
holds.)

An entry is one file, ``plans/<key>.plan``: a header line (format, key, SHA-256 of the
rest) and the pickled entry. It is written atomically (temp file + rename), so two
processes writing one entry at once leave one whole file. An entry whose header, digest or
contents do not check out is rebuilt, never trusted. Loading an entry unpickles it, so it
is only as trusted as the cache directory, which already holds the generated modules
eqfuse imports.
"""

from __future__ import annotations

import functools
import hashlib
import io
import os
import pickle
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..errors import one_line
from ..rewrite.rules import choice_key
from .cache import cache_dir, switched_on, write_atomic

FORMAT = 1  # bumped when an entry's layout changes
MAGIC = b"eqfuse-plan"
ENV_SWITCH = "EQFUSE_PLAN_CACHE"


def enabled(option: bool = True) -> bool:
    """The option, unless ``EQFUSE_PLAN_CACHE=0`` turns it off."""
    return switched_on(ENV_SWITCH, option)


@dataclass
class Entry:
    plan: object  # schema.plan.Plan
    kernels: list  # codegen.module.KernelInfo, as generate_module returned them with the final configs
    source: str  # the generated module
    report: dict  # saturation, extraction (and retries): what explain() prints
    seconds: dict  # the stages of the build that stored it


# --- the key ------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """SHA-256 over eqfuse's own Python files (paths and contents): a change to any of them
    changes every key."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(b"\0")
        h.update(path.read_bytes())
        h.update(b"\0")
    return h.hexdigest()


def installed_version(package: str) -> str | None:
    """The installed version of ``package``, or None."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=1)
def _versions() -> tuple:
    from .compiled import VERSION

    return (VERSION, source_digest(), torch.__version__, installed_version("triton") or "none",
            installed_version("egglog") or "none")


def _tensor_meta(t) -> tuple:
    if not isinstance(t, torch.Tensor):
        return (type(t).__name__,)
    return (tuple(t.shape), tuple(t.stride()), str(t.dtype), t.device.type)


def _graph_parts(captured) -> tuple:
    """The captured graph as the plan sees it: its code (ops, arguments and literal
    constants, spelled as FX prints them), each placeholder's metadata, which placeholders
    are the user's inputs, and the output structure."""
    placeholders = tuple((n.name, _tensor_meta(n.meta.get("val"))) for n in captured.placeholders)
    return (captured.gm.code, placeholders, captured.num_user_inputs, str(captured.out_spec))


def _device_parts(device: torch.device) -> tuple:
    """What plans and generated code read of the device and of torch's global settings."""
    from ..codegen import kmajor, library, matmul_templates, split, splitk, tma
    from ..rewrite.cost import device_model

    parts = [device.type, torch.backends.cuda.matmul.allow_tf32,
             os.environ.get("TRITON_INTERPRET", ""), bool(os.environ.get("EQFUSE_NO_FACTS")),
             split.enabled(), splitk.enabled(), kmajor.enabled(), matmul_templates.offered(),
             library.wanted(device.type)]
    if device.type == "cuda":
        parts += [torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device),
                  tma.sm_count(), tma.device_supports(), switched_on("EQFUSE_AUTOTUNE")]
    parts.append(sorted(asdict(device_model()).items()))  # the cost model's figures (calibration)
    return tuple(parts)


def plan_key(captured, example_inputs, options, device: torch.device, title: str) -> str:
    """The entry a compile of ``captured`` for these inputs and options reads and writes."""
    inputs = tuple(_tensor_meta(t) for t in example_inputs)
    constants = tuple(_tensor_meta(t) for t in captured.constants)
    chosen = (options.max_enodes, options.max_seconds, choice_key(options.rules), options.validate, options.autotune,
              options.cublas, options.emulate_precision_casts, options.pad_outputs)
    h = hashlib.sha256()
    for part in (FORMAT, _versions(), title, _graph_parts(captured), inputs, constants, chosen,
                 _device_parts(device)):
        h.update(repr(part).encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


# --- entries on disk ----------------------------------------------------------------------------

def entry_path(key: str) -> Path:
    path = cache_dir() / "plans"
    path.mkdir(exist_ok=True)
    return path / f"{key}.plan"


class _Pickler(pickle.Pickler):
    """Torch's operator objects (an eager step's target) by name: they do not pickle."""

    def reducer_override(self, obj):
        if isinstance(obj, torch._ops.OpOverload):
            return _operator, (obj._schema.name, obj._overloadname)
        if isinstance(obj, torch._ops.OpOverloadPacket):
            return _operator, (obj._qualified_op_name, None)
        return NotImplemented


def _operator(qualified: str, overload: str | None):
    namespace, name = qualified.split("::")
    packet = getattr(getattr(torch.ops, namespace), name)
    return packet if overload is None else getattr(packet, overload)


def _header(key: str, digest: str) -> bytes:
    return b" ".join([MAGIC, str(FORMAT).encode(), key.encode(), digest.encode()]) + b"\n"


def store(key: str, entry: Entry) -> str | None:
    """Writes the entry; returns why it was not stored (None when it was)."""
    buf = io.BytesIO()
    try:
        _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(entry)
    except (pickle.PicklingError, TypeError, AttributeError, RecursionError, RuntimeError) as e:
        return f"the plan does not pickle: {one_line(e)}"
    payload = buf.getvalue()
    try:
        write_atomic(entry_path(key), _header(key, hashlib.sha256(payload).hexdigest()) + payload)
    except OSError as e:
        return f"cannot write the cache: {e}"
    return None


def load(key: str) -> tuple[Entry | None, str | None]:
    """(the entry stored under ``key``, None) on a hit; (None, None) when there is none;
    (None, why) when there is one that cannot be trusted (it is then rebuilt)."""
    try:
        data = entry_path(key).read_bytes()
    except FileNotFoundError:
        return None, None
    except OSError as e:
        return None, f"unreadable ({e})"
    header, sep, payload = data.partition(b"\n")
    fields = header.split(b" ")
    if not sep or len(fields) != 4 or fields[0] != MAGIC:
        return None, "not a plan cache entry"
    if fields[1] != str(FORMAT).encode() or fields[2] != key.encode():
        return None, "written by another format or for another key"
    if hashlib.sha256(payload).hexdigest().encode() != fields[3]:
        return None, "its contents do not match their digest (truncated or corrupt)"
    try:
        entry = pickle.loads(payload)
    except Exception as e:  # noqa: BLE001 - a class renamed or removed since it was written
        return None, f"it does not load: {one_line(e)}"
    if not isinstance(entry, Entry):
        return None, f"it holds a {type(entry).__name__}, not a plan"
    return entry, None


def check(entry: Entry, captured, example_inputs) -> str | None:
    """Why ``entry`` cannot be the plan of this graph (None when it can): its inputs must be
    the graph's placeholders, with their shapes and dtypes, and its parts of the right kinds."""
    from ..codegen.module import KernelInfo
    from ..schema.plan import Plan

    plan = entry.plan
    if not isinstance(plan, Plan) or not isinstance(entry.source, str) or "def call(" not in entry.source:
        return "its plan or source is not one"
    if not all(isinstance(k, KernelInfo) for k in entry.kernels):
        return "its kernel list is not one"
    tensors = list(example_inputs) + list(captured.constants)
    if len(plan.inputs) != len(tensors):
        return f"its plan takes {len(plan.inputs)} inputs, the graph {len(tensors)}"
    from ..schema.ops import DTYPES
    for buf, t in zip(plan.inputs, tensors):
        if tuple(buf.shape) != tuple(t.shape) or DTYPES.get(buf.dtype) != t.dtype:
            return f"its input {buf.name} is {list(buf.shape)} {buf.dtype}, the graph's {list(t.shape)} {t.dtype}"
    return None
