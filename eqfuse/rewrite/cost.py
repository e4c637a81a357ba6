"""The cost model: a roofline per kernel plus a fixed cost per launch.

time(kernel) = launch + max(bytes moved / bandwidth, compute / throughput)

Bytes count each buffer a kernel reads once (a broadcast read costs the distinct
elements it touches, not the broadcast size) and each buffer it writes. Device figures
default to an H100/H200-class GPU; ``eqfuse calibrate`` measures them on the GPU at hand
and stores them per device name in the cache, where ``device_model()`` finds them.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields

from ..schema import ops
from ..schema.plan import KernelSpec, PNode


@dataclass(frozen=True)
class Device:
    name: str = "default-gpu"
    bandwidth_bytes_per_us: float = 3.5e6  # 3.5 TB/s
    launch_us: float = 3.0
    ops_per_us: float = 2.0e7  # pointwise cost units (about one flop each) per microsecond
    sms: int = 132
    l2_speedup: float = 2.5  # L2 bandwidth over HBM bandwidth
    l2_bytes: int = 50 * 1024 * 1024  # recorded by calibration; the model does not use it yet
    # Dense matmul flops per microsecond that Triton kernels reach (not the datasheet peak).
    half_flops_per_us: float = 6.5e8  # float16 / bfloat16
    tf32_flops_per_us: float = 3.0e8
    # IEEE float32 on the CUDA cores (Triton's dot without TF32): ViT-B/16's float32
    # attention products on an H200 ([384 x 197 x 64] @ [384 x 64 x 197] and back, 1.9
    # GFLOP each) ran 280-415 us generated, 5-7 TFLOP/s; 4e7 had modelled them at 90-127
    fp32_flops_per_us: float = 1.5e7
    # A plain product run by cuBLAS (codegen/library.py) against a generated one: on an
    # H200, Mistral-7B widths' training step (bf16, 4096 tokens) ran its cuBLAS products at
    # 790 TFLOP/s on average, the generated ones with epilogues at 560-680
    library_speedup: float = 1.2
    # ... in IEEE float32: cuBLAS's SGEMM ran ViT's float32 attention products above in
    # 130-200 us, twice the generated ones' speed
    fp32_library_speedup: float = 2.0

    def tensor_flops_per_us(self, dtype: str) -> float:
        if dtype in ("float16", "bfloat16"):
            return self.half_flops_per_us
        return self.tf32_flops_per_us if _tf32() else self.fp32_flops_per_us

    def library_speedup_of(self, dtype: str) -> float:
        """How much faster cuBLAS runs a plain product of ``dtype`` than a generated one."""
        return self.fp32_library_speedup if dtype == "float32" and not _tf32() else self.library_speedup


def _tf32() -> bool:
    import torch
    return torch.backends.cuda.matmul.allow_tf32


DEFAULT_DEVICE = Device()

_calibrations: dict | None = None  # device name -> Device, read from the cache once per process


def calibrations_path():
    from ..runtime.cache import cache_dir
    return cache_dir() / "devices.json"


def load_calibrations() -> dict:
    """Device name -> Device from the cache; an unreadable file or entry counts as absent."""
    try:
        raw = json.loads(calibrations_path().read_text())
    except (OSError, ValueError):
        return {}
    known = {f.name for f in fields(Device)}
    out = {}
    for name, figures in raw.items() if isinstance(raw, dict) else ():
        try:
            out[name] = Device(**{k: v for k, v in figures.items() if k in known})
        except (TypeError, AttributeError):
            continue
    return out


def save_calibration(device: Device) -> None:
    from ..runtime.cache import write_atomic
    global _calibrations
    entries = {name: asdict(d) for name, d in load_calibrations().items()}
    entries[device.name] = asdict(device)
    write_atomic(calibrations_path(), json.dumps(entries, indent=1, sort_keys=True))
    _calibrations = None


def device_model(name: str | None = None) -> Device:
    """The model of the GPU called ``name`` (by default the current CUDA device, or none on
    a machine without one): its calibration if ``eqfuse calibrate`` measured it, else the
    defaults, which also stand for the GPU the CPU interpreter's kernels are written for."""
    global _calibrations
    if name is None:
        import torch
        if not torch.cuda.is_available():
            return DEFAULT_DEVICE
        name = torch.cuda.get_device_name()
    if _calibrations is None:
        _calibrations = load_calibrations()
    return _calibrations.get(name, DEFAULT_DEVICE)


def load_footprint(node: PNode) -> int:
    """Distinct elements a load touches (zero-stride and unit dims read once)."""
    _, strides, _ = node.attrs
    return math.prod(s for s, st in zip(node.shape, strides) if st != 0) if node.shape else 1


def kernel_bytes(spec: KernelSpec, buffers: dict) -> int:
    reads: dict[str, int] = {}
    gathered = _gathered(spec)
    for n in spec.walk():
        if n.op == "load":
            buf = n.attrs[0]
            nbytes = min(load_footprint(n), buffers[buf].numel, gathered.get(id(n), math.inf)) * ops.itemsize(n.dtype)
            reads[buf] = max(reads.get(buf, 0), nbytes)
    writes = sum(buffers[b].numel * ops.itemsize(buffers[b].dtype) for _, b in spec.roots)
    return sum(reads.values()) + writes


def _gathered(spec: KernelSpec) -> dict:
    """id of a load under a gather's table -> the elements the gather reads of it at most
    (an embedding reads a table's rows for its tokens, not the table)."""
    found: dict = {}
    for n in spec.walk():
        if n.op == "gather":
            for below in n.args[0].walk():
                if below.op == "load":
                    found[id(below)] = max(found.get(id(below), 0), n.numel)
    return found


OPERAND_TILE = 128  # a matmul operand is computed once per output tile it meets
# (An attention kernel's keys and values are read as stored: codegen/attention.py.)


