"""Cold compile seconds of the model blocks, each contender alone in a fresh process.

    python benchmarks/compile_cold.py [--models gpt2 bert llama] [--modes forward forward+backward]
        [--rounds 2] [--out results.json]

For every model, mode and contender, ``benchmarks/models.py --no-timing`` runs in a process
of its own with its own empty eqfuse, Triton and Inductor cache directories: the first call
pays for everything a user's first call does (imports, compile workers, kernels). Rounds
alternate the contenders' order, so that neither always runs on a machine the other just
warmed (disk cache, clocks). ``models.py`` run alone measures both contenders in one process,
torch.compile first: eqfuse's compile then finds torch's imports and first-call work done.
Prints each process's seconds as it ends (and for eqfuse its stages and its compile pool's
figures); the results file has every run and, per block, the median of each contender.

A package installed without bytecode (``pip install --no-compile``, or a read-only
environment) is compiled from source at every import, in every fresh process: on the
H100 machines this repository benchmarks on, torch, triton, sympy and networkx came
without it, and importing networkx alone took 0.75 s instead of 0.13-0.19. That cost
falls on whichever contender imports more of them, and is not what a user who installed
with pip pays. So the script first says which of the packages the contenders import lack
bytecode (in the results file too); ``--byte-compile`` compiles them first
(``python -m compileall``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import save_results  # noqa: E402

CONTENDERS = ("torch.compile", "eqfuse")
CACHES = ("EQFUSE_CACHE_DIR", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")
# What the contenders import in their first call (torch.compile: Inductor, sympy; eqfuse: egglog, networkx)
PACKAGES = ("torch", "triton", "sympy", "networkx", "egglog", "black", "eqfuse")


def _package_dir(name: str) -> str | None:
    import importlib.util

    spec = importlib.util.find_spec(name)
    return os.path.dirname(spec.origin) if spec and spec.origin else None


def without_bytecode() -> dict:
    """package -> the share of its modules that have no bytecode (Python's own cache file),
    where that share is 5% or more."""
    import importlib.util

    shares = {}
    for name in PACKAGES:
        where = _package_dir(name)
        if where is None:
            continue
        sources = [os.path.join(root, f) for root, _, files in os.walk(where) for f in files if f.endswith(".py")]
        lacking = sum(not os.path.exists(importlib.util.cache_from_source(f)) for f in sources)
        if sources and lacking >= 0.05 * len(sources):
            shares[name] = round(lacking / len(sources), 2)
    return shares


def byte_compile() -> None:
    """``python -m compileall`` over the packages, where they are writable."""
    dirs = [d for d in map(_package_dir, PACKAGES) if d and os.access(d, os.W_OK)]
    subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", *dirs], stdout=subprocess.DEVNULL)


def run_alone(model: str, mode: str, contender: str, timeout: float) -> dict:
    """One first call, in a fresh process with empty caches: models.py's entry for it."""
    with tempfile.TemporaryDirectory(prefix="compile-cold-") as tmp:
        env = dict(os.environ, **{var: os.path.join(tmp, var.lower()) for var in CACHES})
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, os.path.join(HERE, "models.py"), "--models", model, "--modes", mode,
               "--contenders", contender, "--no-timing", "--out", out]
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"no result in {timeout:.0f} s"}
        if proc.returncode != 0 or not os.path.exists(out):
            lines = (proc.stderr or proc.stdout).strip().splitlines()
            return {"error": lines[-1] if lines else f"exit code {proc.returncode}"}
        with open(out) as f:
            return json.load(f)["results"][0][contender]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["gpt2", "bert", "llama"])
    modes = ["forward", "forward+backward"]
    p.add_argument("--modes", nargs="+", choices=modes, default=modes)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one process may take")
    p.add_argument("--byte-compile", action="store_true",
                   help="compile the packages' bytecode first (see the module docstring)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if a.byte_compile:
        byte_compile()
    lacking = without_bytecode()
    if lacking:
        print(f"warning: modules without bytecode, compiled from source in every process: {lacking}", flush=True)

    rows = []
    for rnd in range(a.rounds):
        for model in a.models:
            for mode in a.modes:
                for contender in (CONTENDERS if rnd % 2 == 0 else CONTENDERS[::-1]):
                    entry = run_alone(model, mode, contender, a.timeout)
                    row = {"model": model, "mode": mode, "contender": contender, "round": rnd + 1,
                           "compile_s_cold": entry.get("compile_s_cold")}
                    for key in ("error", "cold_compile_stages_s", "parallel_compile_cold"):
                        if key in entry:
                            row[key] = entry[key]
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    medians = {}
    for row in rows:
        if row["compile_s_cold"] is not None:
            medians.setdefault(f"{row['model']} {row['mode']}", {}).setdefault(row["contender"], []).append(
                row["compile_s_cold"])
    medians = {block: {c: statistics.median(s) for c, s in by.items()} for block, by in medians.items()}
    for block, by in medians.items():
        print(block, json.dumps(by))
    save_results(a.out, rows, medians_s=medians, rounds=a.rounds, without_bytecode=lacking,
                 method="each contender alone in a fresh process with empty caches (benchmarks/compile_cold.py)"
                        + (", packages byte-compiled first" if a.byte_compile else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
