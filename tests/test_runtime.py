"""The runtime: cache behaviour, report, explain, cost model."""

import multiprocessing
import os
import re

import pytest
import torch
from conftest import DEVICE, assert_matches, sorted_along

import eqfuse
from eqfuse.examples import EXAMPLES, residual_layernorm, rmsnorm
from eqfuse.rewrite.cost import Device, band_pairs, kernel_bytes, kernel_time_us
from eqfuse.runtime import cache


def test_report_and_explain():
    x, w = torch.randn(4, 8), torch.rand(8)
    c = eqfuse.compile(rmsnorm, (x, w))
    rep = c.report
    sat = rep["saturation"]
    assert sat["stop_reason"] == "saturated"
    assert sat["iterations"] > 0 and sat["enodes"] > 0 and sat["eclasses"] > 0
    assert sat["rules_fired"]["fuse-load-kernel"] > 0
    assert rep["extraction"]["plan_cost_us"] < rep["extraction"]["unfused_cost_us"]
    assert set(rep["seconds"]) >= {"capture", "translate", "saturate", "extract", "codegen", "load", "total"}
    text = c.explain()
    assert "1 kernel(s)" in text and "whole row in registers" in text and "pow_1" in text
    # where the build's time went, each phase named with its seconds
    line = next(ln for ln in text.splitlines() if "compile time:" in ln)
    assert re.search(rf"compile time: {rep['seconds']['total']:.2f} s \(capture [0-9.]+, ", line), line


def test_generated_module_is_cached_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("EQFUSE_CACHE_DIR", str(tmp_path))
    x, w = torch.randn(4, 8), torch.rand(8)
    compiled = eqfuse.compile(rmsnorm, (x, w), autotune=False)
    # (on a GPU the trial launches that check each config write modules of their own)
    cached = [f.read_text() for f in tmp_path.glob("eqfuse_*.py")]
    assert compiled.source in cached and "@triton.jit" in compiled.source


def test_corrupt_cache_entry_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("EQFUSE_CACHE_DIR", str(tmp_path))
    key, source = "corrupt_test", "X = 1\n"
    (tmp_path / f"eqfuse_{key}.py").write_text("this is not python (")
    module = cache.load_module(key, source, interpret=True)
    assert module.X == 1


def _write_many(args):
    root, i = args
    os.environ["EQFUSE_CACHE_DIR"] = root
    for _ in range(50):
        cache.write_atomic(cache.cache_dir() / "shared.py", f"VALUE = {i}\n" * 200)
    return True


def test_two_processes_writing_at_once_leave_a_whole_file(tmp_path):
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        assert all(pool.map(_write_many, [(str(tmp_path), 1), (str(tmp_path), 2)]))
    lines = (tmp_path / "shared.py").read_text().splitlines()
    assert len(lines) == 200 and len(set(lines)) == 1
    assert not list(tmp_path.glob("*.tmp"))


def test_cost_model_counts_a_broadcast_read_once():
    x, w = torch.randn(64, 256), torch.rand(256)
    c = eqfuse.compile(rmsnorm, (x, w))
    (k,) = c.kernels
    # x read once, w read once (not per row), out written once: 4 bytes each
    assert kernel_bytes(k.spec, c.plan.buffers) == (64 * 256 * 2 + 256) * 4
    fast, slow = Device(bandwidth_bytes_per_us=1e6), Device(bandwidth_bytes_per_us=1e3)
    assert kernel_time_us(k.spec, c.plan.buffers, slow) > kernel_time_us(k.spec, c.plan.buffers, fast)


@pytest.mark.parametrize("scale_keys", [False, True])
def test_an_attention_kernel_reads_its_keys_and_values_as_stored(scale_keys):
    """k * g (g a tensor) would be computed in the key loop, once per query tile: a kernel
    of its own stores it, and the attention kernel reads it; a constant scale on k joins
    the scores' scale instead."""
    def gained_keys(q, k, v, g):
        keys = k * 0.5 if scale_keys else k * g
        return torch.softmax(q @ keys.transpose(-1, -2), -1) @ v

    q, k, v = (torch.randn(1, 2, 300, 16) for _ in range(3))
    g = torch.rand(300, 1)
    c = eqfuse.compile(gained_keys, (q, k, v, g))
    kinds = [kernel.schedule.kind for kernel in c.kernels]
    assert kinds == (["attention"] if scale_keys else ["pointwise", "attention"]), c.explain()
    assert_matches(c(q, k, v, g), gained_keys(q, k, v, g), contraction=True)


