"""Compile-time shortcuts that must not change what is compiled (the translator's shared
shape vectors, capture's decomposition table built once), and the plan search's budget."""

import math
from types import SimpleNamespace

import torch

import eqfuse
from eqfuse.frontend import capture as capture_module
from eqfuse.models import GPT2Block
from eqfuse.schema import from_fx, terms


def _gpt2_build(monkeypatch, memo: bool):
    if not memo:
        monkeypatch.setattr(from_fx.Translator, "ivec", lambda self, values: terms.ivec(values))
    torch.manual_seed(0)
    model = GPT2Block(hidden=64, heads=4)
    x = torch.randn(2, 16, 64)
    c = eqfuse.compile(model, (x,), plan_cache=False)
    monkeypatch.undo()
    return c, model, x


def test_shared_shape_vectors_give_the_same_egraph_and_plan(monkeypatch):
    memo, model, x = _gpt2_build(monkeypatch, memo=True)
    plain, _, _ = _gpt2_build(monkeypatch, memo=False)
    assert memo.source == plain.source, (memo.fallbacks, plain.fallbacks, plain.report.get("stop_reason"))
    s, p = memo.report["saturation"], plain.report["saturation"]
    assert (s["enodes"], s["eclasses"], s["rules_fired"]) == (p["enodes"], p["eclasses"], p["rules_fired"])
    torch.testing.assert_close(memo(x), model(x), rtol=1e-4, atol=1e-4)


def test_translator_makes_each_shape_vector_once(monkeypatch):
    made = []
    real = terms.ivec
    monkeypatch.setattr(terms, "ivec", lambda values: made.append(tuple(values)) or real(values))
    captured = capture_module.capture(lambda x: (x * 2).sum(-1) + x.mean(-1), (torch.randn(4, 8),))
    from_fx.translate(captured)
    assert made and len(made) == len(set(made))


def test_decomposition_table_is_built_once_and_handed_out_fresh(monkeypatch):
    builds = []
    make = capture_module._make_decomposition_table
    monkeypatch.setattr(capture_module, "_TABLE", None)
    monkeypatch.setattr(capture_module, "_make_decomposition_table", lambda: builds.append(1) or make())
    a, b = capture_module.decomposition_table(), capture_module.decomposition_table()
    assert len(builds) == 1
    assert a == b and a is not b
    a.clear()
    assert capture_module.decomposition_table() == b
    assert torch.ops.aten.gelu.default in b  # eqfuse's own additions are in it


def chain(x, n=40):
    """A chain of pointwise ops: one kernel, once extraction has weighed its fusions."""
    for i in range(n):
        x = x * 1.0001 + 0.001 if i % 2 else torch.sin(x)
    return x


def test_past_the_budget_the_search_stops_and_the_plan_it_has_runs(tmp_path, monkeypatch):
    """max_seconds covers the plan search: spent before translation, saturation stops at
    once and extraction keeps the plan it starts from (every value stored), which the plan
    cache does not keep."""
    from eqfuse.runtime import plan_cache

    monkeypatch.setenv("EQFUSE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(plan_cache.ENV_SWITCH, "1")
    x = torch.randn(64)
    c = eqfuse.compile(chain, (x,), max_seconds=1e-6)
    assert c.report["extraction"]["budget_spent"] and "time budget (max_seconds) ran out" in c.explain()
    assert len(c.kernels) > 1 and not c.fallbacks
    torch.testing.assert_close(c(x), chain(x))
    again = eqfuse.compile(chain, (x,), max_seconds=1e-6)
    assert again.report["plan_cache"]["hit"] is False
    full = eqfuse.compile(chain, (x,))
    assert len(full.kernels) == 1 and "budget_spent" not in full.report["extraction"]
    assert eqfuse.compile(chain, (x,)).report["plan_cache"]["hit"] is True


def test_extraction_past_its_deadline_weighs_no_more_fusions(monkeypatch):
    """The clock read past the deadline from extraction's first step: the plan is the one
    it starts from (each value computed where it is read), reported as such."""
    from eqfuse.rewrite import extract

    monkeypatch.setattr(extract, "time", SimpleNamespace(perf_counter=lambda: math.inf))
    x = torch.randn(64)
    c = eqfuse.compile(chain, (x,), plan_cache=False)
    assert c.report["extraction"]["budget_spent"] == "fusion"
    torch.testing.assert_close(c(x), chain(x))


def test_outputs_that_join_one_kernel_are_written_into_it_together(monkeypatch):
    """A graph of many outputs from one product: the extraction moved them into one kernel
    one at a time, writing the growing kernel at each move (the roots it wrote grew with
    the square of the outputs: 2072 for 60, 22 s of extraction for 400). Its other
    siblings now join at once."""
    from eqfuse.rewrite import extract

    written = []
    generate = extract.generate
    monkeypatch.setattr(extract, "generate", lambda spec, buffers: written.append(len(spec.roots))
                        or generate(spec, buffers))
    outputs = 60

    def f(x, w):
        h = torch.relu(x @ w)
        return tuple((h * (i + 1)).sin() + i for i in range(outputs))
    x, w = torch.randn(16, 32), torch.randn(32, 32)
    c = eqfuse.compile(f, (x, w), plan_cache=False)
    assert sorted(len(k.roots) for k in c.plan.kernels)[-1] >= outputs - 1, c.explain()
    for got, want in zip(c(x, w), f(x, w)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)
    assert sum(written) < 8 * outputs, sum(written)
