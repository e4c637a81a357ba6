"""Split reductions (eqfuse/codegen/split.py): a reduction with too few rows to fill the
GPU runs as two kernels, chunk partials then their sum and the kernel's epilogue.

The thresholds are lowered (``small_splits``) so that reductions of a few thousand
elements split on the CPU interpreter; the default thresholds are checked on plan
kernels built by hand at GPT-2's size, without running them."""

import json

import pytest
import torch
from conftest import assert_matches

import eqfuse
from eqfuse.codegen import configs, schedules, split
from eqfuse.schema.plan import Buffer, KernelSpec, Plan, PNode

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture
def small_splits(monkeypatch):
    """Split anything with 16 elements or more along its reduced axis, in chunks of 8 or more."""
    monkeypatch.setattr(split, "SPLIT_MIN_ELEMENTS", 1)
    monkeypatch.setattr(split, "SPLIT_MIN_CHUNK", 8)
    monkeypatch.delenv(split.ENV, raising=False)


@pytest.fixture
def three_chunks(small_splits, monkeypatch):
    """Every reduction that may split does, in three chunks (sizes too small to gain programs)."""
    monkeypatch.setattr(split, "FORCE_CHUNKS", 3)


def _launches(compiled) -> list[str]:
    """The kernels the generated ``call`` launches, in order."""
    body = compiled.source.split("\ndef call(")[1]
    return [line.strip().split("_launch(")[0] for line in body.splitlines() if "_launch(" in line]


def _split_pair(compiled):
    """(stage 1, stage 2) of a graph compiled to one split reduction."""
    first, second = compiled.kernels
    assert first.name == second.name + split.STAGE1_SUFFIX
    assert _launches(compiled) == [first.name, second.name]
    return first, second


