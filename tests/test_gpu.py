"""The examples on a CUDA GPU at realistic widths (skipped without CUDA)."""

import os
import subprocess
import sys

import pytest
import torch
from conftest import assert_matches

import eqfuse
from eqfuse.examples import EXAMPLES

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("cols", [1536, 1000, 20000])
@pytest.mark.parametrize("name", list(EXAMPLES))
def test_example_on_gpu(name, cols, dtype):
    ex = EXAMPLES[name]
    torch.manual_seed(0)
    inputs = ex.make_inputs(64, cols if name != "causal_softmax" else 300, dtype, "cuda")
    compiled = eqfuse.compile(ex.fn, inputs, autotune=False)
    assert_matches(compiled(*inputs), ex.fn(*inputs))
    if cols <= 16384:  # wider rows are looped: the cost model may then store a shared value
        assert len(compiled.kernels) == ex.kernels


def _matmul_with_impossible_first_choice(monkeypatch, also_rest: bool, huge=None):
    """The tile model's first choice (and, with ``also_rest``, every choice) needs more
    shared memory than any GPU has: Triton refuses it only when it compiles."""
    from eqfuse.codegen import tiles
    huge = huge or {"BLOCK_M": 256, "BLOCK_N": 256, "BLOCK_K": 512, "GROUP_M": 8, "num_warps": 8, "num_stages": 4}
    real = tiles.ranked
    monkeypatch.setattr(tiles, "ranked", lambda sched, *a: [huge] + ([] if also_rest else real(sched, *a)))
    # On Hopper the autotuner also times the matmul templates, which would run in its place
    monkeypatch.setenv("EQFUSE_PINGPONG", "0")
    x = torch.randn(256, 512, device="cuda", dtype=torch.float16)
    w = torch.randn(512, 256, device="cuda", dtype=torch.float16)
    fn = lambda x, w: torch.relu(x @ w)  # noqa: E731
    return fn, (x, w), huge


def test_untimed_build_skips_a_config_that_does_not_compile(monkeypatch):
    fn, inputs, huge = _matmul_with_impossible_first_choice(monkeypatch, also_rest=False)
    compiled = eqfuse.compile(fn, inputs, autotune=False)
    assert_matches(compiled(*inputs), fn(*inputs), contraction=True)
    (k,) = compiled.kernels
    assert k.constexprs["BLOCK_K"] != huge["BLOCK_K"]
    assert not compiled.fallbacks


def test_kernel_without_a_runnable_config_runs_in_eager_with_the_reason(monkeypatch):
    fn, inputs, _ = _matmul_with_impossible_first_choice(monkeypatch, also_rest=True)
    compiled = eqfuse.compile(fn, inputs, autotune=False)
    assert_matches(compiled(*inputs), fn(*inputs), contraction=True)
    (fallback,) = compiled.fallbacks
    assert "runs with none of its 2 configurations" in fallback.reason  # the tile, then with one stage
    assert "OutOfResources" in fallback.reason


@pytest.mark.parametrize("autotune", [False, True])
def test_a_tile_short_of_shared_memory_runs_with_one_stage(monkeypatch, fresh_caches, autotune):
    """512 KB staged over four stages, 128 KB with one: the last resort runs (fresh caches:
    the choice a timed build stores would serve the tests above)."""
    tile = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 256, "GROUP_M": 8, "num_warps": 8, "num_stages": 4}
    fn, inputs, _ = _matmul_with_impossible_first_choice(monkeypatch, also_rest=True, huge=tile)
    compiled = eqfuse.compile(fn, inputs, autotune=autotune)
    assert_matches(compiled(*inputs), fn(*inputs), contraction=True)
    (k,) = compiled.kernels
    assert not compiled.fallbacks and k.launch["num_stages"] == 1 and k.constexprs["BLOCK_K"] == 256


# --- parallel kernel compilation (eqfuse/runtime/parallel_compile.py) ---------------------------

def gelu_mlp_softmax(x, w1, w2):
    h = torch.nn.functional.gelu(x @ w1)
    return torch.softmax((h @ w2).float(), -1).to(x.dtype), h.sum(0)


def _mlp_inputs(rows):
    """Rows differ from test to test: a module loaded before (same source) would reuse its
    kernels from memory and compile nothing."""
    torch.manual_seed(0)
    return (torch.randn(rows, 256, device="cuda", dtype=torch.float16),
            torch.randn(256, 192, device="cuda", dtype=torch.float16) / 16,
            torch.randn(192, 160, device="cuda", dtype=torch.float16) / 16)


