"""Translation validation in bounded memory: a kernel evaluated in chunks along one dim
of its roots gives what the whole evaluation gives, without ever holding a score-sized
tensor; outputs compared piece by piece give the verdict of a whole comparison."""

import pytest
import torch
from conftest import DEVICE, assert_matches

import eqfuse
from eqfuse.examples import ATTENTION_EXAMPLES
from eqfuse.frontend.capture import capture
from eqfuse.models import LlamaLayer
from eqfuse.rewrite import validate
from eqfuse.runtime.compiled import make_fallback_runner


def _rotary_cat_slices(x, y):
    half = x.shape[-1] // 2
    z = (x * 2).reshape(3, 4, 2, 8).transpose(1, 2)
    rot = torch.cat([-z[..., half // 2:], z[..., :half // 2]], dim=-1)
    return (rot * y.reshape(3, 2, 4, 8)).reshape(6, 32)[1:5, ::3], torch.tril(x + 1)


GRAPHS = {
    **{name: (ATTENTION_EXAMPLES[name].fn, lambda n=name: ATTENTION_EXAMPLES[n].make_inputs(2, 4, 32, 16,
                                                                                            torch.float32, DEVICE))
       for name in ("causal_attention", "gqa_attention", "padded_attention", "causal_attention_bias")},
    "llama_layer": (LlamaLayer(), lambda: (torch.randn(2, 16, 64),)),
    "views": (_rotary_cat_slices, lambda: (torch.randn(12, 16), torch.randn(12, 16))),
}


class _Recorder:
    """Counts narrowed evaluations and the largest value any plan node took."""

    def __init__(self, monkeypatch):
        self.narrowed, self.largest = 0, 0
        apply, narrow = validate._apply, validate._KernelEvaluator._narrow

        def recording_apply(node, a, shape, device):
            v = apply(node, a, shape, device)
            if v.device.type != "meta":  # not the dry runs that choose the chunk dim
                self.largest = max(self.largest, v.numel())
            return v

        def counting_narrow(ev, *args):
            self.narrowed += 1
            return narrow(ev, *args)
        monkeypatch.setattr(validate, "_apply", recording_apply)
        monkeypatch.setattr(validate._KernelEvaluator, "_narrow", counting_narrow)


@pytest.mark.parametrize("name", list(GRAPHS))
def test_chunked_evaluation_equals_whole_evaluation(name, monkeypatch):
    fn, make = GRAPHS[name]
    torch.manual_seed(0)
    inputs = tuple(x.to(DEVICE) for x in make())
    compiled = eqfuse.compile(fn, inputs)
    plan = compiled.plan
    flat = capture(fn, inputs).example_tensors  # the inputs, then the module's weights
    whole = validate.evaluate(plan, flat, make_fallback_runner)
    rec = _Recorder(monkeypatch)
    monkeypatch.setattr(validate, "CHUNK_ELEMENTS", 64)
    chunked = validate.evaluate(plan, flat, make_fallback_runner)
    assert rec.narrowed > 0
    for w, c in zip(whole, chunked):
        if isinstance(w, torch.Tensor):
            torch.testing.assert_close(c, w, rtol=1e-5, atol=1e-5, equal_nan=True)


def test_chunked_attention_never_holds_the_score_matrix(monkeypatch):
    """Causal attention over 2 x 4 heads x 128 tokens: the scores are 131072 elements;
    in chunks of 4096 no node's value comes near that."""
    ex = ATTENTION_EXAMPLES["causal_attention"]
    q, k, v = ex.make_inputs(2, 4, 128, 64, torch.float32, DEVICE)
    compiled = eqfuse.compile(ex.fn, (q, k, v))
    assert any(n.op == "expdot" for kern in compiled.plan.kernels for n in kern.walk())
    rec = _Recorder(monkeypatch)
    monkeypatch.setattr(validate, "CHUNK_ELEMENTS", 4096)
    (out,) = validate.evaluate(compiled.plan, [q, k, v], make_fallback_runner)
    torch.testing.assert_close(out, ex.fn(q, k, v), rtol=1e-4, atol=1e-5)
    assert rec.largest <= 2 * 4096, rec.largest  # whole, the largest is 2 * 4 * 128 * 128


def test_piecewise_comparison_gives_the_whole_verdict(monkeypatch):
    monkeypatch.setattr(validate, "CHUNK_ELEMENTS", 7)
    e = torch.randn(6, 5, 4)
    g = e.transpose(0, 2).contiguous().transpose(0, 2)  # same values, other strides
    assert validate._first_difference([g], [e]) is None
    bad = g.clone()
    bad[5, 4, 3] += 100
    assert validate._first_difference([bad], [e]).startswith("output 0: relative error")
    nan = g.clone()
    nan[3, 1, 2] = float("nan")
    assert validate._first_difference([nan], [e]) == "output 0: NaN in different places"
    ints = (e * 10).int()
    assert validate._first_difference([ints + (ints == ints[2, 2, 2]).int()], [ints]) == "output 0: values differ"
    inf, e_inf = g.clone(), e.clone()
    inf[1, 2, 3] = e_inf[1, 2, 3] = float("inf")  # the same infinity in both: no difference
    assert validate._first_difference([inf], [e_inf]) is None
    inf[4, 0, 1] = float("-inf")
    assert validate._first_difference([inf], [e_inf]) == "output 0: infinities differ"
    e_inf[4, 0, 1] = float("inf")  # an infinity of the other sign
    assert validate._first_difference([inf], [e_inf]) == "output 0: infinities differ"
    half = e.half()
    assert validate._first_difference([half + 0.001 * half], [half]) is None  # within float16's tolerance
    assert validate._first_difference([half + 0.1 * half], [half]).startswith("output 0: relative error")


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-4), (torch.float16, 1e-2), (torch.bfloat16, 5e-2)])
def test_tolerance_follows_the_precision_an_output_is_computed_from(dtype, rtol):
    """A float32 LayerNorm mean of float16 values carries their rounding (measured 1.4e-3
    relative on a GPT-2 block on an H100, where the float16 values differed by 4e-4)."""
    def f(x, w):
        h = x * w
        return h.float().mean(-1), h, w.float() * 2

    x, w = torch.randn(4, 8).to(dtype), torch.randn(8).to(dtype)
    assert validate.output_rtols(capture(f, (x, w)).gm) == [rtol, rtol, rtol]
    assert validate.output_rtols(capture(lambda a: a * 2, (torch.randn(3),)).gm) == [1e-4]
    e = torch.randn(1000)
    off = e + 2e-3 * e.norm() / 1000 ** 0.5 * torch.randn(1000)  # about 2e-3 relative
    assert validate._first_difference([off], [e]).startswith("output 0: relative error")
    assert validate._first_difference([off], [e], rtols=[1e-2]) is None


