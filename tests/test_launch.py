"""Launching compiled graphs: the direct kernel launcher and CUDA graph replay."""

import pytest
import torch
from conftest import assert_matches

import eqfuse

gpu = pytest.mark.gpu


def scale_shift(x, y):
    return torch.relu(x * 2.0 + y)


def two_outputs(x, y):
    s = x + y
    return s, torch.softmax(s, -1)


def test_generated_module_launches_through_kernel_launchers():
    x, y = torch.randn(8, 33), torch.randn(8, 33)
    compiled = eqfuse.compile(scale_shift, (x, y))
    (k,) = compiled.kernels
    assert f"{k.name}_launch = KernelLauncher({k.name}, {k.grid!r}" in compiled.source
    assert f"    {k.name}_launch(" in compiled.source
    assert_matches(compiled(x, y), scale_shift(x, y))


def test_tuple_outputs_keep_their_structure_on_every_call():
    x, y = torch.randn(4, 17), torch.randn(4, 17)
    compiled = eqfuse.compile(two_outputs, (x, y))
    for _ in range(3):
        got = compiled(x, y)
        assert isinstance(got, tuple)
        assert_matches(got, two_outputs(x, y))


def test_a_deferred_launcher_runs_its_twin_until_it_is_ready():
    """A template still compiling (parallel_compile._deferrable) gives way to its twin,
    and runs itself once it is ready."""
    x, y = torch.randn(8, 33), torch.randn(8, 33)
    compiled = eqfuse.compile(scale_shift, (x, y))
    (k,) = compiled.kernels
    launcher = getattr(compiled._main.module, f"{k.name}_launch")
    twin_calls = []
    launcher.otherwise = lambda *tensors: twin_calls.append(len(tensors))
    launcher.deferred = True
    compiled(x, y)
    assert twin_calls == [3]  # x, y and the output
    launcher.deferred = False
    assert_matches(compiled(x, y), scale_shift(x, y))
    assert twin_calls == [3]


def test_on_checked_is_told_once_the_kernel_itself_has_run():
    x, y = torch.randn(8, 33), torch.randn(8, 33)
    compiled = eqfuse.compile(scale_shift, (x, y))
    (k,) = compiled.kernels
    launcher = getattr(compiled._main.module, f"{k.name}_launch")
    told = []
    launcher._compiled.clear()  # never launched, as a template deferred from the start (on a GPU)
    launcher.otherwise = lambda *tensors: None
    launcher.on_checked = lambda: told.append(1)
    launcher.deferred = True
    compiled(x, y)  # the twin: nothing checked yet
    assert told == []
    launcher.deferred = False
    for _ in range(2):
        assert_matches(compiled(x, y), scale_shift(x, y))
    assert told == [1] and launcher.on_checked is None


def test_a_failing_on_checked_does_not_fail_the_call():
    x, y = torch.randn(8, 33), torch.randn(8, 33)
    compiled = eqfuse.compile(scale_shift, (x, y))
    (k,) = compiled.kernels
    launcher = getattr(compiled._main.module, f"{k.name}_launch")
    launcher._compiled.clear()
    launcher.on_checked = lambda: 1 / 0
    assert_matches(compiled(x, y), scale_shift(x, y))


def test_the_plan_is_stored_once_every_template_has_run(monkeypatch):
    from types import SimpleNamespace

    from eqfuse import pipeline
    stored = []
    monkeypatch.setattr(pipeline, "_store_plan", lambda key, result: stored.append(key))
    a, b = SimpleNamespace(on_checked=None), SimpleNamespace(on_checked=None)
    result = {"report": {"plan_cache": {"stored": False, "not_stored": "a, b still compiling"}}}
    pipeline._store_once_run("key", result, {"a": a, "b": b})
    a.on_checked()
    assert stored == []
    b.on_checked()
    assert stored == ["key"] and "not_stored" not in result["report"]["plan_cache"]


@gpu
def test_misaligned_input_gets_its_own_specialisation():
    """Triton specialises pointers on 16-byte alignment; the direct launcher must not reuse
    an aligned kernel for a tensor that starts 4 bytes into its storage."""
    base = torch.randn(4097, device="cuda")
    aligned, shifted = torch.randn(4096, device="cuda"), base[1:]
    y = torch.randn(4096, device="cuda")
    compiled = eqfuse.compile(scale_shift, (aligned, y), cuda_graphs=False)
    for x in (aligned, shifted, aligned, shifted):
        assert_matches(compiled(x, y), scale_shift(x, y))


