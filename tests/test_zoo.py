"""The model zoo (eqfuse/zoo.py): Hugging Face transformers families, tiny configs, random
weights, run as their users run them (default arguments: SDPA attention, the KV cache
on) through ``torch.compile(model, backend="eqfuse")``, against eager.

Each test asserts that no graph ran wholly in eager, that each has kernels, and which ops
ran as eager steps: only ops with no kernel form yet (a new one is a regression; one that
goes away is progress, to be written down here).

The models have LAYERS layers, the fewest that a graph is compiled in parts with (its
identical layers compiled once: frontend/repeats.py), the path a model of published
depth takes; a family in DEPTH has another depth for that (Gemma 2: none, two layers
compiled whole)."""

import pytest
import torch
from conftest import DEVICE

import eqfuse.backend
from eqfuse import zoo
from eqfuse.frontend.repeats import MIN_BLOCKS
from eqfuse.runtime.layered import LayeredGraph

# Per family, the ops that run as eager steps (ops with no kernel form yet). A tensor with
# no elements (the cache's first keys), or one left unwritten (empty_like), is an allocation, not an eager step.
EAGER_OPS = {
    "llama": set(), "qwen2": set(), "mistral": set(), "gpt2": set(), "phi3": set(), "gemma2": set(),
    "gpt_neox": set(), "opt": set(),
    "mixtral": {"grouped_mm_fallback", "sort"},
    "bert": set(), "roberta": set(), "t5": set(), "bart": set(),
    "vit": set(),
}
# Training graphs: the backward's ops too (an embedding's backward, ...)
TRAIN_EAGER_OPS = {
    "llama": set(), "gpt2": set(), "bert": set(), "t5": set(), "mixtral": set(),
}
TRAINED = ["llama", "gpt2", "bert", "t5", "mixtral", "vit"]
# Training steps whose plans store a concatenation's parts into its buffer (codegen/concat.py)
CONCATENATED_IN_PLACE = {"mixtral"}
DECODERS = [f.name for f in zoo.FAMILIES if f.kind == zoo.DECODER]
LAYERS = MIN_BLOCKS
DEPTH = {
    "gemma2": 2,  # sliding-window and global layers alternate: a block is two layers, six at least
    "t5": LAYERS + 1,  # the first layer of each stack computes the position bias the others read
}


def _model(family, train: bool = False):
    return zoo.family_model(family, train=train, layers=DEPTH.get(family.name, LAYERS), device=DEVICE)


def _assert_layered(graphs, family, count: int):
    """``count`` of the graphs compiled in parts, each run of LAYERS alike blocks (an
    encoder-decoder's two: its encoder's and its decoder's); none for Gemma 2."""
    layered = [g for g in graphs if isinstance(g, LayeredGraph)]
    if DEPTH.get(family.name) == 2:
        assert not layered
        return
    assert len(layered) == count, [type(g).__name__ for g in graphs]
    runs = 2 if family.kind == zoo.SEQ2SEQ else 1
    for g in layered:
        assert g.report["layers"]["runs"] == [LAYERS] * runs, g.explain()


def _compiled_graphs() -> list:
    return list(eqfuse.backend.history)


def _assert_compiled(graphs, eager_ops: set | None):
    """Every graph compiled with kernels, none wholly in eager; the eager steps' ops are
    ``eager_ops`` (None: not checked)."""
    assert graphs, "no graph reached eqfuse"
    explained = "\n".join(g.explain() for g in graphs)
    for g in graphs:
        assert not any(f.node == "<graph>" for f in g.fallbacks), explained
        assert g.kernels, explained
    if eager_ops is not None:
        ops = {f.op for g in graphs for f in g.fallbacks}
        assert ops == eager_ops, f"eager steps {sorted(ops)}, expected {sorted(eager_ops)}\n{explained}"


