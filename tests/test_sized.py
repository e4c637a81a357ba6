"""Sized modules (codegen/sized.py): one module for every size of a dynamic dimension."""

import pytest
import torch

import eqfuse.backend
from eqfuse.codegen import schedules
from eqfuse.codegen.module import generate_module
from eqfuse.codegen.sized import NotSized, _merged, far_size, per_size, sized_module
from eqfuse.models import LlamaLayer
from eqfuse.pipeline import plan_only
from eqfuse.runtime.compiled import Options


def test_numbers_proportional_to_the_size_become_multiples_of_it():
    lines = _merged(["buf = torch.empty_strided((12, 64), (64, 1))"],
                    ["buf = torch.empty_strided((14, 64), (64, 1))"], 6)
    assert lines == ["buf = torch.empty_strided(((2 * SIZE), 64), (64, 1))"]
    assert per_size(6, 7, 6, "x") == (1, 0) and per_size(64, 64, 6, "x") == (0, 64)


def test_a_size_plus_a_constant_is_written_so():
    """A decoder's cache has the size's length, the cache with the new token one more."""
    lines = _merged(["cat = f(xnumel=448, rows=7)"], ["cat = f(xnumel=512, rows=8)"], 6)
    assert lines == ["cat = f(xnumel=(64 * SIZE + 64), rows=(SIZE + 1))"]
    assert per_size(5, 6, 6, "x") == (1, -1)


@pytest.mark.parametrize("a, b, why", [
    ("x = (13, 64)", "x = (12, 64)", "13 at size 6 and 12 at size 7, not a multiple of the size plus a constant"),
    ("x = f(12)", "x = g(14)", "differs at size 7 in more than sizes"),
])
def test_what_is_not_proportional_is_named(a, b, why):
    with pytest.raises(NotSized, match=why):
        _merged([a], [b], 6)


def test_numbers_are_compared_between_any_two_sizes():
    assert per_size(40, 83, 40, "x", 83) == (1, 0) and per_size(2560, 5312, 40, "x", 83) == (64, 0)
    with pytest.raises(NotSized, match="20 at size 40 and 41 at size 83"):
        per_size(20, 41, 40, "x", 83)  # n // 2: equal at 40 and 41, not at 83


def _llama_plans(*shapes):
    torch.manual_seed(0)
    model = LlamaLayer()

    def forward(x):
        with torch.no_grad():
            return model(x)
    return [plan_only(forward, [torch.randn(*s)], Options())[0] for s in shapes]


def test_a_sequence_length_becomes_an_argument_of_the_kernels():
    """The attention reads q, k and v at strides of the sequence length, and the matmuls
    split their rows into batch and position by it: numbers in the kernels' text, written
    over SIZE, which the kernels take at launch."""
    plans = _llama_plans((2, 5, 64), (2, 6, 64), (2, far_size(5), 64))
    configs = {info.name: info.config for info in generate_module(_llama_plans((2, 5, 64))[0], "t", "t")[1]}
    sized = sized_module(list(zip((5, 6, far_size(5)), plans)), "llama", "test", configs)
    (attention,) = [i for i in sized.infos if i.schedule.kind == "attention"]
    assert ", SIZE, M, N, D: tl.constexpr" in attention.source
    assert "(bindex // 4) * (64 * SIZE)" in attention.source and "SIZE = in0.shape[1]" in sized.source


def test_a_tma_form_that_fits_one_size_only_runs_one_program_per_tile():
    # Rows of 17 floats are 68 bytes: no descriptor takes them, the TMA form fits 16 only
    from eqfuse.codegen.sized import _fitting
    plans = {k: plan_only(lambda x, w: x @ w, [torch.randn(8, k), torch.randn(k, 32)], Options())[0] for k in (16, 17)}
    (name,) = [k.name for k in plans[16].kernels]
    tma = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16, "GROUP_M": 8, "PROGRAMS": 4, "num_warps": 4, "num_stages": 2}
    plain = {k: v for k, v in tma.items() if k != "PROGRAMS"}
    assert _fitting({name: tma}, [plans[16]]) == {name: tma}
    assert _fitting({name: tma}, [plans[16], plans[17]]) == {name: plain}


def test_kernels_the_first_build_did_not_have_keep_the_tile_models_choice_at_n():
    # The plan at the second size may fuse otherwise than the first build's: its kernels
    # take the configuration the tile model gives them at that size, at every size (the
    # model alone picks BLOCK_M 16 at 16 tokens, 32 at 17)
    sizes = (16, 17, far_size(16))
    sized = sized_module(list(zip(sizes, _llama_plans(*((2, n, 64) for n in sizes)))), "llama", "test", {})
    at_16 = {i.name: i.config for i in generate_module(_llama_plans((2, 16, 64))[0], "t", "t")[1]}
    assert {i.name: i.config for i in sized.infos} == at_16