@pytest.fixture
def fresh_caches(monkeypatch, tmp_path):
    """Empty Triton and eqfuse caches (autotuning choices included): every kernel compiles."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setenv("EQFUSE_CACHE_DIR", str(tmp_path / "eqfuse"))


@pytest.fixture
def jit_compiles():
    """The kernels this process's Triton compiles (cache misses) during the test: with the
    pool, none, since the JIT must find each one compiled under the key it computes."""
    from triton import knobs
    misses = []

    def listen(src, metadata, metadata_group, times, cache_hit):
        if not cache_hit:
            misses.append(src.name)
    old, knobs.compilation.listener = knobs.compilation.listener, listen
    yield misses
    knobs.compilation.listener = old


def test_pool_compiles_every_kernel_before_its_first_launch(fresh_caches, jit_compiles):
    """Timed: every candidate compiles in the pool, then the final module's kernels (the
    winners, in a module of another text) before their first launch."""
    inputs = _mlp_inputs(98)
    compiled = eqfuse.compile(gelu_mlp_softmax, inputs, autotune=True, cuda_graphs=False)
    assert_matches(compiled(*inputs), gelu_mlp_softmax(*inputs), contraction=True)
    assert jit_compiles == []  # candidates, the final module, and the call: all loaded from the cache
    cand, final = compiled.report["compile"]["candidates"], compiled.report["compile"]["module"]
    assert cand["compiled_in_pool"] == cand["kernels"] > len(compiled.kernels) >= 2, cand
    assert final["kernels"] == len(compiled.kernels), final
    assert compiled.report["seconds"]["compile"] > 0
    assert "note" not in compiled.report


def in_pool(outcome: dict) -> int:
    """Kernels the pool compiled before the first call, and those it compiles on in the background."""
    return outcome["compiled_in_pool"] + len(outcome.get("compiling_in_background", []))


def test_untimed_build_returns_while_its_kernels_compile(fresh_caches, jit_compiles):
    """Untimed: the build returns with the module's kernels compiling in the pool
    (pipeline._start_kernels); the first call waits for them, launches each once, runs."""
    inputs = _mlp_inputs(97)
    compiled = eqfuse.compile(gelu_mlp_softmax, inputs, autotune=False, cuda_graphs=False)
    assert "compile" not in compiled.report and "compile" not in compiled.report["seconds"]
    assert_matches(compiled(*inputs), gelu_mlp_softmax(*inputs), contraction=True)
    assert jit_compiles == []  # the launch check and the call: all loaded from the cache
    final = compiled.report["compile"]["module"]
    # gelu's product may take the ping-pong template, which compiles on in the background
    # while its portable twin (one more kernel for the pool) runs (parallel_compile._deferrable)
    assert in_pool(final) == final["kernels"] >= len(compiled.kernels) >= 2, final
    assert compiled.report["seconds"]["compile"] > 0 and "first_call_wait" in compiled.report["seconds"]
    assert "note" not in compiled.report
    assert_matches(compiled(*inputs), gelu_mlp_softmax(*inputs), contraction=True)  # the later path


def test_without_the_pool_kernels_compile_at_their_first_launch(fresh_caches, jit_compiles):
    """The control of the test above: the listener does see the JIT's compiles."""
    inputs = _mlp_inputs(99)
    compiled = eqfuse.compile(gelu_mlp_softmax, inputs, autotune=False, cuda_graphs=False, parallel_compile=False)
    assert_matches(compiled(*inputs), gelu_mlp_softmax(*inputs), contraction=True)
    assert sorted(jit_compiles) == sorted(k.name for k in compiled.kernels)
    assert "compile" not in compiled.report


def test_the_flash_template_compiles_in_the_background_while_its_twin_runs(fresh_caches, monkeypatch):
    """The flash template takes seconds to compile: the first call runs the portable
    attention kernel, no CUDA graph is recorded meanwhile (it would replay the twin for
    good), and once the template is compiled the calls run it and record, and the plan
    cache entry is stored."""
    import time

    from eqfuse.codegen import flash
    from eqfuse.examples import ATTENTION_EXAMPLES

    if not flash.device_supports():
        pytest.skip("the flash template needs a Hopper GPU")
    monkeypatch.setenv("EQFUSE_PLAN_CACHE", "1")
    ex = ATTENTION_EXAMPLES["causal_attention"]
    torch.manual_seed(0)
    q, k, v = ex.make_inputs(2, 4, 384, 128, torch.float16, "cuda")
    compiled = eqfuse.compile(ex.fn, (q, k, v), autotune=False)
    for _ in range(3):
        assert_matches(compiled(q, k, v), ex.fn(q, k, v))
    (template,) = [x for name, x in vars(compiled._main.module).items()
                   if name.endswith("_launch") and getattr(x.fn, "is_gluon", lambda: False)()]
    assert compiled.report["compile"]["module"]["compiling_in_background"], compiled.report["compile"]
    assert template.deferred and compiled._main.graphs.replays == 0
    # The plan cache keeps only configurations that ran: not this build's
    assert compiled.report["plan_cache"]["stored"] is False, compiled.report["plan_cache"]
    deadline = time.monotonic() + 120
    while template.deferred and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not template.deferred
    for _ in range(3):
        assert_matches(compiled(q, k, v), ex.fn(q, k, v))
    assert template._compiled and compiled._main.graphs.replays > 0
    # Once the template has run, the entry is stored: the next build finds it
    assert compiled.report["plan_cache"]["stored"] is True, compiled.report["plan_cache"]
    again = eqfuse.compile(ex.fn, (q, k, v), autotune=False)
    assert again.report["plan_cache"]["hit"] and again.source == compiled.source


