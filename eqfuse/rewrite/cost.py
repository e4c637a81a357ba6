"""The cost model: a roofline per kernel plus a fixed cost per launch.

time(kernel) = launch + max(bytes moved / bandwidth, compute / throughput)

Bytes count each buffer a kernel reads once (a broadcast read costs the distinct
elements it touches, not the broadcast size) and each buffer it writes. Device figures
default to an H100/H200-class GPU; they are plain numbers so a calibration can replace them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..schema import ops
from ..schema.plan import KernelSpec, PNode


@dataclass(frozen=True)
class Device:
    name: str = "default-gpu"
    bandwidth_bytes_per_us: float = 3.5e6  # 3.5 TB/s
    launch_us: float = 3.0
    ops_per_us: float = 2.0e7  # pointwise cost units (about one flop each) per microsecond


DEFAULT_DEVICE = Device()


def load_footprint(node: PNode) -> int:
    """Distinct elements a load touches (zero-stride and unit dims read once)."""
    _, strides, _ = node.attrs
    return math.prod(s for s, st in zip(node.shape, strides) if st != 0) if node.shape else 1


def kernel_bytes(spec: KernelSpec, buffers: dict) -> int:
    reads: dict[str, int] = {}
    for n in spec.walk():
        if n.op == "load":
            buf = n.attrs[0]
            nbytes = min(load_footprint(n), buffers[buf].numel) * ops.itemsize(n.dtype)
            reads[buf] = max(reads.get(buf, 0), nbytes)
    writes = sum(buffers[b].numel * ops.itemsize(buffers[b].dtype) for _, b in spec.roots)
    return sum(reads.values()) + writes


def kernel_compute(spec: KernelSpec) -> float:
    total = 0.0
    for n in spec.walk():
        if n.op == "unary":
            total += ops.UNARY[n.attrs[0]].cost * n.numel
        elif n.op == "binary":
            total += ops.BINARY[n.attrs[0]].cost * n.numel
        elif n.op in ("where", "cast"):
            total += 0.5 * n.numel
        elif n.op == "reduce":
            total += n.args[0].numel
    return total


def kernel_time_us(spec: KernelSpec, buffers: dict, device: Device = DEFAULT_DEVICE,
                   passes: int = 1) -> float:
    memory = passes * kernel_bytes(spec, buffers) / device.bandwidth_bytes_per_us
    compute = kernel_compute(spec) / device.ops_per_us
    return device.launch_us + max(memory, compute)
