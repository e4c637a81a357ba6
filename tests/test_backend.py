"""torch.compile(..., backend="eqfuse"): forward and backward against eager."""

import os

import pytest
import torch
import torch.nn as nn

import eqfuse.backend


def _grads(module, x):
    for p in module.parameters():
        p.grad = None
    x.grad = None
    out = module(x)
    out.float().pow(2).sum().backward()
    return out, [p.grad.clone() for p in module.parameters()] + [x.grad.clone()]


def _input_grads(fn, inputs):
    """``fn(*inputs)`` and the inputs' gradients after ``out.sum().backward()``."""
    for t in inputs:
        t.grad = None
    out = fn(*inputs)
    out.sum().backward()
    return out, [t.grad.clone() for t in inputs]


def test_backend_is_registered_by_name():
    assert "eqfuse" in torch._dynamo.list_backends(exclude_tags=())


def test_relu_mul_forward_and_backward_are_one_kernel_each():
    torch._dynamo.reset()
    eqfuse.backend.history.clear()
    f = lambda x, y: torch.relu(x * y)
    x = torch.randn(8, 32, requires_grad=True)
    y = torch.randn(8, 32, requires_grad=True)
    out, grads = _input_grads(torch.compile(f, backend="eqfuse"), (x, y))
    ref, ref_grads = _input_grads(f, (x, y))
    torch.testing.assert_close(out, ref)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)
    forward, backward = eqfuse.backend.history
    assert len(forward.kernels) == 1 and len(backward.kernels) == 1, backward.explain()


def test_module_training_step_matches_eager():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32), nn.Tanh())
    x = torch.randn(16, 32, requires_grad=True)
    ref_out, ref_grads = _grads(model, x)
    out, grads = _grads(torch.compile(model, backend="eqfuse"), x)
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)


def test_training_with_dropout_compiles_and_draws_what_eager_draws():
    """Dropout stays an eager step in the forward graph (the check against eager seeds both
    of its runs alike); with the same seed the step gives eager's output and gradients.
    Before, the check drew other numbers and the whole forward ran in eager."""
    torch._dynamo.reset()
    eqfuse.backend.history.clear()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.3), nn.Linear(32, 8))
    x = torch.randn(12, 16, requires_grad=True)
    torch.manual_seed(5)
    ref_out, ref_grads = _grads(model, x)
    compiled = torch.compile(model, backend="eqfuse")
    torch.manual_seed(5)
    out, grads = _grads(compiled, x)
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)
    forward, backward = eqfuse.backend.history
    assert [f.node for f in forward.fallbacks] == ["native_dropout"] and forward.kernels, forward.explain()
    assert backward.kernels and "note" not in backward.report, backward.explain()


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_batch_norm_fuses_and_keeps_its_running_statistics(train):
    """Batch norm is decomposed as layer norm is (it ran in eager as one op): statistics over
    the batch, the normalisation and the running averages' update in kernels. Outputs,
    gradients and the running statistics match eager's after two steps."""
    import copy
    torch._dynamo.reset()
    eqfuse.backend.history.clear()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4)).train(train)
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="eqfuse")
    x = torch.randn(12, 16, requires_grad=train)
    with torch.set_grad_enabled(train):
        for _ in range(2):
            out, ref_out = compiled(x), reference(x)
            if train:
                out.square().sum().backward()
                ref_out.square().sum().backward()
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5)
    for mine, theirs in zip([*model.parameters(), *model.buffers()], [*reference.parameters(), *reference.buffers()]):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5)
        if train:
            torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-4, atol=1e-5)
    assert eqfuse.backend.history and all(h.kernels and not h.fallbacks for h in eqfuse.backend.history), \
        [h.explain() for h in eqfuse.backend.history]


