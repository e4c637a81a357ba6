"""Extraction's shortcuts choose what the plain search chooses.

Extraction evaluates a thousand trial plans and more per graph. It reuses the kernels a
move cannot change, writes a kernel's source only where its validity decides a step, and
pauses the garbage collector. A reference extractor without those shortcuts (every trial
plan built from scratch, every kernel's source written when it is first costed) must give
the same plan: the same generated module and the same costs.
"""

import math
import random

import networkx as nx
import pytest
import torch

from eqfuse.codegen.module import generate_module
from eqfuse.errors import Unschedulable
from eqfuse.examples import causal_attention, rmsnorm
from eqfuse.models import GPT2Block, LlamaLayer
from eqfuse.rewrite import extract
from eqfuse.rewrite.extract import Extractor, _is_acyclic
from eqfuse.schema.plan import KernelSpec


class ReferenceExtractor(Extractor):
    """The search without its shortcuts: no kernel taken over from the plan one move
    before, every kernel's source written as soon as it is costed."""

    def _evaluate(self, order, M, host, memo, base=None):
        return super()._evaluate(order, M, host, memo, None)

    def _kernel_time(self, spec, buffers):
        t, reason, _ = super()._kernel_time(spec, buffers)
        if reason is None:
            try:
                extract.generate(spec, buffers)
            except Unschedulable as e:
                return math.inf, e, True
        return t, reason, True


def _saturated(fn, inputs):
    """(e-graph view, translation) of ``fn`` on ``inputs``, saturated, ready to extract."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from eqfuse.frontend.capture import capture
    from eqfuse.rewrite.egraph_json import serialize
    from eqfuse.rewrite.saturate import Limits, saturate
    from eqfuse.schema.from_fx import translate

    captured = capture(fn, inputs)
    with unset_fake_temporarily():
        tr = translate(captured)
        saturate(tr.egraph, Limits(max_seconds=60))
        view = serialize(tr.egraph)
        tr.egraph = None
    return view, tr


def _training_graphs(model, x) -> list:
    """The forward and backward graphs AOTAutograd makes of ``model`` on ``x``, saturated."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def record(gm, example_inputs):
        graphs.append(_saturated(gm, example_inputs))
        return make_boxed_func(gm)
    torch._dynamo.reset()
    out = torch.compile(model, backend=aot_autograd(fw_compiler=record, bw_compiler=record))(x)
    out.backward(torch.randn_like(out))
    torch._dynamo.reset()
    assert len(graphs) == 2
    return graphs


@pytest.fixture(scope="module")
def graphs() -> dict:
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 33, 16) for _ in range(3))
    out = {"rmsnorm": _saturated(rmsnorm, (torch.randn(8, 48), torch.rand(48))),
           "causal_attention": _saturated(causal_attention, (q, k, v))}
    models = {"llama": (LlamaLayer(hidden=64, heads=4, intermediate=128, max_seq=32), torch.randn(2, 32, 64)),
              "gpt2": (GPT2Block(hidden=64, heads=4), torch.randn(2, 32, 64))}
    for name, (model, x) in models.items():
        fw, bw = _training_graphs(model, x.requires_grad_())
        out[f"{name}_forward"], out[f"{name}_backward"] = fw, bw
    return out


@pytest.mark.parametrize("name", ["llama_forward", "llama_backward", "gpt2_forward", "gpt2_backward"])
def test_every_reshape_keeps_its_element_count(graphs, name):
    """A Reshape's vector has as many elements as its argument. egglog 13.2 once stored
    one with another vector's values (GPT-2's training forward on an H100); since, the
    translator lets each vector as a global of the e-graph (Translator.ivec)."""
    view, tr = graphs[name]
    types = Extractor(view, tr).types
    reshapes = [n for nodes in view.classes.values() for n in nodes if n.op == "Reshape" and n.args[0] in types]
    assert reshapes
    for n in reshapes:
        assert math.prod(n.args[1]) == math.prod(types[n.args[0]][0]), n
    assert any(let.startswith("vec_") for let in view.lets)


def _plan(cls, view, tr):
    plan, report = cls(view, tr).extract()
    return generate_module(plan, "g", "0")[0], plan.cost, plan.cost_unfused, report