@pytest.mark.parametrize("m, n, lo, hi", [(7, 7, -6, 0), (5, 9, -4, 4), (9, 5, -8, 0), (12, 10, -3, 2),
                                          (6, 6, -20, 20), (8, 3, 2, 5), (4, 4, 5, 9)])
def test_band_pairs_counts_the_pairs_a_mask_leaves(m, n, lo, hi):
    assert band_pairs(m, n, lo, hi) == sum(lo <= j - i <= hi for i in range(m) for j in range(n))


def test_multi_output_kernel_stores_the_residual():
    inputs = EXAMPLES["residual_layernorm"].make_inputs(4, 32, torch.float32, DEVICE)
    c = eqfuse.compile(residual_layernorm, inputs)
    (k,) = c.kernels
    assert len(k.spec.roots) == 2 and k.source.count("tl.store(") == 2


def test_validation_rejects_a_plan_that_computes_something_else():
    from eqfuse.frontend.capture import capture
    from eqfuse.rewrite.validate import mismatch
    from eqfuse.runtime.compiled import make_fallback_runner
    x, w = torch.randn(4, 8), torch.rand(8)
    c = eqfuse.compile(rmsnorm, (x, w))
    captured = capture(rmsnorm, (x, w))
    assert mismatch(c.plan, captured, make_fallback_runner) is None
    (k,) = c.plan.kernels
    node = next(n for n in k.walk() if n.op == "binary" and n.attrs == ("mul",))
    node.attrs = ("add",)  # what a mixed-up e-node would do
    assert mismatch(c.plan, captured, make_fallback_runner).startswith("output 0 (mul_1 = mul.Tensor): ")


def test_graphs_sharing_generated_source_keep_their_own_eager_steps():
    f0 = lambda x: sorted_along(x, 0) * 2
    f1 = lambda x: sorted_along(x, 1) * 2
    x = torch.randn(6, 6)
    c0, c1 = eqfuse.compile(f0, (x,)), eqfuse.compile(f1, (x,))
    assert c0.source == c1.source  # one module on disk and in memory for both
    torch.testing.assert_close(c0(x), f0(x))
    torch.testing.assert_close(c1(x), f1(x))


@pytest.mark.parametrize("view", ["transposed", "transposed twice", "a column"])
def test_a_view_of_an_eager_steps_result_is_no_copy(view):
    """A view of an eager step's result (laid out densely in eager) folds into the step's
    buffer, as a view of an input does: no kernel copies it (Mixtral's weight gradients,
    _grouped_mm's results transposed twice, were gigabyte copies), and the output is
    eager's view, values and strides."""
    fn = {"transposed": lambda x: sorted_along(x, 0).t(), "transposed twice": lambda x: sorted_along(x, 0).t().t(),
          "a column": lambda x: sorted_along(x, 0)[:, 3]}[view]
    x = torch.randn(6, 8)
    c = eqfuse.compile(fn, (x,))
    assert not c.kernels and len(c.fallbacks) == 1, c.explain()
    got, want = c(x), fn(x)
    assert torch.equal(got, want) and got.stride() == want.stride()


def test_an_eager_steps_argument_is_written_in_eager_s_layout(monkeypatch):
    """A computed argument that eager laid out otherwise than contiguously (a transpose)
    is written by its kernel in that layout: the step takes the buffer as it is, where it
    took a copy in eager's layout (6 copies of 0.6 ms in Mixtral's training step)."""
    from eqfuse.schema import from_fx
    copies = []
    relayout = from_fx._relayout
    monkeypatch.setattr(from_fx, "_relayout", lambda x, layout: (copies.append(x) if isinstance(x, torch.Tensor)
                                                                  else None) or relayout(x, layout))
    fn = lambda x: sorted_along((x * 2).t(), 1)
    x = torch.randn(6, 8)
    c = eqfuse.compile(fn, (x,))
    assert len(c.kernels) == 1 and len(c.fallbacks) == 1, c.explain()
    copies.clear()
    got = c(x)
    assert torch.equal(got, fn(x))
    # the step is handed (x * 2).t() with eager's strides, which it takes as it is
    assert [t.stride() for t in copies] == [(1, 8)], [t.stride() for t in copies]


