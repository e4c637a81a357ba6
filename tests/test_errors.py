"""Bad input gets a clear error, or an eager fallback with a one-line reason."""

import warnings

import pytest
import torch
from conftest import assert_matches, sorted_along
from torch.fx.experimental.symbolic_shapes import statically_known_true

import eqfuse
from eqfuse import CaptureError, EqfuseError
from eqfuse.frontend.capture import capture


def test_shapes_that_do_not_broadcast():
    with pytest.raises(CaptureError, match=r"could not trace.*broadcast a dimension of length 4"):
        eqfuse.compile(lambda a, b: a + b, (torch.randn(2, 3), torch.randn(2, 4)))


def test_complex_dtype_runs_in_eager_with_reason():
    x = torch.randn(4, 4, dtype=torch.complex64)
    c = eqfuse.compile(lambda x: x * 2, (x,))
    assert c.kernels == []
    assert len(c.fallbacks) == 1 and "complex64" in c.fallbacks[0].reason
    assert torch.equal(c(x), x * 2)


def test_unsupported_op_falls_back_and_the_rest_fuses():
    def f(x):
        y = torch.exp(x) + 1
        z = sorted_along(y, -1)
        return torch.relu(z) * 2
    x = torch.randn(4, 8)
    c = eqfuse.compile(f, (x,))
    assert_matches(c(x), f(x))
    assert [fb.node for fb in c.fallbacks] == ["sorted_along"]
    assert "sorted_along" in c.fallbacks[0].reason
    assert len(c.kernels) == 2


def test_an_integer_power_of_integers_falls_back_with_its_reason():
    """A float tensor to a tensor power is a kernel (tests/test_ops.py); integers to an
    integer power have no kernel form and run as an eager step, the rest compiled."""
    f = lambda x, y: (x ** y) * 2  # noqa: E731
    x, y = torch.randint(-3, 4, (5, 5)), torch.randint(0, 4, (5, 5))
    c = eqfuse.compile(f, (x, y))
    assert torch.equal(c(x, y), f(x, y))
    assert any("pow" in fb.reason for fb in c.fallbacks), c.explain()


def test_new_shape_at_call_time_recompiles():
    f = lambda x: torch.softmax(x, -1)
    c = eqfuse.compile(f, (torch.randn(4, 8),))
    y = torch.randn(3, 5)
    assert_matches(c(y), f(y))
    assert c.kernels[0].constexprs["C"] == 8  # the first compile is unchanged


@pytest.mark.parametrize("bad, named", [(2.0, "a float"), (3, "an int")])
def test_non_tensor_input_is_a_clear_error(bad, named):
    with pytest.raises(EqfuseError, match=f"input 1 is {named}; pass tensors"):
        eqfuse.compile(lambda x, s: x * s, (torch.randn(3), bad))


def test_unknown_option_is_a_clear_error():
    with pytest.raises(TypeError, match="unknown eqfuse option"):
        eqfuse.compile(lambda x: x, (torch.randn(3),), max_nodes=3)


@pytest.mark.parametrize("bad", [None, 3, 2.5, [1.0, 2.0], "x"])
def test_calling_with_a_non_tensor_names_the_input(bad):
    x = torch.randn(4, 8)
    c = eqfuse.compile(lambda x, y: x * y, (x, x))
    with pytest.raises(EqfuseError, match=rf"input 1 is an? {type(bad).__name__}: a compiled graph takes tensors"):
        c(x, bad)


def test_a_bare_tensor_as_example_inputs_is_a_clear_error():
    with pytest.raises(EqfuseError, match=r"example_inputs is a Tensor; pass a tuple"):
        eqfuse.compile(lambda x: x * 2, torch.randn(4, 8))


@pytest.mark.parametrize("option, value, message", [
    ("max_enodes", "many", "expected a positive number"), ("max_seconds", -1, "expected a positive number"),
    ("max_enodes", True, "expected a positive number"), ("autotune", "yes", "expected True or False"),
    ("rules", ("nonexistent",), r"unknown ruleset 'nonexistent' \(rulesets: algebra, fusion, views\)"),
])
def test_an_option_of_the_wrong_kind_is_named(option, value, message):
    with pytest.raises(EqfuseError, match=rf"option {option}=.*: {message}"):
        eqfuse.compile(lambda x: x * 2, (torch.randn(4, 8),), **{option: value})