# On Hopper the flash template (codegen/flash.py) runs an attention kernel of the plain
# form at head dim 128 about 1.3x faster than the portable kernel does (H200, S=2048: the
# portable kernel 1.29-1.31x SDPA's time, the template 0.98-1.04x), and at 96 in tiles of
# 128 (B=4, H=32, S=1024, causal, bf16: 436 us untuned with q's rotary embedding as the
# portable kernel's prologue, the template 89). There, a kernel the template cannot take
# (a prologue such as q's rotary embedding) is costed at the portable kernel's rate, so
# that extraction weighs a kernel of its own for the prologue against it; at 1.3 (the
# autotuned ratio at 128) a head dim of 96 kept q's rotary embedding in the portable
# kernel. At head dim 256 (Gemma-2: B=4, 8 heads, S=1024, causal, bf16) the portable
# kernel with q's rotary embedding as its prologue took 620-660 us, the template 57 and
# the rotary embedding's own kernel less than 40; at 1 extraction kept the prologue (4 is
# enough to part them, and stays under the measured ratio for kernels the template beats less).
# At head dim 64 the two ran within 8% of each other: not weighed.
PORTABLE_ATTENTION_SLOWDOWN = {128: 2.0, 256: 4.0}  # by the template's tile width (flash.padded)


def attention_slowdown(sched) -> float:
    """How much slower than the tensor cores' rate an attention kernel's products run:
    PORTABLE_ATTENTION_SLOWDOWN for a kernel the flash template would run in tiles 128 or
    256 wide, on a device where it runs others but cannot run this one, else 1."""
    from ..codegen import flash
    if sched.flash is None and sched.k == sched.d and flash.device_supports():
        return PORTABLE_ATTENTION_SLOWDOWN.get(flash.padded(sched.d), 1.0)
    return 1.0


def kernel_compute(spec: KernelSpec, computed_sides: tuple = ()) -> float:
    """Pointwise work, in cost units. A matmul's operand (prologue) counts once per output
    tile that reads it: about N / 128 times for the left operand, M / 128 for the right.
    The operands on ``computed_sides`` (0: left, 1: right) count nothing: the tile model
    times their work (``Schedule.gathered_sides``, codegen/tiles.py)."""
    repeat: dict[int, float] = {}
    for d in (n for n in spec.walk() if n.op in ("dot", "expdot")):
        m, n_ = d.shape[-2], d.shape[-1]
        for operand, times in ((d.args[0], math.ceil(n_ / OPERAND_TILE)),
                               (d.args[1], math.ceil(m / OPERAND_TILE))):
            for x in operand.walk():
                repeat[id(x)] = max(repeat.get(id(x), 1), times)
        for side in computed_sides:
            for x in d.args[side].walk():
                repeat[id(x)] = 0
    total = 0.0
    for n in spec.walk():
        if n.op == "unary":
            work = ops.UNARY[n.attrs[0]].cost * n.numel
        elif n.op == "binary":
            work = ops.BINARY[n.attrs[0]].cost * n.numel
        elif n.op in ("where", "cast"):
            work = 0.5 * n.numel
        elif n.op == "reduce":
            work = n.args[0].numel
        else:
            continue
        total += work * repeat.get(id(n), 1)
    return total


def attention_flops(sched) -> float:
    """The products of an attention kernel (scores and values), over the tiles its band
    leaves (a causal mask: about half)."""
    batch = math.prod(sched.batch)
    pairs = sched.m * sched.n if sched.band is None else band_pairs(sched.m, sched.n, *sched.band)
    return 2.0 * batch * pairs * (sched.k + sched.d * sched.dots)


def band_pairs(m: int, n: int, lo: int, hi: int) -> int:
    """Pairs (i, j), i < m, j < n, with lo <= j - i <= hi."""
    lo, hi = max(lo, -(m - 1)), min(hi, n - 1)
    if lo > hi:
        return 0
    # each diagonal d = j - i holds min(m, n - d) - max(0, -d) pairs, summed in closed
    # form over the stretches where neither bound switches
    total = 0
    for a, b in _stretches(lo, hi, (0, n - m)):
        total += _diagonals(m, n, a, b)
    return total


def _stretches(lo: int, hi: int, cuts: tuple) -> list:
    points = sorted({lo, hi + 1, *(c for c in cuts if lo < c <= hi)})
    return list(zip(points, [p - 1 for p in points[1:]]))


def _diagonals(m: int, n: int, a: int, b: int) -> int:
    """Pairs on diagonals a..b, where min(m, n - d) and max(0, -d) are each one linear
    piece: the count is linear in d, so the sum is its mean times the number."""
    def on(d):
        return max(0, min(m, n - d) - max(0, -d))
    return (on(a) + on(b)) * (b - a + 1) // 2


def kernel_time_us(spec: KernelSpec, buffers: dict, device: Device | None = None,
                   passes: int = 1, sched=None, library: bool = False) -> float:
    """``library``: the kernel is a plain product that cuBLAS will run (``library_speedup``)."""
    device = device or device_model()
    memory = passes * kernel_bytes(spec, buffers) / device.bandwidth_bytes_per_us
    matmul = sched is not None and sched.kind == "matmul"
    compute = kernel_compute(spec, sched.gathered_sides if matmul else ()) / device.ops_per_us
    if matmul:
        from ..codegen import splitk
        compute += splitk.modelled_us(spec, sched, device) / (device.library_speedup_of(sched.dot_dtype) if library
                                                              else 1.0)
    elif sched is not None and sched.kind == "attention":
        compute += attention_flops(sched) / device.tensor_flops_per_us(sched.dot_dtype) * attention_slowdown(sched)
    return device.launch_us + max(memory, compute)