def test_an_eager_steps_argument_viewing_a_computed_value_is_that_view_of_its_buffer():
    """A transpose of a computed value handed to one eager step, the value itself to
    another (Mixtral's backward, each to a ``_grouped_mm``): one buffer, which the first
    step gets viewed as eager has it, not a second buffer of the same bytes."""
    def fn(x):
        y = x * 2
        return sorted_along(y.t(), 1), sorted_along(y[1:], 0)
    x = torch.randn(6, 8)
    c = eqfuse.compile(fn, (x,))
    assert len(c.kernels) == 1 and c.kernels[0].source.count("tl.store(") == 1, c.kernels[0].source
    for got, want in zip(c(x), fn(x)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("name,rows,cols", [("softmax", 3, 1000), ("rmsnorm", 5, 16), ("residual_layernorm", 7, 24),
                                            ("swiglu", 3, 100)])
def test_every_autotune_candidate_is_correct(name, rows, cols):
    """The autotuner may pick any candidate: each must compute the same function."""
    from conftest import DEVICE, assert_matches

    from eqfuse.codegen.configs import tuning_candidates
    from eqfuse.codegen.module import generate_module
    ex = EXAMPLES[name]
    inputs = ex.make_inputs(rows, cols, torch.float32, DEVICE)
    c = eqfuse.compile(ex.fn, inputs, autotune=False)
    (k,) = c.kernels
    expected = ex.fn(*inputs)
    for cfg in tuning_candidates(k.schedule):
        source, _ = generate_module(c.plan, name, "test", {k.name: cfg})
        module = cache.load_module(cache.cache_key(source, DEVICE), source, interpret=DEVICE == "cpu")
        got = module.call(inputs[0].device, [], *inputs)
        assert_matches(got if isinstance(expected, tuple) else got[0], expected)


def test_float32_to_bfloat16_rounds_to_nearest_even_as_torch():
    """The interpreter's cast truncated (interpreter_fixes.py): every float32 -> bfloat16
    cast in a kernel must give torch's bits, ties and NaN included."""
    base = torch.randn(256).to(torch.bfloat16).float()
    ulp_bits = torch.tensor([0x0, 0x7FFF, 0x8000, 0x8001, 0xC000, 0x4000], dtype=torch.int32)
    x = (base.view(torch.int32)[:, None] + ulp_bits[None, :]).view(torch.float32).flatten()
    x = torch.cat([x, torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0])])

    def fn(x):
        return (x * 2.0).to(torch.bfloat16)
    got = eqfuse.compile(fn, (x.to(DEVICE),))(x.to(DEVICE)).cpu()
    ref = fn(x).cpu()
    assert torch.equal(got.isnan(), ref.isnan())
    finite = ~ref.isnan()
    assert torch.equal(got[finite].view(torch.int16), ref[finite].view(torch.int16))


def test_bfloat16_denormals_round_trip_as_torch():
    """A bfloat16 denormal widened to float32 in a kernel keeps its value (the interpreter
    renormalised it out of range: -3.03e-39 came back -3.67e-40; interpreter_fixes.py)."""
    x = torch.tensor([-3e-39, 1.5e-39, -1e-40, 5e-41, 9.2e-41, -2.5, 0.0, -0.0, float("inf")])

    def fn(x):
        return x.to(torch.bfloat16).float() * 1.5
    got = eqfuse.compile(fn, (x.to(DEVICE),))(x.to(DEVICE)).cpu()
    assert torch.equal(got.view(torch.int32), fn(x).view(torch.int32))


def test_graph_compiled_on_another_thread_is_freed_cleanly(monkeypatch):
    """The autograd engine compiles backward graphs on its own thread; egglog's e-graph may
    only be dropped on the thread that made it, so eqfuse drops it there (not the collector
    on whichever thread it later runs)."""
    import gc
    import sys
    import threading
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    inputs = (torch.randn(8, 32, device=DEVICE), torch.ones(32, device=DEVICE))
    compiled = []
    worker = threading.Thread(target=lambda: compiled.append(eqfuse.compile(rmsnorm, inputs)))
    worker.start()
    worker.join()
    assert compiled and compiled[0].kernels
    gc.collect()
    assert not unraisable, [str(u.exc_value) for u in unraisable]