def test_validation_runs_without_aotautograds_modes(monkeypatch):
    """AOTAutograd calls the compilers with its FakeTensorMode and PyTorch's Python
    dispatcher on; the build's eager work (validation here) runs with neither, at eager's
    speed on real tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    from eqfuse.rewrite import validate
    seen = []
    check = validate.mismatch

    def watched(*args, **kwargs):
        seen.append((torch._C._dispatch_tls_is_dispatch_key_included(torch._C.DispatchKey.PythonDispatcher),
                     any(isinstance(m, FakeTensorMode) for m in _get_current_dispatch_mode_stack())))
        return check(*args, **kwargs)
    monkeypatch.setattr(validate, "mismatch", watched)
    torch._dynamo.reset()
    x = torch.randn(8, 32, requires_grad=True)
    out, grads = _input_grads(torch.compile(lambda x: torch.tanh(x) * x, backend="eqfuse"), (x,))
    ref, ref_grads = _input_grads(lambda x: torch.tanh(x) * x, (x,))
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(grads[0], ref_grads[0])
    assert seen == [(False, False), (False, False)]  # the forward's validation, the backward's


def test_options_reach_eqfuse():
    torch._dynamo.reset()
    eqfuse.backend.history.clear()
    f = lambda x: torch.softmax(x, -1) * 2
    x = torch.randn(4, 16)
    out = torch.compile(f, backend="eqfuse", options={"max_enodes": 5})(x)
    torch.testing.assert_close(out, f(x))
    assert "e-node limit" in eqfuse.backend.history[-1].report["saturation"]["stop_reason"]


def test_training_graphs_replay_cuda_graphs_only_where_short_unless_asked():
    def graphs_options(**options):
        torch._dynamo.reset()
        eqfuse.backend.history.clear()
        x = torch.randn(4, 16, requires_grad=True)
        torch.compile(lambda x: torch.relu(x * 2), backend="eqfuse", options=options)(x).sum().backward()
        return [(g.options.cuda_graphs, g.options.cuda_graphs_under_us) for g in eqfuse.backend.history]
    short = eqfuse.backend.TRAINING_GRAPHS_UNDER_US
    assert graphs_options() == [(True, short), (True, short)]  # forward, backward
    assert graphs_options(cuda_graphs=True) == [(True, float("inf"))] * 2
    assert graphs_options(cuda_graphs=False) == [(False, float("inf"))] * 2


def test_recompute_saves_fewer_values_with_the_same_gradients():
    """options={"recompute": True}: AOTAutograd's min-cut partitioner has the backward
    recompute the pointwise values it needs (here gelu and sigmoid of x @ w1) from fewer
    saved ones; the gradients are eager's either way."""
    torch.manual_seed(0)

    def f(x, w1, w2):
        h = x @ w1
        return (torch.nn.functional.gelu(h) * torch.sigmoid(h)) @ w2

    inputs = (torch.randn(12, 16, requires_grad=True), torch.randn(16, 32, requires_grad=True),
              torch.randn(32, 8, requires_grad=True))
    ref_out, ref_grads = _input_grads(f, inputs)
    saved = {}
    for recompute in (False, True):
        torch._dynamo.reset()
        eqfuse.backend.history.clear()
        out, grads = _input_grads(torch.compile(f, backend="eqfuse", options={"recompute": recompute}), inputs)
        torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5)
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)
        saved[recompute] = len(eqfuse.backend.history[0].plan.outputs)
    assert saved[True] < saved[False], saved


def test_backward_of_split_chunk_and_slices_has_no_eager_step():
    """The backward of split / chunk / slicing (rotary embeddings, fused qkv projections) is
    slice_scatter into zeros: it compiles to kernels, and the gradients match eager."""
    torch._dynamo.reset()
    eqfuse.backend.history.clear()

    def f(x, w):
        q, k, v = (x @ w).chunk(3, dim=-1)
        a, b = q.split([3, 5], dim=-1)
        rot = torch.cat([-b, a], dim=-1) * k + x[..., 2:10] * v[..., :8]
        return rot[:, 1:].tanh()

    x = torch.randn(4, 6, 16, requires_grad=True)
    w = torch.randn(16, 24, requires_grad=True)
    out, grads = _input_grads(torch.compile(f, backend="eqfuse"), (x, w))
    ref, ref_grads = _input_grads(f, (x, w))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4)
    forward, backward = eqfuse.backend.history
    # slice_backward, which capture decomposes into slice_scatter over zeros
    assert any("slice_backward" in str(n.target) for n in backward.fn.graph.nodes), backward.fn.code
    assert backward.fallbacks == [] and forward.fallbacks == [], backward.explain()


def _fused_sdpa_graph(use_lse: bool):
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(q, k, v):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=True)
        return (out * 2, lse) if use_lse else out * 2
    q, k, v = (torch.randn(2, 3, 8, 4, device="cpu") for _ in range(3))  # the CPU op, on a GPU machine too
    return make_fx(f)(q, k, v), (q, k, v)