def _close(got, want, rtol=1e-4, what=""):
    """Within ``rtol`` of the reference, relative to its largest magnitude (sums of
    products round with the largest term)."""
    scale = want.abs().max().item() if want.numel() else 0.0
    torch.testing.assert_close(got, want, rtol=rtol, atol=rtol * scale, msg=lambda m: f"{what}: {m}")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    eqfuse.backend.history.clear()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("name", [f.name for f in zoo.FAMILIES])
def test_inference_with_default_arguments_compiles_and_matches_eager(name):
    family = zoo.BY_NAME[name]
    model = _model(family)
    kwargs = zoo.inputs(family, model)
    with torch.no_grad():
        want = zoo.main_output(model(**kwargs))
        got = zoo.main_output(torch.compile(model, backend="eqfuse")(**kwargs))
    _close(got, want, what=name)
    _assert_compiled(_compiled_graphs(), EAGER_OPS[name])
    _assert_layered(_compiled_graphs(), family, 1)


@pytest.mark.parametrize("name", TRAINED)
def test_a_training_step_matches_eager_loss_and_gradients(name):
    """``labels=`` and ``loss.backward()``, in train mode (dropout draws alike under one seed)."""
    family = zoo.BY_NAME[name]
    _assert_trains_as_eager(family, _model(family, train=True).train())
    graphs = _compiled_graphs()
    assert len(graphs) >= 2, "no backward graph was compiled"
    _assert_compiled(graphs, None)
    _assert_layered(graphs, family, 2)  # the forward's and the backward's
    views = [b.name for p in _plans(graphs) for b in p.buffers.values() if b.view_of is not None]
    assert bool(views) == (name in CONCATENATED_IN_PLACE), views


def _plans(graphs) -> list:
    """The plans of ``graphs``, a graph compiled in parts giving its parts'."""
    return [c.plan for g in graphs for c in (g.compiled if isinstance(g, LayeredGraph) else [g]) if c.plan]


def test_a_training_step_with_gradient_checkpointing_matches_eager():
    """``gradient_checkpointing_enable()``: the backward computes each layer's forward
    again, its random ops under the states the forward saved (a higher-order op whose
    results nest: ``(rng_state, (out, lse))``); no graph wholly in eager."""
    family = zoo.BY_NAME["llama"]
    model = _model(family, train=True).train()
    model.gradient_checkpointing_enable()
    _assert_trains_as_eager(family, model)
    graphs = _compiled_graphs()
    _assert_compiled(graphs, None)
    steps = {f.op for g in graphs for f in g.fallbacks}
    assert {"run_and_save_rng_state", "run_with_rng_state"} <= steps, steps


def _assert_trains_as_eager(family, model):
    """One training step of ``model`` through the backend: the loss and every gradient as eager's."""
    kwargs = zoo.inputs(family, model, labels=True)
    want_loss, want_grads = zoo.training_step(model, kwargs)
    got_loss, got_grads = zoo.training_step(torch.compile(model, backend="eqfuse"), kwargs)
    _close(got_loss, want_loss, what=f"{family.name} loss")
    assert set(got_grads) == set(want_grads)
    # A gradient that is zero in exact arithmetic is rounding noise at the scale of the
    # terms it sums (a key's bias): a floor of 1e-2 of the largest gradient's magnitude
    floor = 1e-2 * max(g.abs().max().item() for g in want_grads.values())
    for n, g in want_grads.items():
        torch.testing.assert_close(got_grads[n], g, rtol=1e-4, atol=1e-4 * max(g.abs().max().item(), floor),
                                   msg=lambda m, n=n: f"{family.name} gradient of {n}: {m}")


# the families whose decode step is followed for every cache length, tokens and logits
DECODE_STEP_FOLLOWED = ["llama", "gpt2", "mistral"]


