"""Attention masks that are constants of the graph: a mask that keeps every key is no mask.

transformers 5 builds an attention mask under torch.compile where eager passes none (ViT,
transformers 5.17 and 5.24 on a GPU: ``arange(197) + 0 >= 0``, all True, expanded to
``[B, 1, 197, 197]`` with zero strides). The fused kernels refuse such a mask, so
AOTAutograd traces torch's math path: in a training graph the scores, a safe softmax and
float32 batched products on the CUDA cores, and their backward (ViT-B/16's training step,
2 layers, batch 32, H200: eqfuse's kernels 6.2 ms, torch.compile's 3.2, eager's cuDNN
attention 2.4). ``F.scaled_dot_product_attention`` with a bool mask that is all True, or a
float mask that is all zeros, computes what it computes without the mask, so dropping it
lets torch pick the fused attention (and its backward) as in eager.

A mask is a constant where nothing it is computed from is an input of the graph (only
factory ops, index arithmetic, literals and the graph's own attributes). Such a mask is
computed once here, at compile time, on the device the graph names, inside a forked
random state. One whose computation draws random numbers keeps its place: dropping it
would move every later draw of the random stream.
"""

from __future__ import annotations

import copy
import math

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx.operator_schemas import normalize_function

MAX_NODES = 200  # a constant mask computed by more nodes than this is left alone
MAX_ELEMENTS = 1 << 24  # and so is one with more elements


def without_constant_masks(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of dynamo's graph ``gm`` in which each ``F.scaled_dot_product_attention``
    whose mask is a constant that keeps every key has no mask (and the mask's computation,
    where nothing else reads it, is gone); ``gm`` itself where there is none. ``gm`` is
    never changed."""
    dropped = [n for n in gm.graph.nodes if _sdpa(n) and _keeps_every_key(gm, n)]
    if not dropped:
        return gm
    graph = copy.deepcopy(gm.graph)
    names = {n.name for n in dropped}
    for node in [n for n in graph.nodes if n.name in names]:
        kwargs = _arguments(node)
        mask = kwargs["attn_mask"]
        node.args, node.kwargs = (), {**kwargs, "attn_mask": None}
        _erase_unused(graph, mask)
    return torch.fx.GraphModule(gm, graph)


def _sdpa(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is torch.nn.functional.scaled_dot_product_attention


def _arguments(node: torch.fx.Node) -> dict:
    normalized = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True)
    return dict(normalized.kwargs) if normalized is not None else {}


def _keeps_every_key(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """Whether ``node``'s mask is a constant that masks nothing: all True (bool) or all
    zeros (added to the scores), broadcast to the scores' shape without enlarging it."""
    kwargs = _arguments(node)
    mask, q, k = kwargs.get("attn_mask"), kwargs.get("query"), kwargs.get("key")
    if not isinstance(mask, torch.fx.Node) or not all(isinstance(x, torch.fx.Node) for x in (q, k)):
        return False
    shapes = [_example(x) for x in (mask, q, k)]
    if any(s is None for s in shapes):
        return False
    mask_val, q_val, k_val = shapes
    scores = (*torch.broadcast_shapes(q_val.shape[:-2], k_val.shape[:-2]), q_val.shape[-2], k_val.shape[-2])
    try:
        if torch.broadcast_shapes(mask_val.shape, scores) != torch.Size(scores):
            return False
    except RuntimeError:
        return False
    if math.prod(mask_val.shape) > MAX_ELEMENTS:
        return False
    value = _constant_value(gm, mask)
    if value is None:
        return False
    return bool(value.all()) if value.dtype == torch.bool else bool((value == 0).all())


def _example(node: torch.fx.Node):
    value = node.meta.get("example_value", node.meta.get("val"))
    if not isinstance(value, torch.Tensor) or any(not isinstance(d, int) for d in value.shape):
        return None
    return value


def _constant_value(gm: torch.fx.GraphModule, mask: torch.fx.Node) -> torch.Tensor | None:
    """``mask``'s value where it is computed from no input of the graph and draws nothing
    from the random stream; None otherwise (or where computing it fails)."""
    needed, stack = {}, [mask]
    while stack:
        n = stack.pop()
        if n.name in needed:
            continue
        if n.op not in ("call_function", "call_method", "get_attr") or len(needed) >= MAX_NODES:
            return None  # an input of the graph (or a submodule call), or too long a computation
        needed[n.name] = n
        stack.extend(n.all_input_nodes)
    sub = torch.fx.Graph()
    env: dict = {}
    for n in gm.graph.nodes:  # in the graph's order, so each node's inputs come first
        if n.name in needed:
            env[n] = sub.node_copy(n, lambda x: env[x])
    sub.output(env[mask])
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    try:
        with unset_fake_temporarily(), torch.no_grad(), torch.random.fork_rng(devices=devices):
            before = _random_states()
            value = torch.fx.GraphModule(gm, sub)()
            if _random_states() != before:
                return None
    except Exception:  # noqa: BLE001 - a mask that cannot be computed here is left as it is
        return None
    return value if isinstance(value, torch.Tensor) else None


def _random_states() -> list:
    states = [torch.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states.append(torch.cuda.get_rng_state())
    return [bytes(s.numpy()) for s in states]


def _erase_unused(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    """Erase ``node`` and what computes it, as far as nothing else reads them."""
    stack = [node]
    while stack:
        n = stack.pop()
        if n.users or n.op not in ("call_function", "call_method"):
            continue
        inputs = n.all_input_nodes
        graph.erase_node(n)
        stack.extend(inputs)
