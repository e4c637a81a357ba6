"""Capture: a function or nn.Module plus example inputs -> an ATen-level FX graph with
shape, dtype and stride on every node (``node.meta["val"]``, a FakeTensor).

Composite ops (softmax, layer_norm, gelu, silu, var, logsumexp ...) are decomposed into
primitives here, so the rules see one spelling of each and recover the fused forms.
Inputs and outputs are flattened with pytree; the output structure is kept to rebuild
the user's result.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ..errors import CaptureError, kind_of
from . import decompose
from .writes import in_place, reinplaced


def decomposition_table() -> dict:
    """The decompositions capture traces with (a fresh dict: the caller may change it).
    Built once per process: torch's core table lists every composite op of every
    namespace, 0.1-0.25 s per build, which each graph's capture paid."""
    global _TABLE
    if _TABLE is None:
        _TABLE = _make_decomposition_table()
    return dict(_TABLE)


_TABLE: dict | None = None


def _make_decomposition_table() -> dict:
    from torch._decomp import core_aten_decompositions, get_decompositions

    aten = torch.ops.aten
    table = dict(core_aten_decompositions())
    table.update(get_decompositions([
        aten._softmax, aten._log_softmax, aten.native_layer_norm, aten.gelu, aten.silu,
        aten.var.correction, aten.var_mean.correction, aten.logsumexp, aten.masked_fill,
        aten.hardtanh, aten.hardsigmoid, aten.hardswish, aten.mish, aten.softplus,
        aten.leaky_relu, aten.elu, aten.rms_norm, aten.tril, aten.triu,
        aten._native_batch_norm_legit_functional, aten._native_batch_norm_legit_no_training,
        aten._native_batch_norm_legit, aten.native_batch_norm,
        # as torch's references compute them (in the accumulation dtype, without rescaling:
        # a norm of [3e38, 3e38] is inf in eager too): sums, maxima, powers and casts
        aten.linalg_vector_norm, aten.native_group_norm, aten.repeat, aten.addmv,
    ]))
    # The fused attention ops a backend picks (flash, memory-efficient, cuDNN) stay as they
    # are: graphs traced around them (AOTAutograd's) view their outputs with their strides
    # and save their log-sum-exp for the backward. The function users call is traced
    # plainly instead (``PlainAttention``), so the attention rules meet it like any other
    # spelling.
    # The embedding's backward stays one op: decomposed, it is an index_put that accumulates,
    # whose CUDA kernel serialises the rows sharing an index (BERT's two token types: a
    # training step's three embedding backwards took 1953 us on an H200, Inductor's 62)
    table.pop(aten.embedding_dense_backward.default, None)
    table.update(decompose.ADDED)  # and eqfuse's own (frontend/decompose/)
    return {op: fn for op, fn in table.items() if "scaled_dot_product" not in str(op)}