@pytest.mark.parametrize("value, on", [("0", False), ("false", False), ("Off", False), (" no ", False),
                                       ("1", True), ("yes", True), ("", True)])
def test_every_switch_reads_its_variable_alike(monkeypatch, value, on):
    from eqfuse.codegen import kmajor, split, splitk
    from eqfuse.runtime import parallel_compile, plan_cache

    switches = {"EQFUSE_SPLIT_K": splitk.enabled, "EQFUSE_SPLIT_REDUCTIONS": split.enabled,
                "EQFUSE_KMAJOR": kmajor.enabled, "EQFUSE_PLAN_CACHE": plan_cache.enabled,
                "EQFUSE_PARALLEL_COMPILE": parallel_compile.enabled}
    for env, enabled in switches.items():
        monkeypatch.setenv(env, value)
        assert enabled() is on, env


def test_an_unusable_cache_directory_compiles_uncached(tmp_path, monkeypatch, caplog):
    """A cache path that cannot be made (a file where a directory should be): a temporary
    directory stands in, with a warning, and the graph compiles to kernels."""
    import logging

    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("EQFUSE_CACHE_DIR", str(blocker / "cache"))
    monkeypatch.setattr(cache, "_STAND_INS", {})
    x = torch.randn(8, 16)
    fn = lambda x: torch.relu(x) * 2  # noqa: E731
    with caplog.at_level(logging.WARNING, logger="eqfuse"):
        compiled = eqfuse.compile(fn, (x,))
    assert compiled.kernels and not compiled.fallbacks, compiled.explain()
    assert_matches(compiled(x), fn(x))
    assert "cache directory" in caplog.text and "uncached across runs" in caplog.text
    assert cache.cache_dir() == cache._STAND_INS[str(blocker / "cache")] != blocker / "cache"


@pytest.mark.parametrize("written", [True, False])
def test_a_module_whose_file_goes_away_still_runs(tmp_path, monkeypatch, written):
    """The cache directory emptied (or the write failing) between writing a generated
    module and running its kernels: the module runs from its source in memory, and the
    interpreter, which reads each kernel's source at launch, finds it there."""
    monkeypatch.setenv("EQFUSE_CACHE_DIR", str(tmp_path))
    write = cache.write_atomic

    def write_then_lose(path, data):
        if not str(path).endswith(".py"):
            return write(path, data)
        if not written:
            raise FileNotFoundError(f"no such directory: {path.parent}")
        write(path, data)
        path.unlink()
    monkeypatch.setattr(cache, "write_atomic", write_then_lose)
    x = torch.randn(8, 24)
    fn = lambda x: (x * 3).exp().sum(-1) + x.amax(-1)  # noqa: E731
    compiled = eqfuse.compile(fn, (x,), plan_cache=False)
    assert compiled.kernels and not compiled.fallbacks, compiled.explain()
    assert_matches(compiled(x), fn(x))
    assert not list(tmp_path.glob("eqfuse_*.py"))


def test_variants_past_the_limit_run_in_eager_and_explain_counts_them(monkeypatch):
    """A caller feeding ever new shapes compiles MAX_VARIANTS of them; the others run in
    eager, still right, and explain() says how many signatures the graph holds."""
    from eqfuse.runtime import compiled as compiled_module
    monkeypatch.setattr(compiled_module, "MAX_VARIANTS", 2)
    f = lambda x: torch.relu(x) * 2  # noqa: E731
    c = eqfuse.compile(f, (torch.randn(3),))
    for n in (4, 5, 6):
        x = torch.randn(n)
        assert_matches(c(x), f(x))
    kinds = [type(v).__name__ for v in c._variants.values()]
    assert kinds == ["_Variant", "_Variant", "_EagerVariant", "_EagerVariant"], kinds
    assert "other input signatures: 3 (the plan above is the example inputs'; 1 compiled, 2 in eager" in c.explain()



def test_the_command_line_says_its_version_and_its_packages(capsys):
    from eqfuse.cli import main
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"eqfuse {eqfuse.__version__} (torch {torch.__version__.split('+')[0]}") and "triton" in out