def test_fused_attention_op_is_made_plain_only_when_only_its_output_is_used():
    from eqfuse.frontend.capture import plain_fused_attention

    def fused(gm):
        return [n for n in gm.graph.nodes if "scaled_dot_product" in str(n.target)]
    gm, inputs = _fused_sdpa_graph(use_lse=False)
    plain = plain_fused_attention(gm)
    assert fused(gm) and not fused(plain)  # the original graph is left as it was
    torch.testing.assert_close(plain(*inputs), gm(*inputs), rtol=1e-5, atol=1e-6)
    gm, _ = _fused_sdpa_graph(use_lse=True)
    assert fused(plain_fused_attention(gm))  # the log-sum-exp is used: the op stays


def test_inference_attention_with_a_broadcast_bool_mask_is_one_kernel():
    """transformers passes a bool mask broadcast with zero strides under torch.compile (ViT:
    all True); AOTAutograd would trace torch's float32 math path with its safe softmax.
    It compiles to one attention kernel, and a row the mask leaves no key gives 0 as in
    eager (not NaN)."""
    q, k, v = (torch.randn(2, 3, 24, 8) for _ in range(3))
    keep = torch.rand(24, 24) > 0.2
    keep[5] = False  # query 5 sees no key

    def f(q, k, v, keep):
        mask = keep[None, None].expand(2, 1, 24, 24)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch._dynamo.reset()
    eqfuse.backend.history.clear()
    with torch.no_grad():
        got = torch.compile(f, backend="eqfuse")(q, k, v, keep)
    want = f(q, k, v, keep)
    torch.testing.assert_close(got, want)
    assert torch.equal(got[:, :, 5], torch.zeros_like(got[:, :, 5]))
    (graph,) = eqfuse.backend.history
    assert len(graph.kernels) == 1 and not graph.fallbacks, graph.explain()
    assert "attention" in graph.explain()


def test_plain_attention_keeps_the_fused_ops_layout():
    """flash writes [B, H, S, D] as [B, S, H, D] in memory; the graph may view through it."""
    from eqfuse.frontend.capture import _sdpa_output
    q, k, v = (torch.randn(2, 3, 8, 4) for _ in range(3))
    strides = torch.empty(2, 8, 3, 4).transpose(1, 2).stride()
    out = _sdpa_output(q, k, v, is_causal=True, strides=strides)
    assert out.stride() == strides
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
    out.transpose(1, 2).view(2, 8, 12)  # a view only that layout allows


def _relu_softmax(x, w):
    return torch.relu(x @ w).softmax(-1) * 2


def _sized_graphs(monkeypatch) -> list:
    """The sized graphs (runtime/sized_graph.py) the backend builds from here on."""
    import eqfuse.runtime.sized_graph as sized_graph

    made = []
    build = sized_graph.build

    def recorded(*args, **kwargs):
        made.append(build(*args, **kwargs))
        return made[-1]
    monkeypatch.setattr(sized_graph, "build", recorded)
    return made


def test_one_compile_then_a_sized_module_runs_every_size(monkeypatch):
    """The first size compiles as any graph; the second builds the sized module, whose
    kernels take the dynamic size at launch: no compile for any size after."""
    torch._dynamo.reset()
    eqfuse.backend.history.clear()
    sized = _sized_graphs(monkeypatch)
    w = torch.randn(16, 16)
    g = torch.compile(_relu_softmax, backend="eqfuse", dynamic=True)
    for n in (5, 7, 9, 33, 2, 7):  # (dynamo traces size 1 apart)
        x = torch.randn(n, 16)
        torch.testing.assert_close(g(x, w), _relu_softmax(x, w))
    assert len(eqfuse.backend.history) == 1 and eqfuse.backend.history[0].kernels
    (graph,) = sized
    source = graph.sized.source
    # The matmul's M and the softmax's row count are arguments, not constexprs
    assert "SIZE = in0.shape[0]" in source and "SizedLauncher(" in source
    assert ", R, C: tl.constexpr" in source and ", M, N: tl.constexpr" in source
    assert len(graph.sized.infos) == len(eqfuse.backend.history[0].kernels) == 2


def test_a_second_shape_stays_compiled_under_automatic_dynamic_shapes(monkeypatch):
    # dynamo recompiles the graph with symbolic sizes at the second shape it meets: that
    # one compiles, the third shape builds the sized module
    torch._dynamo.reset()
    eqfuse.backend.history.clear()
    sized = _sized_graphs(monkeypatch)
    w = torch.randn(16, 16)
    g = torch.compile(_relu_softmax, backend="eqfuse")
    for n in (5, 7, 9, 7, 12):
        x = torch.randn(n, 16)
        torch.testing.assert_close(g(x, w), _relu_softmax(x, w))
    assert [bool(h.kernels) for h in eqfuse.backend.history] == [True, True]
    assert len(sized) == 1


