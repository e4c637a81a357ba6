"""Writes into a graph's inputs (frontend/writes.py): a cache updated in place, an input
read before its write, a wrong write caught by the check, and the reinplacing pass itself."""

import pytest
import torch
import torch.fx as fx
from conftest import assert_matches

import eqfuse
from eqfuse.frontend import writes

aten = torch.ops.aten


def _cache_step(cache, position, new):
    """A decode step's cache update: the new keys at ``position``, then a read of the cache."""
    cache.index_copy_(2, position, new)
    return (cache * 2.0).sum(-1)


def _examples():
    torch.manual_seed(0)
    return torch.randn(2, 3, 8, 4), torch.tensor([5]), torch.randn(2, 3, 1, 4)


def test_a_cache_update_writes_the_input_in_place_once():
    cache, position, new = _examples()
    example = cache.clone()
    c = eqfuse.compile(_cache_step, (example, position, new))
    assert torch.equal(example, cache), "compiling (its check) wrote the example input"
    mine, theirs = cache.clone(), cache.clone()
    assert_matches(c(mine, position, new), _cache_step(theirs, position, new))
    assert torch.equal(mine, theirs)
    assert c.kernels and not c.fallbacks, c.explain()
    assert [w.op for w in c.input_writes] == ["index_put_"], c.explain()


def test_an_input_read_before_its_update_is_copied_into_after_the_read():
    """The cache's old values are read besides its update: no update in place (its readers
    would see the new values), the new cache copied in after every read of the old one."""
    def f(cache, position, new):
        before = cache.sum(-1)
        cache.index_copy_(2, position, new)
        return before, cache.mean(-1)
    cache, position, new = _examples()
    c = eqfuse.compile(f, (cache.clone(), position, new))
    mine, theirs = cache.clone(), cache.clone()
    for got, want in zip(c(mine, position, new), f(theirs, position, new)):
        assert_matches(got, want)
    assert torch.equal(mine, theirs)
    assert [w.op for w in c.input_writes] == ["copy_"], c.explain()


def test_a_wrong_write_fails_the_check_and_the_graph_runs_in_eager(monkeypatch):
    """The check compares what the plan writes into its inputs with what the graph writes:
    an update made to add onto the cache instead of writing it is caught."""
    made = writes.reinplaced

    def accumulating(gm):
        gm = made(gm)
        for n in gm.graph.nodes:
            if n.target is aten.index_put_.default:
                n.args = (*n.args[:3], True)
        gm.recompile()
        return gm
    monkeypatch.setattr("eqfuse.frontend.capture.reinplaced", accumulating)
    cache, position, new = _examples()
    c = eqfuse.compile(_cache_step, (cache.clone(), position, new))
    assert c.fallbacks and "an input it writes" in c.fallbacks[0].reason, c.explain()
    mine, theirs = cache.clone(), cache.clone()
    assert_matches(c(mine, position, new), _cache_step(theirs, position, new))
    assert torch.equal(mine, theirs)


def _graph(fn, *inputs) -> fx.GraphModule:
    from torch.fx.experimental.proxy_tensor import make_fx
    return make_fx(fn)(*inputs)


@pytest.mark.parametrize("read_old, in_place", [(False, True), (True, False)], ids=["alone", "read-besides"])
def test_reinplacing_takes_an_update_copied_back_only_where_nothing_else_reads_the_input(read_old, in_place):
    def f(cache, position, new):
        updated = aten.index_copy.default(cache, 2, position, new)
        out = updated.sum() + (cache.sum() if read_old else 0.0)
        aten.copy_.default(cache, updated)
        return out
    cache, position, new = _examples()
    gm = writes.reinplaced(_graph(f, cache, position, new))
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert (aten.index_copy_.default in targets) == in_place
    assert (aten.copy_.default in targets) == (not in_place)
    assert writes.written_positions(gm) == (0,)
    mine, theirs = cache.clone(), cache.clone()
    assert_matches(gm(mine, position, new), f(theirs, position, new))
    assert torch.equal(mine, theirs)


def test_a_read_after_a_write_in_a_graph_not_functionalised_is_named():
    """An input read by name after a write into it (which the plan, ordering every read of
    an input before its writes, would read old) is refused with the reason."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.call_function(aten.add_.Tensor, (x, 1))
    graph.output(graph.call_function(aten.mul.Tensor, (x, 2)))
    problem = writes.mutation_problem(fx.GraphModule({}, graph))
    assert problem is not None and "reads input x after the in-place op" in problem
