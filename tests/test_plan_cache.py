"""The plan cache (eqfuse/runtime/plan_cache.py): a second compile of the same graph, in this
process or another, takes the stored plan and skips saturation; anything that changes the
plan misses; an entry that does not check out is rebuilt."""

import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from conftest import DEVICE, assert_matches, sorted_along

import eqfuse
from eqfuse.rewrite import saturate as saturate_module
from eqfuse.runtime import plan_cache


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache directory, with the plan cache on (conftest turns it off for the suite)."""
    monkeypatch.setenv("EQFUSE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(plan_cache.ENV_SWITCH, "1")
    return tmp_path


def block(x, w, b):
    h = torch.nn.functional.layer_norm(x, x.shape[-1:])
    return torch.nn.functional.gelu(h @ w + b), h.sum(-1)


def block_inputs(rows=16, cols=32, dtype=torch.float32):
    torch.manual_seed(0)
    return (torch.randn(rows, cols, dtype=dtype), torch.randn(cols, cols, dtype=dtype) / cols ** 0.5,
            torch.randn(cols, dtype=dtype))


def _no_saturation(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("saturation ran on a plan cache hit")
    monkeypatch.setattr(saturate_module, "saturate", refuse)


def test_second_compile_takes_the_stored_plan_and_skips_saturation(cache, monkeypatch):
    inputs = block_inputs()
    first = eqfuse.compile(block, inputs)
    assert first.report["plan_cache"]["hit"] is False and first.report["plan_cache"]["stored"] is True
    assert "saturate" in first.report["seconds"]
    _no_saturation(monkeypatch)
    second = eqfuse.compile(block, inputs)
    rep = second.report
    assert rep["plan_cache"]["hit"] is True and rep["plan_cache"]["key"] == first.report["plan_cache"]["key"]
    assert not {"translate", "saturate", "extract", "validate", "codegen"} & set(rep["seconds"])
    assert "plan_cache" in rep["seconds"] and "capture" in rep["seconds"]
    assert second.source == first.source
    assert [k.name for k in second.kernels] == [k.name for k in first.kernels]
    assert rep["saturation"] == first.report["saturation"]
    assert "from the plan cache" in second.explain()
    assert_matches(second(*inputs), block(*inputs), contraction=True)
    assert_matches(second(*inputs), first(*inputs))


def test_a_cached_plan_runs_on_other_values_and_other_weights(cache, monkeypatch):
    """Plans depend on the constants' shapes, not their values: a module whose weights
    changed takes the stored plan and computes with its own weights."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.LayerNorm(32))
    x = torch.randn(8, 32)
    eqfuse.compile(model, (x,))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    _no_saturation(monkeypatch)
    again = eqfuse.compile(model, (x,))
    assert again.report["plan_cache"]["hit"] is True
    y = torch.randn(8, 32)
    assert_matches(again(y), model(y), contraction=True)


def test_an_eager_step_survives_the_cache(cache, monkeypatch):
    """An eager fallback's target (a torch operator, which does not pickle) is stored by name."""
    def f(x):
        return torch.relu(sorted_along(torch.exp(x) + 1, -1)) * 2
    x = torch.randn(4, 8)
    eqfuse.compile(f, (x,))
    _no_saturation(monkeypatch)
    c = eqfuse.compile(f, (x,))
    assert c.report["plan_cache"]["hit"] is True
    assert [fb.node for fb in c.fallbacks] == ["sorted_along"]
    assert_matches(c(x), f(x))


SCRIPT = textwrap.dedent("""
    import json, sys, torch, eqfuse
    torch.manual_seed(0)
    def f(x, w):
        return torch.softmax(x @ w, dim=-1) * 2
    x, w = torch.randn(8, 16, device=sys.argv[1]), torch.randn(16, 24, device=sys.argv[1])
    c = eqfuse.compile(f, (x, w))
    print(json.dumps({"cache": c.report["plan_cache"], "stages": sorted(c.report["seconds"]),
                      "egglog_imported": "egglog" in sys.modules,
                      "out": c(x, w).tolist(), "ref": f(x, w).tolist(), "source": c.source}))
""")