def test_a_returned_shape_is_a_torch_size():
    x = torch.randn(3, 4)
    c = eqfuse.compile(lambda x: (x * 2, {"shape": x.shape}, [x.shape[1:]]), (x,))
    _, shapes, (tail,) = c(x)
    assert type(shapes["shape"]) is torch.Size and shapes["shape"] == x.shape
    assert type(tail) is torch.Size and tail == (4,)


@pytest.mark.parametrize("shape", [(1,), ()])
def test_logical_ops_with_a_one_element_operand(shape):
    """A bool of one element broadcast against a block: Triton's interpreter refused & on them."""
    a, b = torch.randn(shape), torch.randn(5)

    def f(a, b):
        return (a > 0) & (b > 0), (a > 0) | (b > 0), (a > 0) ^ (b > 0), torch.logical_and(b > 0, a < 0)
    for sign in (1, -1):
        c = eqfuse.compile(f, (a * sign, b))
        assert c.kernels and not c.fallbacks, c.explain()
        for got, want in zip(c(a * sign, b), f(a * sign, b)):
            assert torch.equal(got, want)


@pytest.mark.parametrize("momentum", [0.1, None])
def test_compiling_a_training_batchnorm_leaves_its_statistics_as_they_were(momentum):
    """Compiling traces and checks the module; neither may advance its running statistics
    (tracing on fake inputs added 1 to the real num_batches_tracked). Each call then
    updates them as an eager call does, in its kernels' rounding: the statistics are
    written into the module's buffers by the compiled graph (frontend/writes.py)."""
    torch.manual_seed(0)
    m = torch.nn.BatchNorm1d(4, momentum=momentum).train()
    twin = torch.nn.BatchNorm1d(4, momentum=momentum).train()
    x = torch.randn(8, 4)
    c = eqfuse.compile(m, (x,))
    for b, t in zip(m.buffers(), twin.buffers()):
        assert torch.equal(b, t)
    assert_matches(c(x), twin(x))
    for b, t in zip(m.buffers(), twin.buffers()):
        torch.testing.assert_close(b, t, rtol=1e-5, atol=1e-6)
    # (the running statistics copied in, the count of batches advanced by add_)
    assert c.kernels and {w.op for w in c.input_writes} <= {"copy_", "add_"}, c.explain()


def test_a_replaced_parameter_is_read_and_an_updated_one_too():
    torch.manual_seed(0)
    m = torch.nn.Linear(8, 4)
    x = torch.randn(3, 8)
    with torch.no_grad():
        c = eqfuse.compile(m, (x,))
        m.weight.mul_(2.0)  # in place: the compiled graph reads the same tensor
        assert_matches(c(x), m(x))
        m.weight = torch.nn.Parameter(torch.randn(4, 8))  # replaced: compiled again
        assert_matches(c(x), m(x))
        assert c.kernels


def test_compiling_a_module_that_needs_gradients_warns_that_none_are_computed():
    m = torch.nn.Linear(8, 4)
    with pytest.warns(UserWarning, match="eqfuse.compile computes no gradients"):
        eqfuse.compile(m, (torch.randn(3, 8),))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        eqfuse.compile(m, (torch.randn(3, 8),))


def _add_in_place(x):
    y = x * 2
    y.add_(1)
    return y


def _mul_through_a_view(x):
    y = x * 1
    y[:2].mul_(3)  # changes y
    return y + 1


@pytest.mark.parametrize("f", [_add_in_place, _mul_through_a_view,
                               lambda x: torch.nn.functional.rms_norm(x, (3,), torch.ones(3) * 2)])
def test_an_in_place_op_on_an_intermediate_compiles_as_its_functional_form(f):
    """Traced through functionalisation (rms_norm's decomposition adds eps in place: the
    graph ran in eager)."""
    x = torch.randn(4, 3)
    c = eqfuse.compile(f, (x,))
    assert c.kernels and not c.fallbacks, c.explain()
    assert_matches(c(x), f(x))


def test_an_in_place_op_on_an_input_compiles_and_writes_the_input_once():
    """The write into the input is the graph's last step (after every read of the old
    value); compiling, which checks the plan, leaves the example input alone."""
    def f(x, y):
        z = x * y  # reads x before the write
        x.add_(1)
        return x * 2 + z
    x, y = torch.randn(3, 3), torch.randn(3, 3)
    example = x.clone()
    c = eqfuse.compile(f, (example, y))
    assert torch.equal(example, x)
    mine, theirs = x.clone(), x.clone()
    assert_matches(c(mine, y), f(theirs, y))
    assert torch.equal(mine, theirs)  # the input changed once, as in eager
    assert c.kernels and not c.fallbacks, c.explain()
    assert [w.op for w in c.input_writes] == ["copy_"], c.explain()