@gpu
def test_replays_are_correct_while_earlier_outputs_are_held():
    x, y = torch.randn(64, 1000, device="cuda"), torch.randn(64, 1000, device="cuda")
    compiled = eqfuse.compile(scale_shift, (x, y))
    replayer = compiled._main.graphs
    assert replayer is not None
    held, expected = [], []
    for _ in range(5):
        x.copy_(torch.randn_like(x))  # same address, new values: the recording must read them
        expected.append(scale_shift(x, y))
        held.append(compiled(x, y))
    for got, ref in zip(held, expected):
        assert_matches(got, ref)
    # call 1 launched, 2 and 3 recorded one graph each, 4 and 5 found both graphs' outputs held
    assert replayer.replays == 2
    assert len({o.data_ptr() for o in held}) == 5
    held.clear()
    compiled(x, y)
    assert replayer.replays == 3


@gpu
def test_a_held_view_of_an_output_keeps_it_from_being_overwritten():
    x, y = torch.randn(64, 1000, device="cuda"), torch.randn(64, 1000, device="cuda")
    compiled = eqfuse.compile(scale_shift, (x, y))
    views = []
    for _ in range(4):
        x.copy_(torch.randn_like(x))
        ref = scale_shift(x, y)[3]
        views.append((compiled(x, y)[3], ref))  # only a view of the output survives
    for got, ref in views:
        assert_matches(got, ref)


def _returns_its_input(x, y):
    return torch.relu(x * 2.0 + y), x, x[3]


@gpu
def test_outputs_that_are_inputs_are_each_calls_own_and_not_kept():
    """A graph that returns an input or a view of one (a training forward saving it for
    its backward) returns those of each call's inputs, and its recording keeps none of
    them: kept, the tensor of the recorded call would hold the memory of the recording
    that made it, which then never replays again."""
    import weakref
    base, y = torch.randn(64, 1000, device="cuda"), torch.randn(64, 1000, device="cuda")
    compiled = eqfuse.compile(_returns_its_input, (base.view(64, 1000), y))
    for _ in range(5):
        base.copy_(torch.randn_like(base))
        x = base.view(64, 1000)  # the same memory, another tensor each call
        out, same, row = compiled(x, y)
        assert same.data_ptr() == x.data_ptr() and row.data_ptr() == x[3].data_ptr() and row.stride() == (1,)
        assert_matches(out, _returns_its_input(x, y)[0])
        gone = weakref.ref(x)
        del x, out, same, row
        assert gone() is None
    assert compiled._main.graphs.replays == 4


@gpu
def test_loop_reassigning_its_output_replays():
    x, y = torch.randn(64, 1000, device="cuda"), torch.randn(64, 1000, device="cuda")
    compiled = eqfuse.compile(two_outputs, (x, y))
    out = None
    for _ in range(6):
        out = compiled(x, y)
    assert compiled._main.graphs.replays == 5
    assert_matches(out, two_outputs(x, y))


@gpu
def test_new_addresses_launch_without_recording():
    y = torch.randn(64, 1000, device="cuda")
    xs = [torch.randn(64, 1000, device="cuda") for _ in range(4)]
    compiled = eqfuse.compile(scale_shift, (xs[0], y))
    for x in xs:
        assert_matches(compiled(x, y), scale_shift(x, y))
    assert compiled._main.graphs.replays == 0


@gpu
def test_call_inside_the_callers_own_cuda_graph_is_recorded_there():
    x, y = torch.randn(64, 1000, device="cuda"), torch.randn(64, 1000, device="cuda")
    compiled = eqfuse.compile(scale_shift, (x, y))
    compiled(x, y)
    compiled(x, y)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = compiled(x, y)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert_matches(out, scale_shift(x, y))


@gpu
def test_cuda_graphs_off_never_replays():
    x, y = torch.randn(64, 1000, device="cuda"), torch.randn(64, 1000, device="cuda")
    compiled = eqfuse.compile(scale_shift, (x, y), cuda_graphs=False)
    for _ in range(3):
        assert_matches(compiled(x, y), scale_shift(x, y))
    assert compiled._main.graphs is None


def _step(target, *args, **kwargs):
    from eqfuse.schema.plan import FallbackStep
    return FallbackStep("n", target, args, kwargs, "no kernel form", ["b"], False)


def test_only_eager_steps_that_keep_to_the_stream_are_recorded():
    from eqfuse.runtime.graphs import unrecordable
    from eqfuse.schema.from_fx import EagerCall

    aten = torch.ops.aten
    cudnn = aten._scaled_dot_product_cudnn_attention.default
    assert unrecordable([]) is None
    assert unrecordable([_step(cudnn, "q", "k", "v", None, True)]) is None
    assert unrecordable([_step(cudnn, "q", "k", "v", None, True, 0.0)]) is None
    wrapped = EagerCall(cudnn, (None,) * 5, (), (None, None))  # with eager's layouts: the same op
    assert unrecordable([_step(wrapped, "q", "k", "v", None, True)]) is None
    assert "dropout" in unrecordable([_step(cudnn, "q", "k", "v", None, True, 0.1)])
    flash = aten._scaled_dot_product_flash_attention.default
    assert "dropout" in unrecordable([_step(flash, "q", "k", "v", dropout_p=0.5)])
    reason = unrecordable([_step(aten.index_select.default, "x", 0, "i"), _step(aten.nonzero.default, "x")])
    assert "nonzero" in reason and "wait for the GPU" in reason
    fixed_size = [_step(aten.convolution.default, "x", "w", None, [16, 16], [0, 0], [1, 1], False, [0, 0], 1),
                  _step(aten.cumsum.default, "x", 1), _step(aten.topk.default, "x", 2), _step(aten.sort.default, "x")]
    assert unrecordable(fixed_size) is None
    assert "wait for the GPU" in unrecordable([*fixed_size, _step(aten.masked_select.default, "x", "m")])