class PlainAttention(torch.overrides.TorchFunctionMode):
    """While tracing: ``F.scaled_dot_product_attention`` as the primitives it stands for."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention and not kwargs.get("dropout_p"):
            return _sdpa_math(*args, **kwargs)
        return func(*args, **kwargs)


def _sdpa_math(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """``F.scaled_dot_product_attention`` in primitives (as torch's math backend has it);
    with dropout it stays one op (random: it runs in eager)."""
    if dropout_p:
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    s = (q @ k.transpose(-2, -1)) * scale
    if is_causal:
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else s + attn_mask
    out = torch.softmax(s, dim=-1) @ v
    if attn_mask is None:  # (a causal mask leaves every row its first key)
        return out
    # A row the mask leaves no key gives 0, as the fused kernels and torch's math path
    # (its safe softmax) give, not softmax's 0 / 0. The row max is the softmax's own (over
    # the scores in float32), which the attention kernel has.
    return torch.where(s.float().amax(-1, keepdim=True) == float("-inf"), 0.0, out)


def plain_bool_masked_attention(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of dynamo's graph ``gm`` (an inference graph) in which each
    ``F.scaled_dot_product_attention`` with a bool mask and no dropout is ``_sdpa_math``
    (``gm`` itself is unchanged; the same graph where there is none). transformers passes
    such a mask under torch.compile where eager passes none (ViT: all True, broadcast with
    zero strides); the fused kernels refuse it, and AOTAutograd traces torch's math path
    instead, which computes attention in float32 with a safe softmax (any, logical_not,
    where) that the attention rules do not stream: three kernels and float32 products. In
    its plain form the mask is read through its broadcast, in the attention kernel."""
    import copy

    from torch.fx.operator_schemas import normalize_function

    def masked(node) -> bool:
        if node.op != "call_function" or node.target is not torch.nn.functional.scaled_dot_product_attention:
            return False
        kw = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True)
        if kw is None or kw.kwargs.get("dropout_p"):
            return False
        mask = kw.kwargs.get("attn_mask")
        value = mask.meta.get("example_value") if isinstance(mask, torch.fx.Node) else None
        return isinstance(value, torch.Tensor) and value.dtype == torch.bool

    if not any(masked(n) for n in gm.graph.nodes):
        return gm
    graph = copy.deepcopy(gm.graph)
    for node in graph.nodes:
        if masked(node):
            node.target = _sdpa_math
    return torch.fx.GraphModule(gm, graph)


def _fused_sdpa_ops() -> dict:
    """The fused attention ops a backend picks, each with the name of its mask argument."""
    aten = torch.ops.aten
    ops = {"_scaled_dot_product_flash_attention": None, "_scaled_dot_product_efficient_attention": "attn_bias",
           "_scaled_dot_product_cudnn_attention": "attn_bias",
           "_scaled_dot_product_flash_attention_for_cpu": "attn_mask"}
    return {getattr(aten, name).default: mask for name, mask in ops.items() if hasattr(aten, name)}


def _sdpa_output(q, k, v, attn_mask=None, is_causal=False, scale=None, strides=None):
    """A fused attention op's output, computed as ``_sdpa_math`` and laid out with the
    fused op's strides (flash writes ``[B, H, S, D]`` as ``[B, S, H, D]`` in memory; the
    graph around it may view it through that layout)."""
    out = _sdpa_math(q, k, v, attn_mask, 0.0, is_causal, scale, enable_gqa=True)
    if strides is None or tuple(strides) == tuple(out.stride()):
        return out
    order = sorted(range(out.dim()), key=lambda d: -strides[d])  # outermost first
    inverse = sorted(range(out.dim()), key=lambda d: order[d])
    return out.permute(order).contiguous().permute(inverse)