def test_weight_gradient_is_summed_over_chunks_of_tokens(monkeypatch):
    """x.T @ g over 4096 tokens, both operands computed in the kernel: evaluated whole,
    the product is a sum over chunks of tokens, and no operand is held whole."""
    def f(x, g):
        return (x * 2).t() @ torch.tanh(g)

    x, g = torch.randn(4096, 8), torch.randn(4096, 16)
    monkeypatch.setenv("EQFUSE_SPLIT_K", "0")  # the product whole, not split over K in two kernels
    compiled = eqfuse.compile(f, (x, g))
    (kernel,) = compiled.plan.kernels
    assert any(n.op == "dot" for n in kernel.walk())
    rec = _Recorder(monkeypatch)
    monkeypatch.setattr(validate, "CHUNK_ELEMENTS", 2048)
    (out,) = validate.evaluate(compiled.plan, [x, g], make_fallback_runner)
    torch.testing.assert_close(out, f(x, g), rtol=1e-4, atol=1e-4)
    assert rec.narrowed > 0 and rec.largest <= 2 * 2048, rec.largest  # x * 2 alone is 32768


@pytest.mark.parametrize("dtype, tf32", [(torch.float16, True), (torch.bfloat16, True), (torch.float32, False)])
def test_half_precision_products_are_checked_on_tf32_and_float32_ones_as_the_user_set(dtype, tf32, monkeypatch):
    """Half-precision operands are exact in TF32, so the check multiplies them on tensor
    cores; a float32 product keeps the user's setting (here off), and the setting is back
    after the check."""
    seen = []
    matmul = torch.matmul

    def recording(a, b):
        seen.append(torch.backends.cuda.matmul.allow_tf32)
        return matmul(a, b)

    def f(x, w):
        return torch.relu(x @ w)

    x, w = torch.randn(5, 16, dtype=dtype), torch.randn(16, 7, dtype=dtype)
    compiled = eqfuse.compile(f, (x, w), validate=False)
    monkeypatch.setattr(torch, "matmul", recording)
    allowed = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        (out,) = validate.evaluate(compiled.plan, [x, w], make_fallback_runner)
        assert torch.backends.cuda.matmul.allow_tf32 is False
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allowed
    assert seen == [tf32]
    torch.testing.assert_close(out.to(dtype), f(x, w), rtol=2e-2, atol=2e-2)