def _column_sum(x):
    return x.sum(0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows, length", [(1, 1000), (17, 1000), (100, 1000), (1, 33), (17, 33), (100, 33)])
def test_column_sum_splits_and_matches_eager(three_chunks, rows, length, dtype):
    torch.manual_seed(0)
    x = torch.randn(length, rows, dtype=dtype)
    compiled = eqfuse.compile(_column_sum, [x])
    assert_matches(compiled(x), x.sum(0), contraction=True)
    first, second = _split_pair(compiled)
    chunks = second.schedule.cols
    assert chunks == 3 and first.schedule.rows == chunks * rows
    assert first.schedule.cols == -(-length // chunks)
    # the partials are float32 whatever the input, [S, rows, 1]
    (partials,) = [b for b in compiled.plan.buffers.values() if b.name.endswith(split.STAGE1_SUFFIX)]
    assert partials.dtype == "float32" and partials.shape == (chunks, rows, 1)
    if chunks * first.schedule.cols > length:  # padded: the chunks past the end read nothing
        assert "tl.where" in first.source


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_too_short_an_axis_is_not_split(three_chunks, dtype):
    x = torch.randn(1, 17, dtype=dtype)
    compiled = eqfuse.compile(_column_sum, [x])
    assert_matches(compiled(x), x.sum(0))
    assert len(compiled.kernels) == 1 and _launches(compiled) == [compiled.kernels[0].name]


def test_small_reductions_split_only_where_stage_1_gets_more_programs(small_splits):
    """Without forcing: [17, 33] fits one program whichever way it is cut; [17, 1000]
    (two programs of 16 columns) splits into chunks of at least 8 and more programs."""
    short, long = torch.randn(33, 17), torch.randn(1000, 17)
    assert len(eqfuse.compile(_column_sum, [short]).kernels) == 1
    compiled = eqfuse.compile(_column_sum, [long])
    assert_matches(compiled(long), long.sum(0), contraction=True)
    first, second = _split_pair(compiled)
    assert first.grid[0] > 2 and first.schedule.cols >= split.SPLIT_MIN_CHUNK


def _epilogue(x, y, b):
    return (x * y).sum(0) * 2 + b


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_epilogue_runs_after_the_partials(small_splits, dtype):
    torch.manual_seed(0)
    x, y = torch.randn(1000, 17, dtype=dtype), torch.randn(1000, 17, dtype=dtype)
    b = torch.randn(17, dtype=dtype)
    compiled = eqfuse.compile(_epilogue, [x, y, b])
    assert_matches(compiled(x, y, b), _epilogue(x, y, b), contraction=True)
    first, second = _split_pair(compiled)
    # stage 1 reads x and y, stage 2 the partials and b: the product before, the rest after
    assert {"in0", "in1"} <= set(first.params) and "in2" not in first.params
    assert "in2" in second.params and "in0" not in second.params


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mean_over_tokens_of_a_3d_tensor(small_splits, dtype):
    torch.manual_seed(0)
    x = torch.randn(4, 250, 24, dtype=dtype)

    def fn(t):
        return t.mean((0, 1))
    compiled = eqfuse.compile(fn, [x])
    assert_matches(compiled(x), fn(x))
    _split_pair(compiled)


def _bias_and_weight_grads(dy, x):
    return dy.sum(0), (dy * x).sum(0)


def test_two_sums_of_one_kernel_share_the_split(small_splits):
    """A LayerNorm backward's weight and bias gradients: one kernel, two reductions; each
    gets its partials, stage 1 writes both."""
    torch.manual_seed(0)
    dy, x = torch.randn(600, 40, dtype=torch.float16), torch.randn(600, 40, dtype=torch.float16)
    compiled = eqfuse.compile(_bias_and_weight_grads, [dy, x])
    assert_matches(compiled(dy, x), _bias_and_weight_grads(dy, x), contraction=True)
    first, second = _split_pair(compiled)
    assert first.source.count("tl.store(") == 2 and second.source.count("tl.sum(") == 2
    partials = [b for b in compiled.plan.buffers if b.endswith(split.STAGE1_SUFFIX)]
    assert len(partials) == 2


@pytest.mark.parametrize("op", ["amax", "amin"])
def test_max_and_min_split_with_their_own_padding(small_splits, op):
    torch.manual_seed(0)
    x = torch.randn(1001, 9) - 10 if op == "amax" else torch.randn(1001, 9) + 10  # padding 0 would win

    def fn(t):
        return getattr(t, op)(0)
    compiled = eqfuse.compile(fn, [x])
    assert_matches(compiled(x), fn(x))
    _split_pair(compiled)


def test_a_whole_tensor_sum_splits_along_its_rows(small_splits):
    """One row (a loss summed over everything): its reads run along the reduced axis, so
    stage 1 is a plain row reduction of one chunk per program."""
    torch.manual_seed(0)
    x = torch.randn(40, 50)

    def fn(t):
        return (t * t).sum()
    compiled = eqfuse.compile(fn, [x])
    assert_matches(compiled(x), fn(x), contraction=True)
    first, second = _split_pair(compiled)
    assert not first.schedule.columns and second.schedule.rows == 1


def test_kernels_that_store_full_size_outputs_or_nest_reductions_stay_whole(small_splits):
    torch.manual_seed(0)
    x = torch.randn(500, 12)

    def with_full_output(t):  # 12 rows of 500, and the 12 x 500 product stored in their order
        y = t.t() * 3
        return y, y.sum(1)

    def nested(t):
        return (t - t.amax(0)).exp().sum(0)
    for fn in (with_full_output, nested):
        compiled = eqfuse.compile(fn, [x])
        assert_matches(compiled(x), fn(x))
        assert not any(k.name.endswith(split.STAGE1_SUFFIX) for k in compiled.kernels), fn.__name__


def test_default_thresholds_leave_small_reductions_whole(monkeypatch):
    """The path without a split is the column reduction as it was: one kernel, one launch."""
    monkeypatch.delenv(split.ENV, raising=False)
    x = torch.randn(1000, 17)
    compiled = eqfuse.compile(_column_sum, [x])
    (kernel,) = compiled.kernels
    assert kernel.schedule.columns and kernel.grid == (2,) and "for c0 in range" in kernel.source
    assert _launches(compiled) == [kernel.name]
    assert not any(b.endswith(split.STAGE1_SUFFIX) for b in compiled.plan.buffers)


def test_environment_variable_turns_splitting_off(small_splits, monkeypatch):
    monkeypatch.setenv(split.ENV, "0")
    x = torch.randn(1000, 17)
    compiled = eqfuse.compile(_column_sum, [x])
    assert len(compiled.kernels) == 1
    assert_matches(compiled(x), x.sum(0), contraction=True)


# --- the choice of S, on plan kernels at GPT-2's size (no kernel is run) ---------------------

def _token_sum_spec(tokens=8192, features=768, dtype="float16"):
    """``dy.sum(0)`` of a [tokens, features] gradient, as extraction states it."""
    load = PNode("load", ("dy", (features, 1), 0), (), (tokens, features), dtype)
    cols = PNode("permute", ((1, 0),), (load,), (features, tokens), dtype)
    red = PNode("reduce", ("sum",), (cols,), (features, 1), dtype)
    root = PNode("reshape", (), (red,), (features,), dtype)
    buffers = {"dy": Buffer("dy", (tokens, features), dtype, "input"),
               "out": Buffer("out", (features,), dtype, "output")}
    return KernelSpec("k0_sum", [(root, "out")], ["sum"]), buffers


def test_gpt2_bias_gradient_gets_two_to_four_programs_per_sm():
    spec, buffers = _token_sum_spec()
    sched = schedules.schedule_of(spec)
    assert sched.columns and sched.grid(configs.default_config(sched)) == (48,)  # 16 rows a program
    first, second, partials = split.split_kernel(spec, buffers)
    s1, s2 = schedules.schedule_of(first), schedules.schedule_of(second)
    chunks = s2.cols
    assert 8192 % chunks == 0 and s1.rows == chunks * 768
    # Stage 1's reads still run along its rows (its row index crosses from one chunk to the
    # next at the middle, where the scheduler's probe looks), so it is tiled across them
    assert s1.columns
    programs = s1.grid(configs.default_config(s1))[0]
    sms = split.tma.sm_count()
    assert 2 * sms <= programs <= 4 * sms, (chunks, programs)
    assert [b.shape for b in partials] == [(chunks, 768, 1)]


def test_a_reduction_with_programs_enough_is_not_split():
    spec, buffers = _token_sum_spec(tokens=8192, features=768 * 32)  # 384 programs of 64 rows
    assert split.split_kernel(spec, buffers) is None


def test_splitting_a_plan_twice_changes_nothing():
    spec, buffers = _token_sum_spec()
    plan = Plan([buffers["dy"]], dict(buffers), [spec], [("buffer", "out")])
    split.split_reductions(plan)
    once = [(k.name, [b for _, b in k.roots]) for k in plan.kernels]
    assert len(once) == 2
    split.split_reductions(plan)
    assert [(k.name, [b for _, b in k.roots]) for k in plan.kernels] == once


def test_export_lists_both_stages_with_their_grids(small_splits, tmp_path):
    from eqfuse.export import evaluate_grid_formula, export_graph
    x = torch.randn(1000, 17, dtype=torch.float16)
    compiled = eqfuse.compile(_column_sum, [x], autotune=False)
    arch = "sm_90"
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        arch = f"sm_{major}{minor}"
    manifest = json.loads(export_graph(compiled, tmp_path, arch=arch).read_text())
    first, second = manifest["kernels"]
    assert [first["name"], second["name"]] == [k.name for k in compiled.kernels]
    for record, info in zip((first, second), compiled.kernels):
        assert record["grid"][0] == info.grid[0]
        assert list(evaluate_grid_formula(record["grid_formula"], record["grid_sizes"])) == list(info.grid)
    partials = [b for b in manifest["buffers"] if b["name"].endswith(split.STAGE1_SUFFIX)]
    assert [p["dtype"] for p in partials] == ["float32"]
    if torch.cuda.is_available():
        from eqfuse.runtime import load_exported
        assert_matches(load_exported(tmp_path)(x), x.sum(0), contraction=True)


def test_a_full_size_output_across_the_rows_is_stored_by_its_own_kernel():
    """``y = t * 3; y.sum(0)`` over [tokens, features]: the reduction's rows are the
    features, and y, in token order, would be stored through its flat index unravelled
    per element (codegen/kernel.py schedule_of): y gets a pointwise kernel, the sum reads
    it, and both match eager."""
    def with_full_output(t):
        y = t * 3
        return y, y.sum(0)
    x = torch.randn(500, 12)
    compiled = eqfuse.compile(with_full_output, [x])
    assert_matches(compiled(x), with_full_output(x))
    kinds = [k.schedule.kind for k in compiled.kernels]
    assert kinds[0] == "pointwise" and set(kinds[1:]) == {"reduction"}, kinds