@pytest.mark.parametrize("name", [d for d in DECODERS if d not in DECODE_STEP_FOLLOWED])
def test_generate_gives_eager_tokens(name):
    """``model.generate`` with the forward compiled (as transformers' docs compile it):
    the prompt, then the first step against its cache. The steps after, whose cache
    length dynamo makes symbolic, are followed for the families of DECODE_STEP_FOLLOWED
    in the test after (which checks their tokens too): their forms are the same across
    families (CI time)."""
    family = zoo.BY_NAME[name]
    model = zoo.family_model(family, device=DEVICE)
    prompt = zoo.inputs(family, model, seq=5)["input_ids"]
    want = zoo.generate(model, prompt, new_tokens=2)
    model.forward = torch.compile(model.forward, backend="eqfuse")
    got = zoo.generate(model, prompt, new_tokens=2)
    assert torch.equal(got, want), (got, want)
    _assert_compiled(_compiled_graphs(), None)


@pytest.mark.parametrize("name", DECODE_STEP_FOLLOWED)
def test_generation_compiles_the_decode_step_once_for_every_cache_length(name, monkeypatch):
    """Each new token's step reads a cache one longer: dynamo traces it again with the
    length symbolic, and eqfuse runs every length from sized modules (the cache's
    length and the length with the new token, one size plus one), one per part of the
    step as its first length was compiled in (the layers' made once), its eager steps
    (the embedding of the new token) included; the logits of every step are eager's.
    Mistral's sliding-window cache has its step return the cache's length too (a size
    among the outputs, computed from the call's sizes); its window is wider than the
    tokens here, as a published model's is."""
    from eqfuse.runtime import sized_layers

    built = []
    build = sized_layers.build
    monkeypatch.setattr(sized_layers, "build", lambda *a, **k: built.append(build(*a, **k)) or built[-1])
    family = zoo.BY_NAME[name]
    model = zoo.family_model(family, sizes={**zoo.TINY, **family.tiny, "sliding_window": 64}, layers=3,
                             device=DEVICE)
    prompt = zoo.inputs(family, model, seq=5)["input_ids"]

    def generate():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=5, min_new_tokens=5,
                             do_sample=False, pad_token_id=model.config.eos_token_id, return_dict_in_generate=True,
                             output_logits=True)
        return out.sequences, torch.stack(out.logits)
    want_tokens, want_logits = generate()
    model.forward = torch.compile(model.forward, backend="eqfuse")
    got_tokens, got_logits = generate()
    assert torch.equal(got_tokens, want_tokens)
    _close(got_logits, want_logits, what=f"{name} logits")
    # the prompt, the first step (its cache length static), then one build for every later length
    assert len(_compiled_graphs()) == 3, [type(g).__name__ for g in _compiled_graphs()]
    _assert_compiled(_compiled_graphs(), None)
    (sized,) = built  # the blocks after the first run the first one's sized module
    blocks = [c for p, c in zip(sized.runner.parts, sized.runner.compiled) if p.block is not None]
    assert len(blocks) == 3 and all(c is blocks[0] for c in blocks) and hasattr(blocks[0], "sized")
    # the layouts a call is checked against, as numbers a + b * size, are the symbolic ones
    assert sized.layouts != sized.exact_layouts
    assert all(sized.layouts(n) == sized.exact_layouts(n) for n in (1, 2, 7, 30, 200))


def test_generation_with_a_static_cache_has_a_decode_step_of_kernels_only():
    """torch.compile's recipe for generation: a static cache (fixed shapes, the position a
    runtime value). The decode step writes each layer's k and v at the step's position
    into the cache itself (index_copy made index_put_: frontend/writes.py), not into a
    new cache copied back; the prompt's graph makes the cache, writing its many positions
    by a reduction over them and an indexed read (frontend/decompose/). No other eager
    step; every step's logits are eager's."""
    family = zoo.BY_NAME["llama"]
    model = zoo.family_model(family, layers=LAYERS, device=DEVICE)
    prompt = zoo.inputs(family, model, seq=5)["input_ids"]

    def generate():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, min_new_tokens=6,
                             do_sample=False, pad_token_id=model.config.eos_token_id, return_dict_in_generate=True,
                             output_logits=True, cache_implementation="static")
        return out.sequences, torch.stack(out.logits)
    want_tokens, want_logits = generate()
    model.forward = torch.compile(model.forward, backend="eqfuse")
    got_tokens, got_logits = generate()
    assert torch.equal(got_tokens, want_tokens)
    _close(got_logits, want_logits, what="llama logits, static cache")
    graphs = _compiled_graphs()
    assert len(graphs) == 2, [type(g).__name__ for g in graphs]  # the prompt, one step for every position
    prompt_graph, step = graphs
    assert prompt_graph.kernels and not prompt_graph.fallbacks, prompt_graph.explain()
    assert step.kernels and not step.fallbacks, step.explain()
    writes = [w.op for w in step.input_writes]  # each layer's keys and values, its position counter
    assert writes.count("index_put_") == 2 * LAYERS and set(writes) == {"index_put_", "copy_"}, step.explain()