def test_a_function_that_does_not_trace_is_one_line_from_the_command_line(tmp_path, capsys):
    from eqfuse.cli import main
    path = tmp_path / "branchy.py"
    path.write_text("def f(x):\n    return x * 2 if x.sum() > 0 else x\n")
    assert main(["show", f"{path}:f"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("eqfuse show: error: could not trace the function") and err.count("\n") == 1, err


def test_show_takes_the_files_own_example_inputs(tmp_path, capsys):
    """An MLP with weights of other shapes and integer token ids: the file says its inputs."""
    from eqfuse.cli import main
    path = tmp_path / "mlp.py"
    path.write_text("import torch\n"
                    "def mlp(ids, table, w1, w2):\n"
                    "    x = table[ids].float()\n"
                    "    return torch.relu(x @ w1) @ w2\n"
                    "def example_inputs():\n"
                    "    return (torch.randint(0, 10, (2, 3)), torch.randn(10, 8),\n"
                    "            torch.randn(8, 16), torch.randn(16, 4))\n")
    assert main(["show", f"{path}:mlp"]) == 0
    out = capsys.readouterr().out
    assert "eqfuse plan for mlp" in out and "kernel" in out


def test_show_takes_inputs_from_the_command_line(tmp_path, capsys):
    """``--inputs`` names each input's dtype and sizes (integers below a bound): a
    three-input MLP reading a bf16 table by integer ids compiles; a bad spec is one line
    naming what it could not read."""
    from eqfuse.cli import main, parse_inputs
    ids, table, w = parse_inputs("ids: i64[2, 3] < 10, table: bf16[10, 8], w: f32[8, 16]")
    assert (ids.dtype, tuple(ids.shape), int(ids.max()) < 10) == (torch.int64, (2, 3), True)
    assert (table.dtype, tuple(table.shape), w.dtype, tuple(w.shape)) == (torch.bfloat16, (10, 8), torch.float32,
                                                                          (8, 16))
    assert parse_inputs("bool[4], f16[]")[1].shape == ()
    path = tmp_path / "mlp.py"
    path.write_text("import torch\n"
                    "def mlp(ids, table, w):\n"
                    "    return torch.relu(table[ids].float() @ w)\n")
    assert main(["show", f"{path}:mlp", "--inputs", "ids: i64[2, 3] < 10, table: bf16[10, 8], w: f32[8, 16]"]) == 0
    out = capsys.readouterr().out
    assert "eqfuse plan for mlp: 1 kernel(s), 0 eager fallback(s)" in out
    for spec, why in (("ids: q64[2]", "unknown dtype 'q64'"), ("ids: i64[2", "cannot read 'ids: i64[2'")):
        with pytest.raises(SystemExit, match=re.escape(why)):
            parse_inputs(spec)


def test_a_debug_directory_holds_each_compiled_graph(tmp_path, monkeypatch):
    """``EQFUSE_DEBUG_DIR``: per graph its FX code, the plan in words, the generated
    module and the build's figures; through the backend, one directory a graph."""
    import json

    from eqfuse.runtime import debug_dir

    monkeypatch.setenv(debug_dir.ENV, str(tmp_path))
    torch._dynamo.reset()
    f = torch.compile(lambda x: torch.relu(x) * 2, backend="eqfuse")
    f(torch.randn(8, 16))
    torch._dynamo.reset()
    (where,) = tmp_path.iterdir()
    assert "relu" in (where / "graph.py").read_text()
    assert (where / "explain.txt").read_text().startswith("eqfuse plan for inference: 1 kernel(s)")
    assert "@triton.jit" in (where / "kernels.py").read_text()
    assert json.loads((where / "report.json").read_text())["seconds"]["total"] > 0


def test_an_unwritable_debug_directory_is_a_warning_not_a_failed_compile(tmp_path, monkeypatch, caplog):
    from eqfuse.runtime import debug_dir

    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(debug_dir.ENV, str(blocker / "below"))
    x = torch.randn(4, 8)
    c = eqfuse.compile(lambda x: x.sin() + 1, (x,))
    torch.testing.assert_close(c(x), x.sin() + 1)
    assert "cannot write" in caplog.text