def test_an_in_place_op_on_a_value_of_the_graph_runs_the_graph_in_eager(monkeypatch):
    """A mutation that is not a write into an input (one functionalisation leaves: here
    made to fail) sends the graph to eager, with the reason."""
    from eqfuse.frontend import capture

    monkeypatch.setattr(capture, "_functionalised", lambda gm, inputs: gm)

    def f(x):
        y = x * 2
        y.add_(1)
        return y
    x = torch.randn(3, 3)
    c = eqfuse.compile(f, (x,))
    assert_matches(c(x), f(x))
    assert c.fallbacks and "in-place op" in c.fallbacks[0].reason, c.explain()


@pytest.mark.parametrize("f, make, steps, kernels", [
    (lambda x: x.exp() + 1, lambda: (torch.randn(0, 7),), {}, 0),
    (lambda x: x[:, :0].sum(-1) + x[:, 0], lambda: (torch.randn(3, 5),),
     {"sum_1": "reads slice_1, which has no elements (shape (3, 0))"}, 1),
    (lambda x: x[x > 0].sum() * 2, lambda: (torch.randn(8),),
     {"index": "a tensor whose shape is known only at run time",
      "sum_1": "reads index, a tensor whose shape is known only at run time"}, 2),
    (lambda x: (x * 2).to_dense().exp(), lambda: (torch.randn(4, 4, device="cpu").to_sparse(),),
     {"mul": "a torch.sparse_coo tensor (eqfuse kernels take strided ones)", "_to_dense": "no kernel form"}, 1),
], ids=["empty-input", "empty-slice", "boolean-mask", "sparse"])
def test_nodes_kernels_cannot_run_are_eager_steps_and_the_rest_compiles(f, make, steps, kernels, caplog):
    """Each sent the whole graph to eager (an internal error, a failed check, or a rule on
    the whole graph): now only the node a kernel cannot compute (a shape known at run
    time, a sparse tensor) or read is an eager step, with its reason in one line, a
    tensor with no elements is an empty allocation, and the rest compiles."""
    inputs = make()
    c = eqfuse.compile(f, inputs)
    empty = {n.name for n in capture(f, inputs).gm.graph.nodes if n.op == "call_function"
             and isinstance(n.meta.get("val"), torch.Tensor) and statically_known_true(n.meta["val"].numel() == 0)}
    assert set(c.empty_tensors) == empty, c.explain()
    got_steps = {fb.node: fb.reason for fb in c.fallbacks}
    assert set(got_steps) == set(steps), c.explain()
    for node, reason in steps.items():
        assert reason in got_steps[node] and "\n" not in got_steps[node], got_steps
    assert len(c.kernels) == kernels, c.explain()
    assert not c.report.get("note") and not [r for r in caplog.records if "internal error" in r.getMessage()]
    got, want = c(*inputs), f(*inputs)
    assert_matches(got, want)


def test_a_random_op_runs_in_eager_in_its_place_and_the_rest_fuses():
    """rand_like has no kernel form: it runs in eager where it stands, and draws what eager
    draws from the same seed. The check against eager seeds both of its runs alike (it
    failed before, having drawn other numbers, and the whole graph ran in eager)."""
    def f(x):
        return torch.exp(x) * 2 + torch.rand_like(x)
    x = torch.randn(6, 5)
    c = eqfuse.compile(f, (x,))
    assert [fb.node for fb in c.fallbacks] == ["rand_like"] and c.kernels, c.report
    torch.manual_seed(7)
    got = c(x)
    torch.manual_seed(7)
    assert_matches(got, f(x))


def test_an_empty_tensor_no_kernel_computes_still_compiles():
    """A generation step's empty cache, concatenated with the new keys: the kernel skips it.
    An empty tensor only an eager op reads (as an eager op may return one it leaves
    unfilled) is the eager op's business: the rest still fuses."""
    def cached(past, new):
        return torch.cat([past, new], 1) * 2
    past, new = torch.randn(2, 0, 4), torch.randn(2, 3, 4)
    c = eqfuse.compile(cached, (past, new))
    assert len(c.kernels) == 1 and not c.fallbacks
    assert_matches(c(past, new), cached(past, new))

    def eager_reads(x, e):
        return x.exp() * 2, sorted_along(e, 0)
    x, e = torch.randn(5), torch.randn(0)
    c = eqfuse.compile(eager_reads, (x, e))
    assert len(c.kernels) == 1 and [fb.node for fb in c.fallbacks] == ["sorted_along"], c.report
    assert_matches(c(x, e), eager_reads(x, e))