def _step(x, cache, w):
    # two sizes no guard ties: x's rows and a cache's, one longer in a decoder's steps
    return torch.relu(x @ w).softmax(-1) * 2, cache * 2 + 1


def test_sizes_that_move_by_one_step_are_one_size(monkeypatch):
    # x's rows and the cache's are two symbols, one apart: they move together, so one
    # sized module runs them all; where they part, that call compiles on its own
    torch._dynamo.reset()
    eqfuse.backend.history.clear()
    sized = _sized_graphs(monkeypatch)
    w = torch.randn(16, 16)
    g = torch.compile(_step, backend="eqfuse", dynamic=True)
    for n, c in ((5, 6), (7, 8), (9, 10), (33, 34), (12, 20), (2, 3)):
        x, cache = torch.randn(n, 16), torch.randn(c, 16)
        for got, want in zip(g(x, cache, w), _step(x, cache, w)):
            torch.testing.assert_close(got, want)
    assert len(sized) == 1 and sized[0].sized.size_offset in (0, 1)
    assert len(eqfuse.backend.history) == 2  # the first size and the one where they part


def test_sizes_of_two_dimensions_compile_per_shape(caplog):
    # Both of x's dimensions change: a sized module follows one, so each shape compiles
    torch._dynamo.reset()
    eqfuse.backend.history.clear()
    g = torch.compile(_relu_softmax, backend="eqfuse", dynamic=True)
    with caplog.at_level("INFO", logger="eqfuse"):
        for n, k in ((5, 16), (7, 12), (9, 12)):
            x, w = torch.randn(n, k), torch.randn(k, k)
            torch.testing.assert_close(g(x, w), _relu_softmax(x, w))
    assert "2 symbolic sizes changed since the first call" in caplog.text
    assert len(eqfuse.backend.history) == 3


def test_inputs_laid_out_otherwise_compile_for_themselves(monkeypatch):
    """The sized module runs the layouts it was made for: a transposed input at a new
    size is compiled for on its own, not read with the wrong strides."""
    torch._dynamo.reset()
    eqfuse.backend.history.clear()
    sized = _sized_graphs(monkeypatch)
    w = torch.randn(16, 16)
    g = torch.compile(lambda x, w: torch.relu(x * 2) @ w, backend="eqfuse", dynamic=True)
    for x in (torch.randn(5, 16), torch.randn(7, 16), torch.randn(16, 9).t()):
        torch.testing.assert_close(g(x, w), torch.relu(x * 2) @ w)
    assert len(sized) == 1 and not sized[0].accepts([torch.randn(16, 9).t(), w])


def test_shapes_past_the_limit_run_as_traced(monkeypatch, caplog):
    torch._dynamo.reset()
    eqfuse.backend.history.clear()
    monkeypatch.setattr(eqfuse.backend, "MAX_SHAPES", 1)
    g = torch.compile(_relu_softmax, backend="eqfuse", dynamic=True)
    with caplog.at_level("WARNING", logger="eqfuse"):
        for n, k in ((5, 16), (7, 12)):  # two sizes change: no sized module
            x, w = torch.randn(n, k), torch.randn(k, k)
            torch.testing.assert_close(g(x, w), _relu_softmax(x, w))
    assert len(eqfuse.backend.history) == 1
    assert "met more than 1 shapes: new ones run uncompiled" in caplog.text


def test_training_with_symbolic_sizes_matches_eager(caplog):
    # The forward returns sizes for the backward: its tensors compile, the sizes are
    # computed from each call's (backend._SizesOut); the backward compiles too
    torch._dynamo.reset()
    eqfuse.backend.history.clear()
    torch.manual_seed(0)
    w = torch.randn(16, 16, requires_grad=True)

    def f(x, w):  # gradients not all zero (a softmax's sum would give them so)
        return torch.relu(x @ w) * torch.sigmoid(x).sum(-1, keepdim=True)

    g = torch.compile(f, backend="eqfuse", dynamic=True)
    with caplog.at_level("WARNING", logger="eqfuse"):
        for n in (5, 7):
            x = torch.randn(n, 16, requires_grad=True)
            out, grads = _input_grads(g, (x, w))
            ref, ref_grads = _input_grads(f, (x, w))
            assert all(r.abs().max() > 0.1 for r in ref_grads)
            torch.testing.assert_close(out, ref)
            for a, b in zip(grads, ref_grads):
                torch.testing.assert_close(a, b)
    assert "uncompiled" not in caplog.text
    titles = [getattr(h.fn, "__name__", "") for h in eqfuse.backend.history]
    assert "forward" in titles and "backward" in titles, titles
    assert all(h.kernels for h in eqfuse.backend.history)