def test_a_second_process_takes_the_plan(cache, tmp_path):
    script = tmp_path / "compile_once.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, EQFUSE_CACHE_DIR=str(cache), **{plan_cache.ENV_SWITCH: "1"})
    runs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, str(script), DEVICE], env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first["cache"]["hit"] is False and first["cache"]["stored"] is True
    assert second["cache"]["hit"] is True and "saturate" not in second["stages"]
    assert first["egglog_imported"] and not second["egglog_imported"]  # a hit does without it
    assert second["source"] == first["source"]
    torch.testing.assert_close(torch.tensor(second["out"]), torch.tensor(second["ref"]), rtol=1e-3, atol=1e-3)
    assert second["out"] == first["out"]


def _key(compiled) -> str:
    return compiled.report["plan_cache"]["key"]


def test_a_changed_shape_dtype_or_option_misses(cache):
    base = eqfuse.compile(block, block_inputs())
    others = [
        eqfuse.compile(block, block_inputs(rows=24)),
        eqfuse.compile(block, block_inputs(cols=48)),
        eqfuse.compile(block, block_inputs(dtype=torch.float16)),
        eqfuse.compile(block, block_inputs(), max_enodes=40_000),
        eqfuse.compile(block, block_inputs(), rules=("algebra", "fusion")),
        eqfuse.compile(block, block_inputs(), validate=False),
        eqfuse.compile(block, block_inputs(), emulate_precision_casts=True),
    ]
    keys = {_key(base)}
    for c in others:
        assert c.report["plan_cache"]["hit"] is False and "saturate" in c.report["seconds"]
        keys.add(_key(c))
    assert len(keys) == 1 + len(others)
    x, w, b = block_inputs()
    t = (x.t().contiguous().t(), w, b)  # same shape, other strides
    assert eqfuse.compile(block, t).report["plan_cache"]["hit"] is False
    # options that do not change the plan share its entry
    assert eqfuse.compile(block, block_inputs(), cuda_graphs=False).report["plan_cache"]["hit"] is True


def test_a_changed_eqfuse_source_misses(cache, monkeypatch):
    first = eqfuse.compile(block, block_inputs())
    versions = plan_cache._versions()
    monkeypatch.setattr(plan_cache, "_versions", lambda: versions[:1] + ("another digest",) + versions[2:])
    again = eqfuse.compile(block, block_inputs())
    assert again.report["plan_cache"]["hit"] is False and _key(again) != _key(first)


@pytest.mark.parametrize("switch", ["EQFUSE_SPLIT_REDUCTIONS", "EQFUSE_SPLIT_K", "EQFUSE_KMAJOR", "EQFUSE_PINGPONG"])
def test_turning_a_code_switch_off_misses(cache, monkeypatch, switch):
    """A plan built with split reductions (split-K, K-major copies, the Hopper matmul
    templates) is not one to run where they are turned off."""
    first = eqfuse.compile(block, block_inputs())
    monkeypatch.setenv(switch, "0")
    again = eqfuse.compile(block, block_inputs())
    assert again.report["plan_cache"]["hit"] is False and _key(again) != _key(first)