def plain_fused_attention(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``gm`` where each fused attention op (flash, memory-efficient, cuDNN)
    whose only result used is the attention output, and which has no dropout, is the
    plain computation ``_sdpa_math`` instead, which the attention rules stream into one
    kernel. AOTAutograd's inference graphs call them so; a training graph saves the
    log-sum-exp for the backward, and its op stays as it is. ``gm`` itself is unchanged."""
    import copy
    import operator

    from torch.fx.operator_schemas import normalize_function

    fused = _fused_sdpa_ops()
    targets = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in fused]
    if not targets:
        return gm
    graph = copy.deepcopy(gm.graph)
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target in fused]:
        users = list(node.users)
        if not all(u.target is operator.getitem and (u.args[1] == 0 or not u.users) for u in users):
            continue
        kw = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True).kwargs
        if kw.get("dropout_p"):
            continue
        meta = node.meta.get("val")
        strides = tuple(meta[0].stride()) if isinstance(meta, (list, tuple)) else None
        mask = fused[node.target]
        with graph.inserting_before(node):
            plain = graph.call_function(_sdpa_output, (kw["query"], kw["key"], kw["value"]), {
                "attn_mask": kw.get(mask) if mask else None, "is_causal": kw.get("is_causal", False),
                "scale": kw.get("scale"), "strides": strides})
        for u in users:
            if u.args[1] == 0:
                u.replace_all_uses_with(plain)
            graph.erase_node(u)
        graph.erase_node(node)
    return torch.fx.GraphModule(gm, graph)


@dataclass
class CapturedGraph:
    gm: torch.fx.GraphModule
    # The tensors bound to the graph's placeholders, in order: the user's tensor inputs
    # (positions in ``input_positions``) and then tensor constants (module parameters).
    example_tensors: list[torch.Tensor]
    out_spec: Any
    num_user_inputs: int
    constants: list[torch.Tensor] = field(default_factory=list)
    fn: Callable | None = None  # the user's function, the reference for validation
    # placeholder name -> value, for the constants that are 0-dim tensor literals of the
    # code (``_tensor_constant``: ``x[..., 0] = 7`` traced by dynamo), which never change
    literals: dict = field(default_factory=dict)
    # per flat output, its strides as eager lays it out (its ops undecomposed), or None
    # where unknown: the decomposed trace may lay an output out otherwise
    output_strides: list | None = None

    def reference_outputs(self, user_inputs) -> list:
        """The flat outputs of the original function (before decomposition), run with its
        module's buffers as they were (validation must not advance a running statistic)."""
        with buffers_kept(self.fn):
            return pytree.tree_flatten(self.fn(*user_inputs))[0]

    def undecomposed(self) -> torch.fx.GraphModule | None:
        """The graph of eager's own ops: the backend's graph as it came, or the user's
        function traced again without decompositions (on fake tensors; None where that
        fails). Its outputs are the flat outputs, as ``gm``'s are."""
        if isinstance(self.fn, torch.fx.GraphModule):
            return self.fn
        from torch.fx.experimental.proxy_tensor import make_fx

        def flat(*args):
            return pytree.tree_flatten(self.fn(*args))[0]
        try:
            with buffers_kept(self.fn):
                return make_fx(flat, tracing_mode="fake", _allow_non_fake_inputs=True)(
                    *self.example_tensors[:self.num_user_inputs])
        except Exception:  # noqa: BLE001 - then nothing is known of its ops
            return None

    @property
    def placeholders(self) -> list[torch.fx.Node]:
        return [n for n in self.gm.graph.nodes if n.op == "placeholder"]


def _mutates(gm: torch.fx.GraphModule) -> bool:
    return any(in_place(n) for n in gm.graph.nodes)


def _functionalised(gm: torch.fx.GraphModule, example_inputs) -> torch.fx.GraphModule:
    """``gm`` traced again through functionalisation: an in-place op on an intermediate
    (rms_norm's decomposition adds eps in place) becomes its out-of-place form, views of a
    mutated value read the new one. A mutation of an input stays (a copy_ into it at the
    end: frontend/writes.py). Decompositions add such ops below a
    functionalisation of the first trace, hence a second one, only where needed. Where
    functionalisation fails (a prim with an aliasing output: BatchNorm's decomposition),
    ``gm`` as it is, which runs in eager."""
    from torch.fx.experimental.proxy_tensor import make_fx

    try:
        return make_fx(torch.func.functionalize(gm, remove="mutations"), tracing_mode="fake",
                       _allow_non_fake_inputs=True)(*example_inputs)
    except Exception:  # noqa: BLE001 - the graph keeps its in-place op, and runs in eager for it
        return gm


@contextmanager
def buffers_kept(fn):
    """Runs the block with ``fn``'s module buffers restored after it: tracing a training-mode
    BatchNorm on fake inputs still adds 1 to its real ``num_batches_tracked``, and a
    validation run of the module would update its running statistics. Compiling never
    changes the user's objects."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    buffers = list(fn.buffers()) if isinstance(fn, torch.nn.Module) else []
    if not buffers:
        yield
        return
    with unset_fake_temporarily():  # dynamo's backend is called inside its fake mode
        saved = [(b, b.detach().clone()) for b in buffers]
    try:
        yield
    finally:
        with unset_fake_temporarily(), torch.no_grad():
            for b, value in saved:
                b.copy_(value)


def _rng_states() -> list:
    """The CPU generator's state, and each GPU's where CUDA is initialised, as bytes (real
    tensors: a backend's capture runs under AOTAutograd's fake mode)."""
    with unset_fake_temporarily():
        states = [torch.random.get_rng_state()]
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            states += torch.cuda.get_rng_state_all()
        return [bytes(s.numpy()) for s in states]


# Where code sets a generator's state, as torch spells it (a state saved and set back, as
# torch.random.fork_rng and the OpInfo tests' seeding wrapper do, leaves no change behind;
# and another thread may draw numbers meanwhile, so the state itself tells nothing)
_SEEDING = [(torch, "manual_seed"), (torch, "seed"), (torch, "set_rng_state"), (torch.random, "manual_seed"),
            (torch.random, "seed"), (torch.random, "set_rng_state"), (torch.cuda, "manual_seed"),
            (torch.cuda, "manual_seed_all"), (torch.cuda, "set_rng_state"), (torch.cuda, "set_rng_state_all")]
_seeding = {"watchers": 0, "saved": []}
_seeding_lock = threading.Lock()
_watching = threading.local()  # .calls: the seeding calls this thread's capture made


@contextmanager
def _seeding_watched(calls: list):
    """The seeding functions of _SEEDING note in ``calls`` each call this thread makes.
    Installed while any capture runs (captures run in several threads at once)."""
    def watched(name, f):
        @functools.wraps(f)
        def call(*args, **kwargs):
            mine = getattr(_watching, "calls", None)
            if mine is not None:
                mine.append(name)
            return f(*args, **kwargs)
        return call

    with _seeding_lock:
        if _seeding["watchers"] == 0:
            _seeding["saved"] = [(module, name, getattr(module, name)) for module, name in _SEEDING]
            for module, name, f in _seeding["saved"]:
                setattr(module, name, watched(name, f))
        _seeding["watchers"] += 1
    _watching.calls = calls
    try:
        yield
    finally:
        _watching.calls = None
        with _seeding_lock:
            _seeding["watchers"] -= 1
            if _seeding["watchers"] == 0:
                for module, name, f in _seeding["saved"]:
                    setattr(module, name, f)


def _restore_rng_states(states: list) -> None:
    with unset_fake_temporarily():
        torch.random.set_rng_state(torch.frombuffer(bytearray(states[0]), dtype=torch.uint8))
        if len(states) > 1:
            torch.cuda.set_rng_state_all([torch.frombuffer(bytearray(s), dtype=torch.uint8) for s in states[1:]])


def capture(fn: Callable, example_inputs) -> CapturedGraph:
    """Trace ``fn(*example_inputs)`` to ATen primitives with fake tensors."""
    from torch.fx.experimental.proxy_tensor import make_fx

    example_inputs = tuple(example_inputs)
    for i, x in enumerate(example_inputs):
        if not isinstance(x, torch.Tensor):
            raise CaptureError(f"input {i} is {kind_of(x)}; eqfuse.compile takes tensors "
                               "(bind other arguments with functools.partial)")
    out_spec_box = []

    traced = plain_fused_attention(fn) if isinstance(fn, torch.fx.GraphModule) else fn

    def flat_fn(*args):
        with PlainAttention():
            out = traced(*args)
        leaves, spec = pytree.tree_flatten(out)
        out_spec_box.append(spec)
        return leaves

    module_params: list[torch.Tensor] = []
    if isinstance(fn, torch.nn.Module):
        module_params = [p for p in fn.parameters()] + [b for b in fn.buffers()]

    quiet = logging.getLogger("torch._subclasses.fake_tensor")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)  # our error says it in one line
    rng = _rng_states()
    seeded: list = []
    try:
        with buffers_kept(fn), _seeding_watched(seeded):
            gm = make_fx(flat_fn, decomposition_table=decomposition_table(), tracing_mode="fake",
                         _allow_non_fake_inputs=True)(*example_inputs)
            if _mutates(gm):
                gm = reinplaced(_functionalised(gm, example_inputs))
    except Exception as e:  # torch raises many kinds: report one clear line
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CaptureError(f"could not trace the function: {type(e).__name__}: {msg}") from e
    finally:
        quiet.setLevel(level)
        if seeded:
            _restore_rng_states(rng)
    if seeded:
        raise CaptureError("the function sets the random generator's state as it runs (torch.manual_seed, "
                           "set_rng_state), which a compiled graph would not do again on its calls: set it "
                           "before calling the compiled function")

    # Tensor constants (module parameters, tensors closed over) become extra inputs.
    constants, literals = [], {}
    graph = gm.graph
    last_placeholder = [n for n in graph.nodes if n.op == "placeholder"]
    for node in list(graph.nodes):
        if node.op == "get_attr":
            value = getattr(gm, node.target)
            if not isinstance(value, torch.Tensor):
                continue
            anchor = last_placeholder[-1] if last_placeholder else next(iter(graph.nodes))
            with graph.inserting_after(anchor):
                ph = graph.placeholder(f"const_{len(constants)}")
            ph.meta["val"] = _fake_like(node, value)
            if str(node.target).startswith("_tensor_constant") and value.dim() == 0:
                with unset_fake_temporarily():  # a backend may capture under dynamo's fake mode
                    literals[ph.name] = value.item()
            node.replace_all_uses_with(ph)
            graph.erase_node(node)
            last_placeholder.append(ph)
            constants.append(value)
    gm.recompile()
    del module_params
    return CapturedGraph(gm=gm, example_tensors=list(example_inputs) + constants,
                         out_spec=out_spec_box[-1], num_user_inputs=len(example_inputs),
                         constants=constants, fn=fn, literals=literals,
                         output_strides=_eager_strides(fn, example_inputs))


def _eager_strides(fn, example_inputs) -> list | None:
    """The strides of ``fn``'s flat outputs as eager lays them out, from a run on fake
    tensors with its ops undecomposed (``baddbmm`` with a transposed bias: contiguous in
    eager, transposed in its decomposition); None for a graph of the backend (its nodes
    are eager's ops already) or where the run fails (an output sized by values)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    if isinstance(fn, torch.fx.GraphModule):
        return None
    try:
        with unset_fake_temporarily(), buffers_kept(fn), FakeTensorMode(allow_non_fake_inputs=True) as mode:
            out = fn(*[mode.from_tensor(x) for x in example_inputs])
        return [tuple(t.stride()) if isinstance(t, torch.Tensor) else None for t in pytree.tree_flatten(out)[0]]
    except Exception:  # noqa: BLE001 - the decomposed trace's strides stand then
        return None


def _fake_like(node, value: torch.Tensor):
    """Meta for a constant: reuse the traced one if present, else a meta tensor copy."""
    if "val" in node.meta:
        return node.meta["val"]
    return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")


def whole_storage(x: torch.Tensor) -> torch.Tensor:
    """Every element of ``x``'s storage, as one flat tensor to fill ``x`` through: a view
    with a stride of 0 overlaps itself, and torch refuses to write random values into it."""
    return x.new_empty(0).set_(x.untyped_storage())


def real_examples(tensors) -> list:
    """Real tensors to run the graph on: the examples themselves, or, where they are fake
    (AOTAutograd hands compilers FakeTensors), random tensors of the same shape, dtype,
    strides and device. Random floats of two or more dims are scaled by 1/sqrt(last dim),
    as weights are initialised: at model sizes N(0, 1) weights overflow float16 within a
    layer, and a check between two overflowing computations tells nothing."""
    from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

    if not any(isinstance(t, FakeTensor) for t in tensors):
        return list(tensors)
    out = []
    with unset_fake_temporarily():
        for t in tensors:
            if not isinstance(t, FakeTensor):
                out.append(t)
                continue
            x = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
            flat = whole_storage(x)  # an expanded mask overlaps itself
            if t.dtype.is_floating_point:
                flat.normal_(std=t.shape[-1] ** -0.5 if t.dim() >= 2 and t.shape[-1] > 0 else 1.0)
            elif t.dtype == torch.bool:
                flat.copy_(torch.rand(flat.shape, device=t.device) > 0.5)
            else:
                flat.copy_(torch.randint(0, 8, flat.shape, device=t.device))
            out.append(x)
    return out