@pytest.mark.gpu
def test_training_steps_replay_cuda_graphs_around_eager_attention():
    """GPT-2's attention stays a fused eager op (cuDNN or flash) in training: with CUDA
    graphs asked for, both graphs still record it and replay, and every step's
    gradients match eager's (including steps whose gradients AccumulateGrad takes)."""
    from eqfuse.models import GPT2Block
    torch._dynamo.reset()
    eqfuse.backend.history.clear()
    torch.manual_seed(0)
    model = GPT2Block(hidden=64, heads=4).half()
    x = torch.randn(2, 128, 64, dtype=torch.float16, requires_grad=True)
    compiled = torch.compile(model, backend="eqfuse", options={"cuda_graphs": True, "autotune": False})
    for _ in range(4):
        ref_out, ref_grads = _grads(model, x)
        out, grads = _grads(compiled, x)
        torch.testing.assert_close(out, ref_out, rtol=2e-3, atol=2e-3)
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g, r, rtol=2e-2, atol=2e-2)
    forward, backward = eqfuse.backend.history
    assert forward.fallbacks and backward.fallbacks, backward.explain()  # the attention ops, in eager
    for g in (forward, backward):
        assert g._main.graphs.replays > 0, g._main.graphs.disabled


def test_history_titles_each_graph_by_its_kind():
    """Forward, backward and inference graphs say which they are (all were "GraphModule")."""
    torch._dynamo.reset()
    eqfuse.backend.history.clear()
    lin = torch.nn.Linear(8, 8)
    fn = torch.compile(lambda x: torch.relu(lin(x)).sum(), backend="eqfuse", options={"autotune": False})
    fn(torch.randn(4, 8)).backward()
    with torch.no_grad():
        torch._dynamo.reset()
        fn(torch.randn(4, 8))
    titles = [g.explain().splitlines()[0] for g in eqfuse.backend.history]
    assert [t.split(":")[0] for t in titles] == ["eqfuse plan for forward", "eqfuse plan for backward",
                                                 "eqfuse plan for inference"], titles


@pytest.mark.parametrize("mode, expected", [(None, {"autotune": False}), ("default", {"autotune": False}),
                                            ("max-autotune", {"autotune": True}),
                                            ("max-autotune-no-cudagraphs", {"autotune": True, "cuda_graphs": False}),
                                            ("reduce-overhead", {"autotune": False, "cuda_graphs": True})])
def test_torch_compile_modes_become_eqfuse_options(monkeypatch, mode, expected):
    """torch.compile(..., mode=) was ignored; its modes set eqfuse's options now (an option
    given beside wins), and a mode eqfuse does not know is named in an error."""
    import eqfuse as eqfuse_module
    seen = []
    real = eqfuse_module.compile
    monkeypatch.setattr(eqfuse_module, "compile", lambda fn, ex, **o: seen.append(o) or real(fn, ex, **o))
    torch._dynamo.reset()
    fn = torch.compile(lambda x: torch.relu(x) * 2, backend="eqfuse", mode=mode)
    with torch.no_grad():
        x = torch.randn(4, 8)
        torch.testing.assert_close(fn(x), torch.relu(x) * 2)
    assert seen and all(o.items() >= expected.items() for o in seen), seen


def test_an_unknown_mode_is_named():
    torch._dynamo.reset()
    fn = torch.compile(lambda x: x + 1, backend="eqfuse", mode="fastest-please")
    with pytest.raises(Exception, match="fastest-please"):
        fn(torch.randn(3))



def _dynamo_graph(f, *inputs) -> torch.fx.GraphModule:
    """dynamo's graph of ``f`` at ``inputs`` (as a backend receives it)."""
    graphs = []

    def keep(gm, _):
        graphs.append(gm)
        return gm
    torch._dynamo.reset()
    torch.compile(f, backend=keep)(*inputs)
    (gm,) = graphs
    return gm


def _masks(gm) -> list:
    from eqfuse.frontend.masks import _arguments, _sdpa
    return [_arguments(n)["attn_mask"] for n in gm.graph.nodes if _sdpa(n)]


def _masked_attention(make_mask):
    def f(q, k, v, x):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=make_mask(x))
    return f