def test_indexing_and_the_embedding_backward_are_recorded_unless_they_read_on_the_host():
    from eqfuse.runtime.graphs import unrecordable
    from eqfuse.schema.eager_steps import substituted
    from eqfuse.schema.plan import BufArg
    from eqfuse.schema.values import BufRef

    aten = torch.ops.aten
    rows, mask = BufRef("rows", (4,), (1,), 0), BufArg("mask")
    dtypes = {"x": "float32", "rows": "int64", "mask": "bool"}
    assert unrecordable([_step(aten.index.Tensor, "x", [None, rows])], dtypes) is None
    assert "nonzero" in unrecordable([_step(aten.index.Tensor, "x", [mask])], dtypes)
    assert "nonzero" in unrecordable([_step(aten.index.Tensor, "x", [BufArg("unknown")])], dtypes)
    backward = substituted(aten.embedding_dense_backward.default)
    assert unrecordable([_step(backward, "g", "i", 10, -1, False)]) is None
    assert "scale_grad_by_freq" in unrecordable([_step(backward, "g", "i", 10, -1, True)])


def _attention_with_lse(q, k, v):
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True)[:2]
    return out * 2.0, lse + 1.0


@gpu
def test_graph_with_a_recordable_eager_step_replays():
    q, k, v = (torch.randn(2, 4, 64, 32, device="cuda", dtype=torch.float16) for _ in range(3))
    compiled = eqfuse.compile(_attention_with_lse, (q, k, v))
    assert compiled.fallbacks, compiled.explain()  # the fused op stays: its log-sum-exp is used
    for _ in range(4):
        assert_matches(compiled(q, k, v), _attention_with_lse(q, k, v))
    assert compiled._main.graphs.replays > 0
    q.copy_(torch.randn_like(q))  # a replay reads the inputs as they are now
    assert_matches(compiled(q, k, v), _attention_with_lse(q, k, v))


@gpu
def test_graph_with_an_eager_step_that_may_sync_launches_kernel_by_kernel():
    x = torch.randn(64, 100, device="cuda")
    f = lambda x: torch.histc(torch.relu(x), bins=8) * 2.0  # noqa: E731 - histc: no kernel form, not listed
    compiled = eqfuse.compile(f, (x,))
    assert compiled.fallbacks and compiled._main.graphs is None
    assert "no CUDA graphs: its eager step" in compiled.explain()
    for _ in range(3):
        assert_matches(compiled(x), f(x))


def _four_products(x, w1, w2, w3, w4):
    return torch.relu(torch.relu(torch.relu(x @ w1) @ w2) @ w3) @ w4


@gpu
def test_an_input_that_moves_between_calls_is_copied_in():
    """Weights stay, the batch is a new tensor each call: the batch is copied into the
    recording's own buffer and the rest replays."""
    ws = [torch.randn(256, 256, device="cuda") / 16 for _ in range(4)]
    xs = [torch.randn(32, 256, device="cuda") for _ in range(5)]
    compiled = eqfuse.compile(_four_products, (xs[0], *ws))
    assert len(compiled.kernels) >= 4, compiled.explain()
    for x in xs:
        assert_matches(compiled(x, *ws), _four_products(x, *ws), contraction=True)
    replayer = compiled._main.graphs
    assert replayer.copied == (0,) and replayer.replays == len(xs) - 1
    xs[-1].copy_(torch.randn_like(xs[-1]))  # a replay copies the input as it is now
    assert_matches(compiled(xs[-1], *ws), _four_products(xs[-1], *ws), contraction=True)
    w = torch.randn_like(ws[0])  # a weight that moves too: a new set of addresses
    assert_matches(compiled(xs[0], w, *ws[1:]), _four_products(xs[0], w, *ws[1:]), contraction=True)