def _embedding_model():
    """Token types through an embedding of two rows, as BERT has them: an index made up
    in 0..7 is out of its range (on a GPU that is a device-side assert, which kills the
    process's CUDA context)."""
    torch.manual_seed(0)
    table = torch.nn.Embedding(2, 8)
    proj = torch.nn.Linear(8, 8)
    return lambda types, x: proj(table(types) + x).relu()


def test_a_graph_traced_with_fake_tensors_is_checked_on_its_first_real_inputs(monkeypatch):
    """Dynamo hands the backend fake tensors; the check runs at the first call, on the
    user's inputs, never on made-up ones that could break an op's precondition."""
    import eqfuse.backend

    checked = []
    real_mismatch = validate.mismatch
    monkeypatch.setattr(validate, "mismatch", lambda *a, **k: checked.append(a[3]) or real_mismatch(*a, **k))
    f = _embedding_model()
    types, x = torch.tensor([[0, 1, 1], [1, 0, 0]]), torch.randn(2, 3, 8)
    torch._dynamo.reset()
    eqfuse.backend.history.clear()
    compiled = torch.compile(f, backend="eqfuse")
    with torch.no_grad():
        got = compiled(types, x)
        assert_matches(got, f(types, x))
    [graph] = eqfuse.backend.history
    assert graph.kernels and not graph.report.get("note"), graph.explain()
    assert not graph.fallbacks and "embedding" in graph.explain(), graph.explain()  # read in a kernel
    assert len(checked) == 1 and any(x is types for x in checked[0])
    assert "validate" in graph.report["seconds"]


def test_a_plan_that_fails_its_first_call_check_is_built_again_from_the_real_inputs(monkeypatch):
    """Where the plan differs from the graph on the first real inputs, the graph is built
    again with them (checked at once), and the call returns the graph's values."""
    import eqfuse.backend
    from eqfuse import pipeline

    real_check = pipeline._first_call_check
    calls = []

    def failing_once(plan, captured, inputs):
        calls.append(len(calls))
        return "a made-up difference" if len(calls) == 1 else real_check(plan, captured, inputs)
    monkeypatch.setattr(pipeline, "_first_call_check", failing_once)
    f = _embedding_model()
    types, x = torch.tensor([[1, 1, 0]]), torch.randn(1, 3, 8)
    torch._dynamo.reset()
    eqfuse.backend.history.clear()
    with torch.no_grad():
        got = torch.compile(f, backend="eqfuse")(types, x)
        assert_matches(got, f(types, x))
    [graph] = eqfuse.backend.history
    assert calls == [0] and graph.kernels, graph.explain()
    assert graph.report["retries"][0] == "a made-up difference"


def test_a_half_precision_output_that_is_rounding_noise_is_judged_against_float64(monkeypatch):
    """A value zero in exact arithmetic (a softmax is the same for scores shifted by one)
    is bf16 rounding noise in eager and float32 noise in the plan: they differ by 100%,
    yet the plan is nearer the truth. The check asks a float64 evaluation (a BERT block's
    key-bias gradient, checked on real inputs, sent its backward to eager so)."""
    def noise(x, w):
        return (x.softmax(-1) * w).sum(-1) - ((x + 1.0).softmax(-1) * w).sum(-1)
    judged = []
    first_worse = validate._first_worse
    monkeypatch.setattr(validate, "_first_worse", lambda *a, **k: judged.append(1) or first_worse(*a, **k))
    torch.manual_seed(0)
    x, w = torch.randn(8, 64, dtype=torch.bfloat16), torch.randn(64, dtype=torch.bfloat16)
    compiled = eqfuse.compile(noise, (x, w))
    assert judged, "the relative check passed: the example no longer tests the float64 verdict"
    assert compiled.kernels and not compiled.fallbacks, compiled.explain()
    exact = noise(x.double(), w.double())
    got, eager = compiled(x, w), noise(x, w)
    assert (got.double() - exact).norm() <= 2 * (eager.double() - exact).norm() + 1e-3


@torch.library.custom_op("eqfuse_test::without_float64", mutates_args=())
def _without_float64(x: torch.Tensor) -> torch.Tensor:
    if x.dtype == torch.float64:
        raise RuntimeError("no float64 kernel")  # as CUDA's _grouped_mm (Mixtral's experts)
    return x.clone()


_without_float64.register_fake(torch.empty_like)


