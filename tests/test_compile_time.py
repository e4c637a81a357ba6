"""Compile-time shortcuts that must not change what is compiled: the translator's shared
shape vectors and capture's decomposition table built once."""

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
    assert memo.source == plain.source
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
