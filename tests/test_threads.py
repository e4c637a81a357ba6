"""Compiled graphs used from several threads: calls at once, compiles at once, and first
calls at once (issue 37: the interpreter's launches and tracing keep process-wide state)."""

import threading

import torch
from conftest import assert_matches

import eqfuse


def _in_threads(target, n: int = 4) -> list:
    """Runs ``target(i)`` in ``n`` threads at once; the exceptions they raised."""
    errors, start = [], threading.Barrier(n)

    def run(i):
        try:
            start.wait()
            target(i)
        except Exception as e:  # noqa: BLE001 - collected for the assertion
            errors.append(e)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def _compiled(g) -> bool:
    """Whether ``g`` runs kernels, not the whole graph in eager."""
    return bool(g.kernels) and all(f.node != "<graph>" for f in g.fallbacks)


def _block(x, w):
    return torch.relu(x @ w + 1).sum(-1)


def test_one_graph_called_from_threads_at_once():
    x, w = torch.randn(16, 32), torch.randn(32, 8)
    compiled = eqfuse.compile(_block, [x, w])
    compiled(x, w)  # the first call done: each thread runs the kernels as they are

    def call(_):
        for _ in range(3):
            assert_matches(compiled(x, w), _block(x, w), contraction=True)
    assert _in_threads(call) == []
    assert _compiled(compiled), compiled.explain()


def test_first_calls_from_threads_at_once():
    """Every thread's call is the graph's first: one finishes the build, the others run it."""
    x, w = torch.randn(16, 32), torch.randn(32, 8)
    compiled = eqfuse.compile(_block, [x, w])
    assert _in_threads(lambda _: assert_matches(compiled(x, w), _block(x, w), contraction=True)) == []
    assert _compiled(compiled), compiled.explain()


def test_graphs_compiled_in_threads_at_once():
    made = {}

    def compile_one(i):
        a = torch.randn(8, 8)
        made[i] = eqfuse.compile(lambda a: (a * (i + 1)).exp().sum(0), [a])
        assert_matches(made[i](a), (a * (i + 1)).exp().sum(0))
    assert _in_threads(compile_one) == []
    assert all(map(_compiled, made.values())), [g.explain() for g in made.values()]