def test_only_inputs_that_do_not_overlap_themselves_are_copied_in():
    from eqfuse.runtime.graphs import _copyable
    x = torch.arange(68.0).reshape(4, 17)
    inputs = (x[:, :-1], torch.zeros(3).expand(4, 3), x.t(), x)
    assert _copyable(inputs, (0,), 2, 10**6) and _copyable(inputs, (2,), 2, 10**6)  # a slice, a transpose
    assert not _copyable(inputs, (1,), 2, 10**6)  # expanded: its elements share addresses
    assert not _copyable(inputs, (0, 2), 1, 10**6)  # more inputs than the graph's launches pay for
    assert not _copyable(inputs, (0,), 2, 100)  # more bytes than the budget
    assert not _copyable(inputs, (0, 1, 2, 3), 4, 10**6)  # every input moved: nothing stays to key on


@gpu
def test_an_input_returned_as_a_view_is_not_copied_in():
    """The output must be a view of the caller's tensor, not of a recording's copy."""
    def f(x, *ws):
        return _four_products(x, *ws), x.t()
    ws = [torch.randn(256, 256, device="cuda") / 16 for _ in range(4)]
    xs = [torch.randn(32, 256, device="cuda") for _ in range(4)]
    compiled = eqfuse.compile(f, (xs[0], *ws))
    for x in xs:
        out, view = compiled(x, *ws)
        assert view.data_ptr() == x.data_ptr()
        assert_matches(out, _four_products(x, *ws), contraction=True)
    assert compiled._main.graphs.copied == () and compiled._main.graphs.disabled is None


class _FakeCudaGraph:
    """A stand-in for torch.cuda.CUDAGraph on the CPU: what is launched while it records
    is launched again by replay(), into the recorded outputs."""
    recording = None

    def __init__(self):
        self.launches = []

    def replay(self):
        for fn, args, out in self.launches:
            out.copy_(fn(*args))


class _fake_capture:
    def __init__(self, graph):
        self.graph = graph

    def __enter__(self):
        _FakeCudaGraph.recording = self.graph

    def __exit__(self, *exc):
        _FakeCudaGraph.recording = None


def _product(cache, w):
    out = cache @ w
    if _FakeCudaGraph.recording is not None:
        _FakeCudaGraph.recording.launches.append((torch.matmul, (cache, w), out))
    return [out]


def test_a_new_set_of_addresses_lets_go_of_the_least_recently_used_one(monkeypatch):
    """transformers' static cache is new tensors on each generate() call, used for every
    token of that call and then never again: a replayer that kept its first ADDRESS_SETS
    sets launched kernel by kernel from the fifth call on. A new set lets go of the least
    recently used one whose outputs no one holds."""
    from eqfuse.runtime import graphs

    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeCudaGraph)
    monkeypatch.setattr(torch.cuda, "graph", _fake_capture)
    monkeypatch.setattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: False, raising=False)
    replayer = graphs.GraphReplayer(_product)
    w = torch.randn(4, 4)
    caches = [torch.randn(4, 4) for _ in range(graphs.ADDRESS_SETS + 2)]
    held = None
    for n, cache in enumerate(caches):
        for _ in range(3):  # the first call launches, the second records, the third replays
            cache.add_(1.0)
            (out,) = replayer((cache, w))
            torch.testing.assert_close(out, cache @ w)
            if n == 1:
                held = out  # the caller keeps an output of the second set: it stays
            del out
    assert replayer.replays == 2 * len(caches)
    assert len(replayer._recordings) == graphs.ADDRESS_SETS
    assert (caches[1].data_ptr(), w.data_ptr()) in replayer._recordings
    assert (caches[0].data_ptr(), w.data_ptr()) not in replayer._recordings
    torch.testing.assert_close(held, caches[1] @ w)


@gpu
def test_a_replayed_gradient_becomes_the_parameters_grad_without_a_copy():
    """autograd makes a gradient the parameter's .grad only where nothing else holds its
    tensor, and copies it otherwise: a replay hands out new tensors over the recording's
    memory, so that .grad is the recording's buffer itself, and the backward replays
    again once zero_grad lets go of it."""
    import eqfuse.backend

    torch._dynamo.reset()
    eqfuse.backend.history.clear()
    w = torch.nn.Parameter(torch.randn(64, 96, device="cuda"))
    x = torch.randn(32, 64, device="cuda")
    f = torch.compile(lambda x: torch.relu(x @ w).square().sum(), backend="eqfuse")
    want = (2 * x.T @ torch.relu(x @ w)).detach()
    for _ in range(5):
        w.grad = None  # zero_grad(set_to_none=True)
        f(x).backward()
        torch.testing.assert_close(w.grad, want, rtol=1e-4, atol=1e-4)
    backward = eqfuse.backend.history[-1]
    replayer = backward._main.graphs
    assert replayer is not None and replayer.replays >= 2, backward.explain()
    recorded = {s.data_ptr() for recs in replayer._recordings.values() for rec in recs for s in rec.storages}
    assert w.grad.untyped_storage().data_ptr() in recorded  # adopted, not copied