def _llama_at_sizes(model, shapes, dim, rtol, atol):
    """The Llama layer compiled with dimension ``dim`` marked dynamic, called at each of
    ``shapes`` against eager; the graphs the backend compiled."""
    torch._dynamo.reset()
    eqfuse.backend.history.clear()
    g = torch.compile(model, backend="eqfuse")
    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    with torch.no_grad():
        for shape in shapes:
            x = torch.randn(*shape, device=device, dtype=dtype)
            torch._dynamo.mark_dynamic(x, dim)
            torch.testing.assert_close(g(x), model(x), rtol=rtol, atol=atol)
    return list(eqfuse.backend.history)


def test_llama_layer_with_a_dynamic_batch_compiles_once():
    """mark_dynamic on the batch: the first batch compiles, the second builds the sized
    module (its attention kernel's grid follows the batch), the rest reuse it."""
    torch.manual_seed(0)
    (graph,) = _llama_at_sizes(LlamaLayer(), [(b, 16, 64) for b in (2, 3, 5)], 0, 1e-4, 1e-5)
    assert any(k.schedule.kind == "attention" for k in graph.kernels), graph.explain()


def test_llama_layer_with_a_dynamic_sequence_compiles_once():
    """mark_dynamic on the sequence: one compile, then the sized module at every length,
    the causal attention's rows and keys taken at launch, its skipped tiles as before.
    The far size of 31 (65) is past the layer's 64 positions: it is checked at 33."""
    torch.manual_seed(0)
    (graph,) = _llama_at_sizes(LlamaLayer(), [(2, n, 64) for n in (30, 31, 16, 64, 47)], 1, 1e-4, 1e-5)
    (attention,) = [k for k in graph.kernels if k.schedule.kind == "attention"]
    assert attention.schedule.band is not None  # the causal mask's tiles are skipped


def _halves(x):
    return x[:, : x.shape[1] // 2] * 2


def test_a_size_that_is_not_a_multiple_of_the_symbol_compiles_per_size(caplog):
    # x.shape[1] // 2 is 8 at sizes 16 and 17: the far size shows it follows the size
    torch._dynamo.reset()
    eqfuse.backend.history.clear()
    g = torch.compile(_halves, backend="eqfuse")
    with caplog.at_level("INFO", logger="eqfuse"):
        for n in (12, 16, 17, 40):
            x = torch.randn(3, n, 8)
            torch._dynamo.mark_dynamic(x, 1)
            torch.testing.assert_close(g(x), _halves(x))
    assert "xnumel is 192 at size 16 and 408 at size 35, not a multiple of the size plus a constant" in caplog.text
    assert len(eqfuse.backend.history) == 4


def _windowed_attention(q, k, v):
    """Causal attention over the last 20 keys."""
    i = torch.arange(q.shape[-2], device=q.device)
    keep = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < 20)
    scores = (q @ k.transpose(-1, -2)) * 0.25
    return torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1) @ v


def test_a_window_wider_than_the_sizes_compared_is_not_sized():
    """At 6, 7 and the far size the window of 20 keys is all of them: the mask looks
    causal there (its band has no lower edge), but drops keys at 200. The mask's 20 says
    so."""
    sizes = (6, 7, far_size(6))
    plans = [plan_only(_windowed_attention, [torch.randn(2, n, 16) for _ in range(3)], Options())[0] for n in sizes]
    assert schedules.schedule_of(plans[0].kernels[0]).band == (-5, 0)
    with pytest.raises(NotSized, match="its mask compares indices with 20"):
        sized_module(list(zip(sizes, plans)), "window", "test", {})


def test_windowed_attention_with_a_dynamic_sequence_matches_eager():
    torch._dynamo.reset()
    eqfuse.backend.history.clear()
    g = torch.compile(_windowed_attention, backend="eqfuse")
    for n in (5, 6, 30, 200):
        q, k, v = (torch.randn(2, n, 16) for _ in range(3))
        for t in (q, k, v):
            torch._dynamo.mark_dynamic(t, 1)
        torch.testing.assert_close(g(q, k, v), _windowed_attention(q, k, v), rtol=1e-4, atol=1e-5)
    assert all(k.schedule.kind == "attention" for h in eqfuse.backend.history for k in h.kernels)


@pytest.mark.gpu
def test_llama_layer_with_a_dynamic_batch_on_the_gpu():
    """The sized module's kernels compiled in the pool at the second batch, launched at
    others (each size its own grid), fp16 against eager."""
    torch.manual_seed(0)
    model = LlamaLayer(hidden=256, heads=4, intermediate=512, max_seq=128).cuda().half()
    assert len(_llama_at_sizes(model, [(b, 128, 256) for b in (2, 3, 5, 8)], 0, 2e-2, 2e-2)) == 1


@pytest.mark.gpu
def test_llama_layer_with_a_dynamic_sequence_on_the_gpu():
    torch.manual_seed(0)
    model = LlamaLayer(hidden=256, heads=4, intermediate=512, max_seq=512).cuda().half()
    assert len(_llama_at_sizes(model, [(2, n, 256) for n in (128, 129, 200, 256, 333, 512)], 1, 2e-2, 2e-2)) == 1


