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