@pytest.mark.parametrize("widen", [False, True])
def test_without_float64_rounding_noise_is_judged_against_float32(widen, monkeypatch):
    """An op with no float64 kernel in the graph: the wide evaluation runs in float32. An
    output in float32 computed from bf16 values is judged so too."""
    def noise(x, w):
        x = _without_float64(x)
        out = (x.softmax(-1) * w).sum(-1) - ((x + 1.0).softmax(-1) * w).sum(-1)
        return out.float() if widen else out
    references = []
    wide_outputs = validate._wide_outputs
    monkeypatch.setattr(validate, "_wide_outputs", lambda *a: references.append(wide_outputs(*a)) or references[-1])
    torch.manual_seed(0)
    x, w = torch.randn(8, 64, dtype=torch.bfloat16), torch.randn(64, dtype=torch.bfloat16)
    compiled = eqfuse.compile(noise, (x, w))
    assert [r[0].dtype for r in references] == [torch.float32], "the example no longer tests the wide verdict"
    assert compiled.kernels and all(f.node != "<graph>" for f in compiled.fallbacks), compiled.explain()
    exact = noise(x.float(), w.float())
    got, eager = compiled(x, w), noise(x, w)
    assert (got.double() - exact).norm() <= 2 * (eager.double() - exact).norm() + 1e-3


def test_against_float64_a_wrong_half_precision_output_still_fails():
    expected = [torch.randn(64, dtype=torch.bfloat16)]
    exact = [expected[0].double()]
    assert validate._first_worse([expected[0] * 1.5], expected, exact).startswith("output 0: ")
    assert validate._first_worse([expected[0].clone()], expected, exact) is None
    nan = expected[0].clone()
    nan[3] = float("nan")
    assert "NaN" in validate._first_worse([nan], expected, exact)


def _routed(x, gate):
    """A mixture of experts' routing as transformers writes it (Mixtral's grouped path),
    with the permuted intermediates returned, as a training forward saves them: router
    logits rounded to integers, so that ties are everywhere and torch's order of them
    (CPU topk and an unstable sort) is not the plan's (the lowest position first)."""
    probs = (x @ gate).round().softmax(-1)
    top_w, top_i = probs.topk(2, dim=-1)
    ids_sorted, perm = top_i.reshape(-1).sort()
    routed = torch.tanh(x[perm // 2] * 2) * top_w.reshape(-1)[perm].unsqueeze(-1)  # the tokens in expert order
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel())
    out = routed[inv].view(x.shape[0], 2, x.shape[1]).sum(1)  # put back in the tokens' order
    experts_used = torch.bincount(ids_sorted, minlength=gate.shape[1])  # which experts took them: decided too
    return out, top_w, top_i, perm, routed, experts_used


def test_outputs_laid_out_by_an_order_decision_are_not_compared_what_is_put_back_is():
    """Ties broken otherwise than eager route tokens otherwise: the check must not send
    the graph to eager for it (a Mixtral training forward did, whole), and must still
    compare what the routing computes once put back in the tokens' order."""
    g = torch.Generator().manual_seed(0)
    x, gate = torch.randn(32, 16, generator=g), torch.randn(16, 8, generator=g)
    want = _routed(x, gate)
    c = eqfuse.compile(_routed, (x, gate), plan_cache=False)
    assert c.kernels and "internal check failed" not in c.explain(), c.explain()
    got = c(x, gate)
    assert not torch.equal(got[2], want[2])  # the plan decided the ties otherwise...
    for i in (0, 1):  # ...and the values that do not depend on the order are eager's
        torch.testing.assert_close(got[i], want[i], rtol=1e-5, atol=1e-5)
    assert validate.order_dependent_outputs(capture(_routed, (x, gate)).undecomposed()) == {2, 3, 4, 5}


def test_a_wrong_value_put_back_after_the_routing_is_still_caught(monkeypatch):
    """The outputs after the put-back are compared: a plan off there falls back."""
    g = torch.Generator().manual_seed(0)
    x, gate = torch.randn(32, 16, generator=g), torch.randn(16, 8, generator=g)
    captured = capture(_routed, (x, gate))
    real = validate.evaluate

    def off(plan, inputs, runner):
        outs = real(plan, inputs, runner)
        return [outs[0] + 1e-2, *outs[1:]]
    monkeypatch.setattr(validate, "evaluate", off)
    c = eqfuse.compile(_routed, (x, gate), plan_cache=False)
    assert "output 0 (" in c.explain() and "internal check failed" in c.explain(), c.explain()
    assert validate.order_dependent_outputs(captured.undecomposed()) == {2, 3, 4, 5}