def test_the_driver_module_is_built_ahead_into_the_cache(tmp_path):
    """parallel_compile.ready_triton_ahead: a child builds Triton's CUDA driver module into
    this process's cache (in a fresh process: the test's own has made its driver)."""
    script = ("import sys, glob; from triton import knobs; knobs.cache.dir = sys.argv[1]; "
              "from eqfuse.runtime import parallel_compile as pc; pc.ready_triton_ahead(); "
              "print(pc._driver_child.wait(120), len(glob.glob(sys.argv[1] + '/*/cuda_utils*')))")
    env = dict(os.environ, EQFUSE_COMPILE_WORKERS="2")
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.stdout.split() == ["0", "1"], out.stderr[-2000:]


def test_pool_keys_as_the_jit_after_the_ptxas_path_changed(fresh_caches, jit_compiles, monkeypatch, tmp_path):
    """Inductor sets TRITON_PTXAS_PATH to torch's ptxas after this process's Triton has
    read the version of its own: workers started afterwards must still key kernels by that
    version (models benchmark, torch.compile then eqfuse: every kernel compiled twice)."""
    from test_parallel_compile import _standin_ptxas
    from triton.backends.nvidia import compiler as nvidia

    from eqfuse.runtime import parallel_compile as pc
    nvidia.get_ptxas_version(pc.current_target()[1])  # read, as the JIT did
    standin, _ = _standin_ptxas(tmp_path)
    monkeypatch.setenv("TRITON_PTXAS_PATH", standin)
    pc.shutdown()  # workers start with the new path
    try:
        inputs = _mlp_inputs(103)
        compiled = eqfuse.compile(gelu_mlp_softmax, inputs, autotune=False, cuda_graphs=False)
        assert_matches(compiled(*inputs), gelu_mlp_softmax(*inputs), contraction=True)
        pool = compiled.report["compile"]["module"]
        assert in_pool(pool) == pool["kernels"] >= 2 and "failed" not in pool, pool
        assert jit_compiles == []
    finally:
        pc.shutdown()


def test_a_pool_that_fails_leaves_kernels_to_the_first_launch(fresh_caches, jit_compiles, monkeypatch):
    import sys

    from eqfuse.runtime import parallel_compile as pc
    pc.shutdown()  # the next pool starts workers that exit at once
    monkeypatch.setattr(pc, "_worker_command", lambda: [sys.executable, "-c", "raise SystemExit(5)"])
    try:
        inputs = _mlp_inputs(101)
        compiled = eqfuse.compile(gelu_mlp_softmax, inputs, autotune=False, cuda_graphs=False)
        assert_matches(compiled(*inputs), gelu_mlp_softmax(*inputs), contraction=True)
        assert "compile pool failed, kernels compile serially at first launch" in compiled.report["note"]
        assert "exit code 5" in compiled.report["note"]
        assert sorted(jit_compiles) == sorted(k.name for k in compiled.kernels)
        assert not compiled.fallbacks
    finally:
        pc.shutdown()  # later tests start a working pool


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_product_over_a_concatenation_on_gpu(dtype):
    """GPT-2's cat(dq, dk, dv) @ W^T at a realistic width: one kernel whose K loop picks
    each part's buffer by address per step (compiled for real, not interpreted)."""
    def f(q, k, v, w):
        return torch.cat([q, k, v], -1).reshape(-1, 3 * q.shape[-1]) @ w.t()
    torch.manual_seed(0)
    q, k, v = (torch.randn(4, 256, 768, device="cuda", dtype=dtype) for _ in range(3))
    w = torch.randn(768, 2304, device="cuda", dtype=dtype) / 48
    compiled = eqfuse.compile(f, (q, k, v, w), autotune=False)
    assert_matches(compiled(q, k, v, w), f(q, k, v, w), contraction=True)
    (kernel,) = compiled.kernels
    assert kernel.schedule.summed and "part_a = " in kernel.source