def test_generation_with_a_static_cache_compiled_by_transformers_itself():
    """The static cache as transformers' docs run it for speed: ``generate`` compiles the
    decode step itself (``compile_config``: here eqfuse, torch.compile's mode
    "reduce-overhead"), the prompt in eager. One graph for every decode step, kernels
    only, no recompilation, every step's logits eager's."""
    from transformers import CompileConfig

    family = zoo.BY_NAME["llama"]
    model = zoo.family_model(family, layers=LAYERS, device=DEVICE)
    prompt = zoo.inputs(family, model, seq=5)["input_ids"]
    config = CompileConfig(backend="eqfuse")
    config._compile_all_devices = True  # transformers compiles on accelerators only, unless told

    def generate(compiled: bool):
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, min_new_tokens=6,
                             do_sample=False, pad_token_id=model.config.eos_token_id, return_dict_in_generate=True,
                             output_logits=True, cache_implementation="static", compile_config=config,
                             disable_compile=not compiled)
        return out.sequences, torch.stack(out.logits)
    want_tokens, want_logits = generate(False)
    torch._dynamo.reset()
    eqfuse.backend.history.clear()
    got_tokens, got_logits = generate(True)
    assert torch.equal(got_tokens, want_tokens)
    _close(got_logits, want_logits, what="llama logits, static cache, transformers' compile")
    graphs = _compiled_graphs()
    assert len(graphs) == 1, [type(g).__name__ for g in graphs]
    assert graphs[0].kernels and not graphs[0].fallbacks, graphs[0].explain()
    if DEVICE == "cuda":  # the step's parts replayed as one CUDA graph (its new token and position copied in)
        assert graphs[0].graphs.replays >= 3, graphs[0].explain()


def test_any_model_class_is_built_tiny_from_its_config_class():
    """``zoo.build`` shrinks any class's config by field name: a family is one line."""
    model = zoo.build("Qwen3ForCausalLM")
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.vocab_size) == (64, 2, 4, 96)
    assert sum(p.numel() for p in model.parameters()) < 200_000
    gpt2 = zoo.build("GPT2LMHeadModel").config
    assert (gpt2.n_embd, gpt2.n_layer, gpt2.n_head) == (64, 2, 4)  # through its attribute_map


def test_a_generation_passes_where_it_first_differs_from_eager_at_a_near_tie():
    # benchmarks/zoo.py judges generate(): bf16 greedy decoding on random weights meets
    # near-ties that any backend rounding differently may flip; a real difference fails
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    from zoo import TIE, judge_tokens

    reference = torch.tensor([[7, 8, 9, 1, 2, 3]])  # a prompt of three, three new tokens
    scores = tuple(torch.zeros(1, 10) for _ in range(3))
    scores[1][0, 2], scores[1][0, 5] = 4.0, 4.0 * (1 - TIE / 2)  # eager chose 2; 5 within TIE
    assert judge_tokens(reference.clone(), reference, scores) == {"tokens_as_eager": 1.0, "pass": True}
    near = torch.tensor([[7, 8, 9, 1, 5, 0]])
    got = judge_tokens(near, reference, scores)
    assert got["pass"] and got["first_difference"] == 1 and got["tokens_as_eager"] == 0.667
    scores[1][0, 5] = 3.0
    assert not judge_tokens(near, reference, scores)["pass"]