@pytest.mark.parametrize("name", ["rmsnorm", "causal_attention", "llama_forward", "llama_backward",
                                  "gpt2_forward", "gpt2_backward"])
def test_same_plan_as_the_plain_search(graphs, name):
    view, tr = graphs[name]
    got, ref = _plan(Extractor, view, tr), _plan(ReferenceExtractor, view, tr)
    assert got[1:] == ref[1:]  # costs, kernel counts
    assert got[0] == ref[0]  # the generated module, character for character


def test_same_plan_when_the_writer_refuses_what_the_scheduler_takes(graphs, monkeypatch):
    """Kernel sources are written late, for the plans that decide a step. A kernel the
    source writer refuses (after the scheduler took it) must count as invalid in every
    decision it would have changed, as if written at once."""
    refused = []
    generate = extract.generate

    def strict_writer(spec, buffers, cfg=None):
        if len(spec.roots) > 1 or len(spec.walk()) > 40:  # no multi-output kernels, no big ones
            refused.append(spec.name)
            raise Unschedulable("refused by the test")
        return generate(spec, buffers, cfg)
    monkeypatch.setattr(extract, "generate", strict_writer)
    view, tr = graphs["llama_backward"]
    got, ref = _plan(Extractor, view, tr), _plan(ReferenceExtractor, view, tr)
    assert refused
    assert got[1:] == ref[1:]
    assert got[0] == ref[0]
    monkeypatch.setattr(extract, "generate", generate)
    assert _plan(Extractor, view, tr)[0] != got[0]  # the refusals did change the plan


@pytest.mark.parametrize("name", ["causal_attention", "llama_forward", "llama_backward"])
def test_values_from_indices_alone_are_never_tried_stored(graphs, name, monkeypatch):
    """A causal mask is recomputed by every kernel that reads it, so storing it only adds
    a kernel whose buffer nobody reads: no trial plan of the search (evaluated against
    the plan one move before) stores one, where it is not a graph output."""
    view, tr = graphs[name]
    ex = Extractor(view, tr)
    tried = []
    evaluate = Extractor._evaluate

    def spy(self, order, M, host, memo, base=None):
        if base is not None:
            tried.append(set(M))
        return evaluate(self, order, M, host, memo, base)
    monkeypatch.setattr(Extractor, "_evaluate", spy)
    ex.extract()
    index_only = {c for c in ex.reachable(ex.roots()) if c in ex.kernel_of and ex._from_indices(c)}
    index_only -= set(ex.roots())
    assert index_only and tried
    assert not any(M & index_only for M in tried)


def test_kernels_know_their_walk(graphs):
    """Extraction hands each kernel the walk its builder made; it is the walk of its roots."""
    plan, _ = Extractor(*graphs["llama_backward"]).extract()
    assert plan.kernels
    for spec in plan.kernels:
        fresh = KernelSpec(spec.name, list(spec.roots)).walk()
        assert [id(n) for n in spec.walk()] == [id(n) for n in fresh]


def test_walk_follows_a_change_of_roots(graphs):
    plan, _ = Extractor(*graphs["rmsnorm"]).extract()
    spec = plan.kernels[0]
    before = spec.walk()
    root, name = spec.roots[0]
    spec.roots = [(root.args[0], name)]
    assert spec.walk() == root.args[0].walk() != before


def test_collector_is_on_after_extraction_and_stays_off_if_it_was(graphs):
    import gc
    view, tr = graphs["rmsnorm"]
    assert gc.isenabled()
    Extractor(view, tr).extract()
    assert gc.isenabled()
    gc.disable()
    try:
        Extractor(view, tr).extract()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_acyclic_agrees_with_networkx():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 8)
        steps = [f"s{i}" for i in range(n)]
        edges = [(rng.choice(steps), rng.choice(steps)) for _ in range(rng.randint(0, 12))]
        edges = [(a, b) for a, b in edges if a != b]
        g = nx.DiGraph()
        g.add_nodes_from(steps)
        g.add_edges_from(edges)
        assert _is_acyclic(steps, edges) == nx.is_directed_acyclic_graph(g), edges