def test_a_sized_module_that_does_not_launch_leaves_the_graph_per_size(monkeypatch, caplog):
    """The sized module runs once as it is built; a kernel that does not launch (on a GPU,
    a configuration past the shared memory) leaves the graph compiled per size."""
    import eqfuse.pipeline as pipeline
    load = pipeline._load

    def failing(source, device_type):
        module = load(source, device_type)
        if "(sized: every size of one dimension)" in source:
            def refuse(*args):
                raise RuntimeError("out of resource: shared memory, Required: 245760")
            module.call_boxed = refuse
        return module
    monkeypatch.setattr(pipeline, "_load", failing)
    torch._dynamo.reset()
    eqfuse.backend.history.clear()
    g = torch.compile(lambda x: torch.softmax(x * 2, -1), backend="eqfuse", dynamic=True)
    with caplog.at_level("INFO", logger="eqfuse"):
        for n in (5, 7, 9):
            x = torch.randn(n, 16)
            torch.testing.assert_close(g(x), torch.softmax(x * 2, -1))
    assert "the sized module does not run at size 7: RuntimeError: out of resource" in caplog.text
    assert len(eqfuse.backend.history) == 3


def test_a_sized_matmul_takes_the_tiles_best_across_sizes():
    """A sized module made at 2560 rows (640 tokens of 4) runs 20480 too: its tiles are
    the least worst across SIZES_AHEAD, not the model's first at 2560 rows."""
    from eqfuse.codegen import tiles
    from eqfuse.codegen.schedules import Schedule
    from eqfuse.codegen.sized import SIZES_AHEAD, _schedule_at, across_sizes

    at_n = Schedule("matmul", m=2560, n=2048, k=2048, dot_dtype="float16", dots=1)
    at_m = Schedule("matmul", m=2564, n=2048, k=2048, dot_dtype="float16", dots=1)
    scheds = [_schedule_at(at_n, at_m, 640, 641, round(f * 640)) for f in SIZES_AHEAD]
    assert [s.m for s in scheds] == [1280, 2560, 5120, 10240, 20480]
    candidates = tiles.ranked(at_n)
    best = [min(tiles.modelled_time_us(s, c) for c in candidates) for s in scheds]

    def worst(cfg):
        return max(tiles.modelled_time_us(s, cfg) / b for s, b in zip(scheds, best))
    chosen = across_sizes(at_n, at_m, 640, 641)
    assert worst(chosen) == min(map(worst, candidates))
    assert worst(chosen) < worst(candidates[0])


def test_a_plan_that_differs_at_the_calls_size_leaves_the_module_to_the_sizes_after(monkeypatch, caplog):
    """Where the cost model breaks a tie otherwise at the call's size n than at n + 1 (a
    Llama layer at 640 tokens), the sized module is made from n + 1, n + 2, ... and runs
    n as well."""
    import copy

    import eqfuse.pipeline as pipeline
    from eqfuse.schema.plan import Buffer
    plan_only_ = pipeline.plan_only

    def otherwise_at_7(fn, example_inputs, options):
        plan, captured = plan_only_(fn, example_inputs, options)
        if example_inputs[0].shape[0] == 7:  # a buffer no kernel uses: another plan
            plan = copy.deepcopy(plan)
            plan.buffers["buf_spare"] = Buffer("buf_spare", (1,), "float32", "temp")
        return plan, captured
    monkeypatch.setattr(pipeline, "plan_only", otherwise_at_7)
    torch._dynamo.reset()
    eqfuse.backend.history.clear()
    g = torch.compile(lambda x: torch.softmax(x * 2, -1), backend="eqfuse", dynamic=True)
    with caplog.at_level("INFO", logger="eqfuse"):
        for n in (5, 7, 9, 30):
            x = torch.randn(n, 16)
            torch.testing.assert_close(g(x), torch.softmax(x * 2, -1))
    assert "not from size 7 (the plans differ: other buffers at size 8 than at 7); from 8" in caplog.text
    assert "runs one sized module for every size" in caplog.text
    assert len(eqfuse.backend.history) == 1


def test_a_transposing_copy_takes_its_row_length_at_launch():
    """A pointwise kernel that reads across its output's order iterates [rows, X] tiles
    (codegen/pointwise.py); where X is the dynamic size (k^T of a rotary embedding, the
    sequence innermost), the kernel takes X and its element count at launch."""
    def f(x):
        return (x * 2 + 1).transpose(0, 1).contiguous()

    torch._dynamo.reset()
    eqfuse.backend.history.clear()
    g = torch.compile(f, backend="eqfuse", dynamic=True)
    for n in (20, 21, 33, 64, 100):
        x = torch.randn(n, 48)
        torch.testing.assert_close(g(x), f(x))
    (compiled,) = eqfuse.backend.history
    assert [k.schedule.inner for k in compiled.kernels] == [20]


def test_a_grid_that_grows_with_a_dynamic_batch_bounds_the_sizes_the_module_takes():
    """The attention's grid is (query tiles, batch x heads): CUDA takes 65535 in its second
    dimension, so a sized module over the batch runs batches up to 65535 // heads."""
    sizes = (2, 3, far_size(2))
    plans = _llama_plans(*((b, 16, 64) for b in sizes))
    sized = sized_module(list(zip(sizes, plans)), "llama", "test", {})
    heads = LlamaLayer().heads
    assert sized.max_size == 65535 // heads
