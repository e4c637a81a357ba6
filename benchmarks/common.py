"""What the benchmark scripts share: torch.compile with its compile time, and the JSON
results file with the environment it was measured in."""

from __future__ import annotations

import datetime
import json
import platform
import time

import torch
import triton

import eqfuse


def inductor_compiled(fn, inputs):
    """``torch.compile(fn)`` compiled for ``inputs`` by one call: (callable, seconds)."""
    torch._dynamo.reset()
    compiled = torch.compile(fn)
    t0 = time.perf_counter()
    compiled(*inputs)
    torch.cuda.synchronize()
    return compiled, time.perf_counter() - t0


def save_results(path: str | None, rows: list, **extra) -> None:
    """Write ``rows`` with the device, date and versions they were measured with."""
    if not path:
        return
    result = {"device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
              "torch": torch.__version__, "triton": triton.__version__, "eqfuse": eqfuse.__version__,
              "python": platform.python_version(), **extra, "results": rows}
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
