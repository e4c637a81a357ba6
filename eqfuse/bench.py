"""``eqfuse bench``: the benchmark suite, eqfuse vs eager vs torch.compile in one run.

For each workload (DESIGN.md's table and the other issues' headline cases) every
contender is compiled, checked against eager, and timed in interleaved rounds (on the GPU
``triton.testing.do_bench``, L2 flushed, median; on the CPU wall time of a few calls).
Reported per contender: microseconds, speedup over eager, the fraction of the hardware
limit it reaches (copy bandwidth for memory-bound work, both the calibrated bandwidth of a
large copy and the time of a copy moving the same bytes; measured cuBLAS throughput for
matrix products), and compile seconds cold (the first compile, every cache empty) and
warm (the same compile again, caches filled). The suite also ranks candidate plans: each
workload compiled with fusion and without, the cost model's predicted time against the
measured one, as a rank correlation over the suite.

``--tiny`` runs the same workloads at a few elements each: on the CPU that is the
interpreter, and only checks the machinery and the output format.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import examples as ex

ROUNDS = 5


@dataclass(frozen=True)
class Workload:
    name: str
    fn: Callable
    inputs: Callable[[str], tuple]  # device -> input tensors
    flops: float = 0.0  # of the products, for compute-bound work; 0 means memory-bound
    contraction: bool = False  # compare with the tolerance of sums of products

    def ideal_bytes(self, inputs, outputs) -> int:
        """Each input read once and each output written once."""
        tensors = [*inputs, *(outputs if isinstance(outputs, tuple) else (outputs,))]
        return sum(t.numel() * t.element_size() for t in tensors)


def suite(tiny: bool = False) -> list[Workload]:
    f16, bf16, f32 = torch.float16, torch.bfloat16, torch.float32
    s = (lambda big, small: small) if tiny else (lambda big, small: big)
    dt = (lambda d: f32) if tiny else (lambda d: d)

    def rows(maker, r, c, dtype):
        return lambda device: maker(s(r, 4), s(c, 64), dt(dtype), device)

    def mm(maker, m, n, k, dtype):
        return lambda device: maker(s(m, 32), s(n, 32), s(k, 32), dt(dtype), device)

    def qkv(seq, dim, dtype):
        return lambda device: ex._qkv(s(4, 1), s(32, 2), s(seq, 32), s(dim, 16), dt(dtype), device)

    def attn_flops(seq, dim, causal):
        b, h, n, d = s(4, 1), s(32, 2), s(seq, 32), s(dim, 16)
        return 4 * b * h * n * n * d / (2 if causal else 1)

    M, N, K = s(8192, 32), s(4096, 32), s(4096, 32)
    T, HID, INTER = s(4096, 32), s(4096, 32), s(11008, 32)
    return [
        Workload("RMSNorm 4096x4096 fp16", ex.rmsnorm, rows(ex._rms, 4096, 4096, f16)),
        Workload("RMSNorm 8192x1536 fp16", ex.rmsnorm, rows(ex._rms, 8192, 1536, f16)),
        Workload("softmax 4096x4096 fp32", ex.softmax, rows(ex._x, 4096, 4096, f32)),
        Workload("SwiGLU silu(a)*b 8192x11008 bf16", ex.swiglu, rows(ex._xy, 8192, 11008, bf16)),
        Workload("residual+LayerNorm 8192x4096 fp16", ex.residual_layernorm, rows(ex._ln, 8192, 4096, f16)),
        Workload("gelu(x@W+b) 8192x4096x4096 fp16", ex.linear_gelu, mm(ex._linear_gelu, 8192, 4096, 4096, f16),
                 flops=2 * M * N * K, contraction=True),
        Workload("SwiGLU MLP 4096x4096x11008 fp16", ex.swiglu_mlp, mm(ex._swiglu_mlp, 4096, 11008, 4096, f16),
                 flops=3 * 2 * T * HID * INTER, contraction=True),
        Workload("attention B4 H32 S2048 D128 fp16", ex.attention, qkv(2048, 128, f16),
                 flops=attn_flops(2048, 128, False), contraction=True),
        Workload("causal attention (masked_fill) same", ex.causal_attention, qkv(2048, 128, f16),
                 flops=attn_flops(2048, 128, True), contraction=True),
    ]


class Progress:
    """One line on a terminal (redrawn), a line per step elsewhere."""

    def __init__(self, total: int, stream=None):
        self.total, self.done, self.stream = total, 0, stream or sys.stderr
        self.tty = self.stream.isatty()

    def step(self, what: str, advance: bool = False) -> None:
        """Show what runs now; ``advance`` when a workload is finished."""
        self.done += advance
        width = 30
        filled = width * self.done // max(self.total, 1)
        line = f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {what}"
        if self.tty:
            self.stream.write("\r" + line[:118].ljust(118))
            if self.done == self.total:
                self.stream.write("\n")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


MIN_CALLS = 10  # timed calls, at least, in one measurement


def gpu_us(fn, window_ms: float = 50.0) -> float:
    """Median microseconds of ``fn`` on the GPU, L2 flushed before each call, over a window
    of at least ``window_ms`` and MIN_CALLS calls: do_bench's 50 ms window holds one call
    of a 40 ms training step, and the median of one call is that call."""
    import triton.testing
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    rep_ms = max(window_ms, MIN_CALLS * start.elapsed_time(end))
    return triton.testing.do_bench(fn, warmup=10, rep=rep_ms, return_mode="median") * 1e3


def _timer(device: str) -> Callable[[Callable], float]:
    if device == "cuda":
        return gpu_us

    def wall_us(fn):
        fn()
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
        return sorted(times)[1]
    return wall_us


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _compile_seconds(make: Callable[[], Callable], inputs, device) -> tuple[Callable, float]:
    """Compile and run once; the seconds until the first result is ready."""
    t0 = time.perf_counter()
    fn = make()
    fn(*inputs)
    _sync(device)
    return fn, time.perf_counter() - t0


def _contender_makers(w: Workload, inputs, names):
    import eqfuse
    makers = {}
    if "torch.compile" in names:
        def inductor():
            torch._dynamo.reset()
            # Static shapes, as eqfuse's: workloads share functions, and after a reset dynamo's
            # profile of earlier calls would otherwise compile later sizes as dynamic.
            return torch.compile(w.fn, dynamic=False)
        makers["torch.compile"] = inductor
    if "eqfuse" in names:
        makers["eqfuse"] = lambda: eqfuse.compile(w.fn, inputs)
    return makers


def run_workload(w: Workload, device: str, names: list[str], progress: Progress, limits: dict) -> dict:
    import eqfuse
    torch.manual_seed(0)
    inputs = w.inputs(device)
    ref = w.fn(*inputs)
    row: dict = {"workload": w.name, "contenders": {}}
    fns = {"eager": w.fn}
    for name, make in _contender_makers(w, inputs, names).items():
        progress.step(f"{w.name}: compiling {name} (cold)")
        fn, cold = _compile_seconds(make, inputs, device)
        progress.step(f"{w.name}: compiling {name} (warm)")
        _, warm = _compile_seconds(make, inputs, device)
        fns[name] = fn
        row["contenders"][name] = {"compile_s_cold": round(cold, 2), "compile_s_warm": round(warm, 2),
                                   "matches_eager": ex.matches(fn(*inputs), ref, w.contraction)}
        if name == "eqfuse":
            row["contenders"][name].update(kernels=len(fn.kernels), cublas_calls=len(fn.library_calls),
                                           fallbacks=[str(f) for f in fn.fallbacks])
    timer = _timer(device)
    times: dict = {n: [] for n in fns}
    for r in range(ROUNDS):
        progress.step(f"{w.name}: timing, round {r + 1}/{ROUNDS}")
        for n, fn in fns.items():
            times[n].append(timer(lambda fn=fn: fn(*inputs)))
    eager_us = sorted(times["eager"])[ROUNDS // 2]
    if not w.flops and device == "cuda":
        row["copy_same_bytes_us"] = round(_copy_us(w.ideal_bytes(inputs, ref), timer), 1)
    for n, ts in times.items():
        us = sorted(ts)[ROUNDS // 2]
        entry = row["contenders"].setdefault(n, {})
        entry.update(us=round(us, 1), speedup_vs_eager=round(eager_us / us, 2))
        if w.flops:
            entry["tflops"] = round(w.flops / us / 1e6, 1)
            if limits.get("matmul_flops_per_us"):
                entry["fraction_of_peak"] = round(w.flops / us / limits["matmul_flops_per_us"], 3)
        elif limits.get("bandwidth_bytes_per_us"):
            bandwidth = limits["bandwidth_bytes_per_us"]
            entry["fraction_of_bandwidth"] = round(w.ideal_bytes(inputs, ref) / us / bandwidth, 3)
            if "copy_same_bytes_us" in row:
                entry["fraction_of_copy_same_bytes"] = round(row["copy_same_bytes_us"] / us, 3)
    if "eqfuse" in fns:
        progress.step(f"{w.name}: candidate plans")
        row["plans"] = _candidate_plans(w, inputs, timer, eqfuse)
    progress.step(f"{w.name}: done", advance=True)
    return row


def _copy_us(nbytes: int, timer) -> float:
    """A device-to-device copy that moves ``nbytes`` in all (half read, half written): the
    hardware limit at this size, ramp-up and tail of a short kernel included, where the
    calibrated bandwidth is that of a copy far larger."""
    src = torch.empty(nbytes // 8, dtype=torch.float32, device="cuda")  # as calibrate's copy
    dst = torch.empty_like(src)
    return timer(lambda: dst.copy_(src))


def _candidate_plans(w: Workload, inputs, timer, eqfuse) -> list[dict]:
    """The plan eqfuse extracts and the plan without fusion: predicted and measured time."""
    plans = []
    for label, rules in (("fused", ("algebra", "views", "fusion")), ("unfused", ("algebra", "views"))):
        compiled = eqfuse.compile(w.fn, inputs, rules=rules, validate=False)
        if compiled.fallbacks:
            continue
        predicted = compiled.report.get("extraction", {}).get("plan_cost_us")
        measured = sorted(timer(lambda c=compiled: c(*inputs)) for _ in range(3))[1]
        plans.append({"plan": label, "kernels": len(compiled.kernels), "predicted_us": predicted,
                      "measured_us": round(measured, 1)})
    return plans


def spearman(xs, ys) -> float | None:
    """Rank correlation: the Pearson correlation of the ranks, tied values sharing their
    mean rank (as scipy's ``spearmanr``), so that the order of the pairs does not matter;
    None under three pairs or where a side is constant."""
    if len(xs) < 3:
        return None

    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        start = 0
        while start < len(order):
            end = start
            while end + 1 < len(order) and v[order[end + 1]] == v[order[start]]:
                end += 1
            for k in order[start:end + 1]:
                r[k] = (start + end) / 2
            start = end + 1
        return r
    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    vx, vy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    return None if vx == 0 or vy == 0 else cov / math.sqrt(vx * vy)


def ranking_summary(rows: list[dict]) -> dict:
    """How the model's predictions rank the measured plans: over the whole suite, and the
    share of workloads where it orders fused and unfused as the GPU does."""
    pairs = [(p["predicted_us"], p["measured_us"]) for r in rows for p in r.get("plans", [])
             if p["predicted_us"] is not None]
    agree, compared = 0, 0
    for r in rows:
        ps = [p for p in r.get("plans", []) if p["predicted_us"] is not None]
        if len(ps) == 2:
            compared += 1
            agree += (ps[0]["predicted_us"] < ps[1]["predicted_us"]) == (ps[0]["measured_us"] < ps[1]["measured_us"])
    rho = spearman([p for p, _ in pairs], [m for _, m in pairs])
    return {"plans": len(pairs), "spearman": None if rho is None else round(rho, 3),
            "workloads_ordered_right": f"{agree}/{compared}"}


def format_table(rows: list[dict], names: list[str]) -> str:
    cols = ["eager", *names]
    head = f"{'workload':36s}" + "".join(f"{c + ' us':>18s}" for c in cols) + f"{'speedup':>9s}{'of limit':>9s}"
    head += "".join(f"{c + ' compile s':>24s}" for c in names)
    lines = [head, " " * (36 + 18 * len(cols) + 18) + "".join(f"{'cold / warm':>24s}" for _ in names),
             "-" * len(head)]
    for r in rows:
        c = r["contenders"]
        line = f"{r['workload'][:36]:36s}" + "".join(f"{c.get(n, {}).get('us', math.nan):>18.1f}" for n in cols)
        eq = c.get("eqfuse", {})
        limit = eq.get("fraction_of_bandwidth", eq.get("fraction_of_peak"))
        line += f"{eq.get('speedup_vs_eager', math.nan):>8.2f}x"
        line += f"{limit:>9.0%}" if limit is not None else f"{'':>9s}"
        for n in names:
            cold, warm = (c.get(n, {}).get(k, math.nan) for k in ("compile_s_cold", "compile_s_warm"))
            line += f"{cold:>17.1f} / {warm:<4.1f}"
        if not all(v.get("matches_eager", True) for v in c.values()):
            line += "  MISMATCH"
        lines.append(line)
    return "\n".join(lines)


def environment() -> dict:
    """Where and with what a result was measured."""
    import datetime
    import platform

    import triton

    import eqfuse
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU {platform.machine()}"
    return {"device": device, "date": datetime.date.today().isoformat(), "torch": torch.__version__,
            "triton": triton.__version__, "eqfuse": eqfuse.__version__, "python": platform.python_version()}


def write_chart(result: dict, path: str) -> None:
    """Each contender's speedup over eager, per workload, as a PNG bar chart."""
    from .chart import bar_chart_png
    rows = result["results"]
    names = list(dict.fromkeys(["eager", *(n for r in rows for n in r["contenders"])]))
    series = {n: [r["contenders"].get(n, {}).get("us") for r in rows] for n in names}
    bar_chart_png(path, f"eqfuse bench, {result['device']}", [r["workload"] for r in rows], series,
                  normalise_to="eager")


def _fresh_caches() -> str:
    """Point eqfuse's, Triton's and Inductor's caches at an empty directory, so the first
    compile of each workload is cold for every contender."""
    import os
    import tempfile
    root = tempfile.mkdtemp(prefix="eqfuse-bench-")
    for var, sub in (("EQFUSE_CACHE_DIR", "eqfuse"), ("TRITON_CACHE_DIR", "triton"),
                     ("TORCHINDUCTOR_CACHE_DIR", "inductor")):
        os.environ[var] = os.path.join(root, sub)
    return root


def run(tiny: bool = False, out_dir: str | None = None, only: list[str] | None = None,
        contenders: list[str] | None = None, chart: bool = True, resume: bool = False, print_=print) -> dict:
    """Run the suite; print the table; write JSON (and a PNG chart) under ``out_dir``."""
    import json
    import os

    device = "cuda" if torch.cuda.is_available() else "cpu"
    names = contenders or (["torch.compile", "eqfuse"] if device == "cuda" else ["eqfuse"])
    workloads = [w for w in suite(tiny) if not only or any(o.lower() in w.name.lower() for o in only)]
    if not workloads:
        raise ValueError(f"no workload matches {only}; the suite has: {', '.join(w.name for w in suite(tiny))}")
    caches = _fresh_caches()
    env = environment()
    print_(f"eqfuse bench on {env['device']}: {len(workloads)} workloads, eager vs {', '.join(names)}"
           + (" (tiny shapes)" if tiny else "") + f"; caches start empty in {caches}")
    limits = {}
    if device == "cuda":
        from .runtime.calibrate import calibrate
        model = calibrate(progress=print_)
        limits = {"bandwidth_bytes_per_us": model.bandwidth_bytes_per_us,
                  "matmul_flops_per_us": model.half_flops_per_us}
    stem = f"bench{'-tiny' if tiny else ''}_{env['device'].replace(' ', '-')}_{env['date']}"
    result = {**env, "tiny": tiny, "limits": limits, "results": []}
    rows = result["results"]
    if resume and out_dir:  # keep the workloads an earlier run of today measured on this device
        try:
            with open(os.path.join(out_dir, stem + ".json")) as f:
                rows += [r for r in json.load(f)["results"] if r["workload"] in {w.name for w in workloads}]
        except (OSError, ValueError, KeyError):
            pass
        done = {r["workload"] for r in rows}
        if done:
            print_(f"resuming: {len(done)} workload(s) already measured")
        workloads = [w for w in workloads if w.name not in done]
    progress = Progress(len(workloads))
    for w in workloads:
        rows.append(run_workload(w, device, names, progress, limits))
        result["ranking"] = ranking_summary(rows)
        if out_dir:  # after every workload, so that a long run cut short keeps what it measured
            os.makedirs(out_dir, exist_ok=True)
            result["json_path"] = os.path.join(out_dir, stem + ".json")
            with open(result["json_path"], "w") as f:
                json.dump({k: v for k, v in result.items() if k != "json_path"}, f, indent=1)
    ranking = result["ranking"]
    print_(format_table(rows, names))
    print_(f"cost model vs measured plans: Spearman {ranking['spearman']} over {ranking['plans']} plans; "
           f"fused vs unfused ordered as measured on {ranking['workloads_ordered_right']} workloads")
    if out_dir:
        print_(f"wrote {result['json_path']}")
        if chart:
            result["png_path"] = os.path.join(out_dir, stem + ".png")
            write_chart(result, result["png_path"])
            print_(f"wrote {result['png_path']}")
    return result