def test_saturation_limit_is_reported_and_result_still_correct():
    from eqfuse.examples import rmsnorm
    x, w = torch.randn(4, 8), torch.rand(8)
    c = eqfuse.compile(rmsnorm, (x, w), max_enodes=5)
    assert "e-node limit" in c.report["saturation"]["stop_reason"]
    assert_matches(c(x, w), rmsnorm(x, w))


def test_inputs_on_several_devices_at_call_time_run_in_eager():
    f = lambda x, y: x * y + 1
    x, y = torch.randn(4, 4, device="cpu"), torch.tensor(2.0, device="cpu")
    c = eqfuse.compile(f, (x, y))
    out = c(x.to("meta"), y)  # a 0-dim CPU tensor beside a tensor elsewhere: eager, no error
    assert out.device.type == "meta" and out.shape == (4, 4)


def test_a_kernel_that_fails_at_its_first_launch_leaves_the_graph_in_eager(monkeypatch, caplog):
    """A generated kernel that Triton (or its interpreter) refuses at its first launch
    fails no user program: that call and every later one run the graph in eager, and
    the reason is reported (a decode step's attention kernel once failed so in the
    interpreter, and generate() raised)."""
    from eqfuse.runtime.launch import KernelLauncher

    def f(x):
        return (x.exp() * 2).sum(-1)
    x = torch.randn(4, 8)
    c = eqfuse.compile(f, (x,))
    assert c.kernels

    def refused(self, *args, **kwargs):
        raise RuntimeError("made-up launch failure\nwith more lines")
    monkeypatch.setattr(KernelLauncher, "__call__", refused)
    assert_matches(c(x), f(x))
    [fb] = c.fallbacks
    assert fb.node == "<graph>" and "RuntimeError: made-up launch failure" in fb.reason and "\n" not in fb.reason
    assert any("made-up launch failure" in r.getMessage() for r in caplog.records)
    assert_matches(c(x * 2), f(x * 2))


def test_random_ops_draw_in_the_graphs_order():
    """The second draw reads only an input, the first a kernel's output: ready first, it
    would draw first and take the first one's numbers. Eager steps that draw random
    numbers keep the graph's order (T5's training forward failed its check so)."""
    def f(x, y):
        a = x.exp() * 2
        return a + torch.rand_like(a), y + torch.rand_like(y)
    x, y = torch.randn(6, 5), torch.randn(6, 5)
    c = eqfuse.compile(f, (x, y))
    assert [fb.op for fb in c.fallbacks] == ["rand_like", "rand_like"] and c.kernels, c.explain()
    torch.manual_seed(3)
    got = c(x, y)
    torch.manual_seed(3)
    assert_matches(got, f(x, y))


def _seeded_dropout(x):
    torch.manual_seed(0)
    return torch.nn.functional.dropout(x, 0.5)


def _forked_rand_like(x):
    with torch.random.fork_rng():  # the state set back after: no change left behind
        torch.manual_seed(0)
        return torch.rand_like(x)


@pytest.mark.parametrize("fn", [_seeded_dropout, _forked_rand_like], ids=["seeded", "forked"])
def test_a_function_that_seeds_the_generator_is_refused_and_the_state_kept(fn):
    """Tracing ran the seeding once; a compiled graph would never seed again (found by the
    OpInfo sweep: the OpInfos of random ops seed inside the op, in a forked state). The
    user's generator is left as it was."""
    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    with pytest.raises(CaptureError, match="sets the random generator's state"):
        eqfuse.compile(fn, (torch.ones(8),))
    assert torch.equal(torch.random.get_rng_state(), state)


@pytest.mark.parametrize("layout", ["csr", "coo"])
def test_a_sparse_input_runs_its_op_in_eager(layout):
    """A sparse tensor has no strides: a compiled graph's call signature names its layout
    instead (a CSR input raised from inside the call's signature)."""
    dense = torch.eye(3) * torch.arange(1.0, 4.0)
    a = dense.to_sparse_csr() if layout == "csr" else dense.to_sparse()
    b = torch.randn(3, 2)
    fn = lambda a, b: torch.sparse.mm(a, b) * 2  # noqa: E731
    c = eqfuse.compile(fn, (a, b))
    torch.testing.assert_close(c(a, b), fn(a, b))
    assert any("sparse" in f.reason or "mm" in f.node for f in c.fallbacks), c.fallbacks
