"""Sized modules (codegen/sized.py): one module for every size of a dynamic dimension."""

import pytest
import torch

import eqfuse.backend
from eqfuse.codegen.sized import NotSized, _merged, per_size, sized_module
from eqfuse.models import LlamaLayer
from eqfuse.pipeline import plan_only
from eqfuse.runtime.compiled import Options


def test_numbers_proportional_to_the_size_become_multiples_of_it():
    lines = _merged(["buf = torch.empty_strided((12, 64), (64, 1))"],
                    ["buf = torch.empty_strided((14, 64), (64, 1))"], 6)
    assert lines == ["buf = torch.empty_strided(((2 * SIZE), 64), (64, 1))"]
    assert per_size(6, 7, 6, "x") == 1 and per_size(64, 64, 6, "x") == 0


@pytest.mark.parametrize("a, b, why", [
    ("x = (13, 64)", "x = (15, 64)", "13 at size 6 and 15 at size 7, not proportional"),
    ("x = f(12)", "x = g(14)", "differs at size 7 in more than sizes"),
])
def test_what_is_not_proportional_is_named(a, b, why):
    with pytest.raises(NotSized, match=why):
        _merged([a], [b], 6)


def _llama_plans(shape_a, shape_b):
    torch.manual_seed(0)
    model = LlamaLayer()

    def forward(x):
        with torch.no_grad():
            return model(x)
    return [plan_only(forward, [torch.randn(*s)], Options())[0] for s in (shape_a, shape_b)]


def test_a_sequence_in_the_kernels_index_arithmetic_is_not_sized():
    # The attention reads q, k and v at strides of the sequence length: text, not an argument
    a, b = _llama_plans((2, 5, 64), (2, 6, 64))
    with pytest.raises(NotSized, match="is written otherwise at size 6 than at 5"):
        sized_module(a, b, 5, "llama", "test", {})


def test_llama_layer_with_a_dynamic_batch_compiles_once():
    """mark_dynamic on the batch: the first batch compiles, the second builds the sized
    module (its attention kernel's grid follows the batch), the rest reuse it."""
    torch._dynamo.reset()
    eqfuse.backend.history.clear()
    torch.manual_seed(0)
    model = LlamaLayer()
    g = torch.compile(model, backend="eqfuse")
    with torch.no_grad():
        for batch in (2, 3, 5):
            x = torch.randn(batch, 16, 64)
            torch._dynamo.mark_dynamic(x, 0)
            torch.testing.assert_close(g(x), model(x), rtol=1e-4, atol=1e-5)
    (graph,) = eqfuse.backend.history
    assert any(k.schedule.kind == "attention" for k in graph.kernels), graph.explain()


@pytest.mark.gpu
def test_llama_layer_with_a_dynamic_batch_on_the_gpu():
    """The sized module's kernels compiled in the pool at the second batch, launched at
    others (each size its own grid), fp16 against eager."""
    torch._dynamo.reset()
    eqfuse.backend.history.clear()
    torch.manual_seed(0)
    model = LlamaLayer(hidden=256, heads=4, intermediate=512, max_seq=128).cuda().half()
    g = torch.compile(model, backend="eqfuse")
    with torch.no_grad():
        for batch in (2, 3, 5, 8):
            x = torch.randn(batch, 128, 256, device="cuda", dtype=torch.half)
            torch._dynamo.mark_dynamic(x, 0)
            torch.testing.assert_close(g(x), model(x), rtol=2e-2, atol=2e-2)
    assert len(eqfuse.backend.history) == 1
