"""``eqfuse calibrate``: measure the current GPU for the cost model.

Measured: the bandwidth of a large device-to-device copy (what a memory-bound kernel can
reach), the time of an empty Triton kernel launched alone (the fixed cost of one kernel
more in a plan), and the dense matmul throughput per input type (cuBLAS at 8192^3, which
Triton's kernels reach within a few percent at that size). Read from the device: SMs and
L2 size. The pointwise throughput and L2's speed-up over HBM keep their defaults.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from ..errors import EqfuseError
from ..rewrite.cost import DEFAULT_DEVICE, Device, save_calibration

COPY_BYTES = 1 << 28  # 256 MiB each way: far beyond any L2
MATMUL_SIZE = 8192


def _median_us(fn) -> float:
    import triton.testing
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def copy_bytes_per_us() -> float:
    """Bytes a large device-to-device copy moves per microsecond (read + write)."""
    src = torch.empty(COPY_BYTES // 4, device="cuda")
    dst = torch.empty_like(src)
    return 2 * COPY_BYTES / _median_us(lambda: dst.copy_(src))


def _empty_kernel():
    import triton

    @triton.jit
    def empty(x):
        pass
    return empty


def _matmul_flops_per_us(dtype: torch.dtype, tf32: bool) -> float:
    n = MATMUL_SIZE
    a = torch.randn(n, n, device="cuda").to(dtype)
    b = torch.randn(n, n, device="cuda").to(dtype)
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        us = _median_us(lambda: a @ b)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    return 2 * n ** 3 / us


def calibrate(progress: Callable[[str], None] = print) -> Device:
    """Measure the current GPU, store the figures in the cache, and return them."""
    if not torch.cuda.is_available():
        raise EqfuseError("eqfuse calibrate measures a CUDA GPU and this machine has none; "
                          "without one the cost model uses its defaults")
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    name = torch.cuda.get_device_name()
    progress(f"calibrating {name} ({props.multi_processor_count} SMs, "
             f"L2 {props.L2_cache_size // 1024} KiB)")

    bandwidth = copy_bytes_per_us()
    progress(f"  copy bandwidth      {bandwidth / 1e3:8.0f} GB/s")

    empty, scratch = _empty_kernel(), torch.empty(1, device="cuda")
    launch = _median_us(lambda: empty[(1,)](scratch))
    progress(f"  empty kernel        {launch:8.2f} us")

    half = _matmul_flops_per_us(torch.float16, tf32=False)
    tf32 = _matmul_flops_per_us(torch.float32, tf32=True)
    fp32 = _matmul_flops_per_us(torch.float32, tf32=False)
    for label, value in (("fp16/bf16", half), ("tf32", tf32), ("fp32", fp32)):
        progress(f"  cuBLAS {label:12s} {value / 1e6:8.0f} TFLOP/s")

    # The products timed are cuBLAS's; the model's rates are a generated kernel's, cuBLAS's
    # over the measured speedups (rewrite/cost.py, Device.library_speedup_of)
    d = DEFAULT_DEVICE
    device = replace(d, name=name, bandwidth_bytes_per_us=bandwidth, launch_us=launch,
                     sms=props.multi_processor_count, l2_bytes=props.L2_cache_size,
                     half_flops_per_us=half / d.library_speedup, tf32_flops_per_us=tf32 / d.library_speedup,
                     fp32_flops_per_us=fp32 / d.fp32_library_speedup)
    save_calibration(device)
    return device