def _corrupt_truncated(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _corrupt_flipped(path):
    data = bytearray(path.read_bytes())
    data[-20] ^= 0xFF
    path.write_bytes(bytes(data))


def _corrupt_garbage(path):
    path.write_bytes(b"\x00\x01 not a plan at all")


def _corrupt_wrong_contents(path):
    """A well-formed entry (right header and digest) holding something that is not a plan."""
    import hashlib
    import pickle
    key = path.stem
    payload = pickle.dumps({"plan": "nothing"})
    path.write_bytes(plan_cache._header(key, hashlib.sha256(payload).hexdigest()) + payload)


@pytest.mark.parametrize("corrupt", [_corrupt_truncated, _corrupt_flipped, _corrupt_garbage, _corrupt_wrong_contents])
def test_a_corrupt_entry_is_rebuilt(cache, corrupt):
    inputs = block_inputs()
    first = eqfuse.compile(block, inputs)
    path = plan_cache.entry_path(_key(first))
    corrupt(path)
    rebuilt = eqfuse.compile(block, inputs)
    rep = rebuilt.report["plan_cache"]
    assert rep["hit"] is False and rep["rebuilt"] and rep["stored"] is True
    assert "saturate" in rebuilt.report["seconds"]
    assert_matches(rebuilt(*inputs), block(*inputs), contraction=True)
    assert eqfuse.compile(block, inputs).report["plan_cache"]["hit"] is True  # written again, whole


def test_an_entry_of_another_graph_is_not_trusted(cache):
    """An entry whose plan does not take this graph's inputs (a stale or misplaced file
    under the right key) is rebuilt."""
    inputs = block_inputs()
    first = eqfuse.compile(block, inputs)
    other = eqfuse.compile(lambda x: x * 2, (torch.randn(5),))
    entry, _ = plan_cache.load(_key(other))
    assert plan_cache.store(_key(first), entry) is None
    rebuilt = eqfuse.compile(block, inputs)
    assert rebuilt.report["plan_cache"]["hit"] is False
    assert "inputs" in rebuilt.report["plan_cache"]["rebuilt"]
    assert_matches(rebuilt(*inputs), block(*inputs), contraction=True)


def test_writers_at_once_leave_a_whole_entry(cache):
    """Threads storing one key over and over while another reads it: every read finds a
    whole entry (or none yet), never a torn one."""
    inputs = block_inputs()
    key = _key(eqfuse.compile(block, inputs))
    entry, _ = plan_cache.load(key)
    problems, stop = [], threading.Event()

    def write():
        for _ in range(20):
            assert plan_cache.store(key, entry) is None

    def read():
        while not stop.is_set():
            got, problem = plan_cache.load(key)
            if problem or got is None:
                problems.append(problem)
    writers = [threading.Thread(target=write) for _ in range(4)]
    reader = threading.Thread(target=read)
    reader.start()
    for t in writers:
        t.start()
    for t in writers:
        t.join()
    stop.set()
    reader.join()
    assert problems == []
    assert not [p for p in plan_cache.entry_path(key).parent.iterdir() if p.suffix == ".tmp"]


def test_turned_off_by_option_or_environment(cache, monkeypatch):
    inputs = block_inputs()
    c = eqfuse.compile(block, inputs, plan_cache=False)
    assert "plan_cache" not in c.report and "saturate" in c.report["seconds"]
    monkeypatch.setenv(plan_cache.ENV_SWITCH, "0")
    c = eqfuse.compile(block, inputs)
    assert "plan_cache" not in c.report
    assert not (cache / "plans").exists() or not list((cache / "plans").iterdir())


@pytest.mark.gpu
def test_a_hit_starts_no_compile_workers(cache, monkeypatch):
    """Starting the compile pool costs a process's first compile ~0.4 s: a hit whose
    kernels Triton has cached needs no worker, so the pool is started after a miss only."""
    from eqfuse.runtime import parallel_compile
    started = []
    real = parallel_compile.prestart
    monkeypatch.setattr(parallel_compile, "prestart", lambda: started.append(1) or real())
    x, w = torch.randn(64, 32, device="cuda"), torch.randn(32, 48, device="cuda")
    fn = lambda x, w: torch.relu(x @ w)  # noqa: E731
    first = eqfuse.compile(fn, (x, w), autotune=False)
    assert started and first.report["plan_cache"]["hit"] is False
    assert "stored" not in first.report["plan_cache"]  # on a GPU, once the first call has run the kernels
    first(x, w)
    assert first.report["plan_cache"]["stored"] is True
    started.clear()
    again = eqfuse.compile(fn, (x, w), autotune=False)
    assert again.report["plan_cache"]["hit"] is True and started == []
    assert_matches(again(x, w), fn(x, w), contraction=True)