MASKS_KEPT = {  # masks that mask something, or that are not constants of the graph
    "causal": lambda x: torch.ones(6, 6, dtype=torch.bool).tril(),
    "an input": lambda x: x > 0,
    "random, though all True": lambda x: torch.rand(6, 6) >= 0,  # dropping it would move later draws
    "a float bias": lambda x: torch.full((6, 6), -1.0),
}
MASKS_DROPPED = {
    "all True from index arithmetic": lambda x: (torch.arange(6) + 0 >= 0)[None, None, None, :].expand(2, 1, 6, 6),
    "zeros added": lambda x: torch.zeros(1, 1, 6, 6),
}


@pytest.mark.parametrize("name", list(MASKS_KEPT) + list(MASKS_DROPPED))
def test_a_constant_mask_that_keeps_every_key_is_dropped(name):
    """transformers builds an all-True mask under torch.compile where eager passes none
    (ViT); the fused attention refuses it, and AOTAutograd would trace the float32 math
    path. Such a mask (and only such) is dropped from dynamo's graph, the graph itself
    left as it was, and the attention computes what it did."""
    from eqfuse.frontend.masks import without_constant_masks
    q, k, v = (torch.randn(2, 3, 6, 4) for _ in range(3))
    x = torch.randn(6, 6)
    f = _masked_attention({**MASKS_KEPT, **MASKS_DROPPED}[name])
    gm = _dynamo_graph(f, q, k, v, x)
    rng = torch.get_rng_state()
    out = without_constant_masks(gm)
    assert torch.equal(torch.get_rng_state(), rng)  # computing the mask drew nothing from the user's stream
    assert all(m is not None for m in _masks(gm))
    if name in MASKS_KEPT:
        assert out is gm
        return
    assert _masks(out) == [None]
    assert not [n for n in out.graph.nodes if n.op == "call_function" and n.target is torch.arange]
    kept = len([n for n in out.graph.nodes if n.op == "placeholder"])  # dynamo leaves out an unread x
    torch.testing.assert_close(out(*(q, k, v, x)[:kept])[0], f(q, k, v, x), rtol=1e-5, atol=1e-6)


def test_training_attention_with_an_all_true_mask_matches_eager():
    """Through the backend in a training step: values and gradients as eager's."""
    f = _masked_attention(MASKS_DROPPED["all True from index arithmetic"])
    leaves = [torch.randn(2, 3, 6, 4, requires_grad=True) for _ in range(3)]
    x = torch.randn(6, 6)
    torch._dynamo.reset()
    got = torch.compile(f, backend="eqfuse")(*leaves, x)
    got_grads = torch.autograd.grad(got.square().sum(), leaves)
    want = f(*leaves, x)
    want_grads = torch.autograd.grad(want.square().sum(), leaves)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_torch_logs_eqfuse_prints_what_became_of_each_graph():
    """``TORCH_LOGS="eqfuse"``, torch's own switch: a line per graph and its eager steps;
    ``+eqfuse`` adds the plan in words and the generated source."""
    import subprocess
    import sys

    program = ("import torch, eqfuse\n"
               "f = torch.compile(lambda x: torch.relu(x) * 2, backend='eqfuse')\n"
               "f(torch.randn(8, 16))\n")
    def stderr(setting):
        run = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300,
                             env={**os.environ, "TORCH_LOGS": setting})
        assert run.returncode == 0, run.stderr[-2000:]
        return run.stderr

    info = stderr("eqfuse")
    assert "eqfuse: inference graph: 1 kernel(s), 0 eager step(s)" in info and "@triton.jit" not in info, info
    debug = stderr("+eqfuse")
    assert "eqfuse plan for inference" in debug and "@triton.jit" in debug, debug[-2000:]


def test_torch_trace_holds_the_plan_and_the_code_for_tlparse(tmp_path):
    """``TORCH_TRACE=dir``: eqfuse's plan and generated module as artifacts of the
    structured trace, beside dynamo's."""
    import subprocess
    import sys

    program = ("import torch, eqfuse\n"
               "f = torch.compile(lambda x: torch.relu(x) * 2, backend='eqfuse')\n"
               "f(torch.randn(8, 16))\n")
    run = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TORCH_TRACE": str(tmp_path)})
    assert run.returncode == 0, run.stderr[-2000:]
    trace = "".join(p.read_text() for p in tmp_path.iterdir())
    assert '"name": "eqfuse_plan"' in trace and '"name": "eqfuse_output_code"' in trace, trace[-2000:]
    assert "eqfuse plan for inference" in trace and "@triton.jit" in trace
