"""The serialised e-graph as the extractor reads it (eqfuse/rewrite/egraph_json.py): a
term that egglog hands back with another vector of the e-graph as its shape is read at
its class's shape analysis, so that its kernel is built and computes eager's values."""

import json

import pytest
import torch

import eqfuse
from eqfuse.rewrite import egraph_json
from eqfuse.rewrite.egraph_json import EGraphView

SPECIAL = [float("nan"), float("inf"), -float("inf"), -0.0, 1e-40, 3.0e38]


def linear_gelu(x, w, b):
    return torch.nn.functional.gelu(x @ w.t() + b)


def _inputs(special: bool):
    torch.manual_seed(0)
    x, w, b = torch.randn(16, 64), torch.randn(32, 64) / 8, torch.randn(32)
    if special:
        x[0, :6] = torch.tensor(SPECIAL)
        w[1, :6] = torch.tensor(SPECIAL)
    return x, w, b


def _mixed_up(serialized: str) -> tuple[str, int]:
    """``serialized`` with every read of a transposed view (strides not row-major) spelling
    its strides vector as its shape too, as egglog 13.2 handed GPT-NeoX's weight read back."""
    data = json.loads(serialized)
    nodes = data["nodes"]

    def values(node_id):
        return [int(nodes[c]["op"]) for c in nodes[node_id]["children"]]

    mixed = 0
    for n in nodes.values():
        if n["op"] == "LoadStrided":
            shape, strides = n["children"][1], n["children"][2]
            if values(strides)[-1] != 1 and values(shape) != values(strides):
                n["children"][1] = strides
                mixed += 1
    return json.dumps(data), mixed


@pytest.fixture
def mixed_up_vectors(monkeypatch):
    """Serialisation as the extractor sees it when egglog mixes up a term's vectors."""
    seen = []

    def serialize(egraph):
        text, mixed = _mixed_up(egraph._serialize(split_primitive_outputs=False).to_json())
        view = EGraphView(text)
        seen.append((mixed, len(view.mended)))
        return view

    monkeypatch.setattr(egraph_json, "serialize", serialize)
    monkeypatch.setenv("EQFUSE_PLAN_CACHE", "0")
    return seen


@pytest.mark.parametrize("special", [False, True], ids=["random", "special values"])
def test_a_read_with_a_mixed_up_shape_is_read_at_its_analysed_shape(mixed_up_vectors, special):
    args = _inputs(special)
    compiled = eqfuse.compile(linear_gelu, args)
    assert len(compiled.kernels) == 1 and not compiled.fallbacks  # without the mending: no kernel, eager
    assert mixed_up_vectors and all(mixed >= 1 and mended == mixed for mixed, mended in mixed_up_vectors)
    assert compiled.report["extraction"]["mended_shapes"] >= 1
    assert "handed back with another shape vector" in compiled.explain()
    torch.testing.assert_close(compiled(*args), linear_gelu(*args), rtol=1e-4, atol=1e-4, equal_nan=True)


def test_shapes_that_agree_with_the_analysis_are_left_alone():
    def f(x, w, b):
        return (x @ w.t() + b).reshape(4, 4, 32).sum(1)

    compiled = eqfuse.compile(f, _inputs(False))
    assert "mended_shapes" not in compiled.report["extraction"]
    torch.testing.assert_close(compiled(*_inputs(False)), f(*_inputs(False)), rtol=1e-4, atol=1e-4)


def test_a_product_over_a_mixed_up_shape_left_unmended_is_an_eager_step_named_so(mixed_up_vectors, monkeypatch):
    """Where the analysis cannot mend a term, its ill-typed product is never a kernel: the
    graph is built again, then runs in eager with the reason, eager's values, and no
    writer's assertion."""
    monkeypatch.setattr(egraph_json, "SHAPE_ARG", {})
    args = _inputs(False)
    compiled = eqfuse.compile(linear_gelu, args)
    assert compiled.kernels == [] and "egglog returned only ill-typed forms" in compiled.explain()
    assert len(mixed_up_vectors) == 2  # built once more from scratch before eager
    assert "Dot of [16, 64] and [1, 64]" in compiled.explain()
    torch.testing.assert_close(compiled(*args), linear_gelu(*args))
