"""``torch.compile(model, backend="eqfuse")``: a TorchDynamo backend.

Registered through the ``torch_dynamo_backends`` entry point, so installing eqfuse is
enough. AOTAutograd splits each captured graph into a forward and, when gradients are
needed, a backward graph of ATen ops, decomposed with eqfuse's table; eqfuse compiles
both. A graph eqfuse cannot compile (or one with dynamic shapes, not supported yet) runs
as AOTAutograd traced it, with a one-line warning: the user's program never fails
because of the compiler.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

import torch

log = logging.getLogger("eqfuse")

# The graphs this backend compiled most recently (forward and backward), newest last:
# ``eqfuse.backend.history[-1].explain()`` tells what became of the last one.
history: deque = deque(maxlen=32)


def _compiler(options: dict):
    from . import compile as eqfuse_compile
    from .errors import EqfuseError

    def compile_graph(gm: torch.fx.GraphModule, example_inputs):
        if not all(isinstance(x, torch.Tensor) for x in example_inputs):
            log.warning("eqfuse: graph with symbolic sizes runs uncompiled (dynamic shapes are not supported yet)")
            return gm
        try:
            compiled = eqfuse_compile(gm, example_inputs, **options)
        except EqfuseError as e:
            log.warning("eqfuse: graph runs uncompiled: %s", e)
            return gm
        history.append(compiled)
        for fb in compiled.fallbacks:
            log.info("eqfuse: eager: %s", fb)

        # Boxed (AOTAutograd's convention): the argument list is ours to empty, so that a
        # backward lets go of each saved activation after its last use
        def run(args: list):
            out = compiled.call_boxed(args)
            return out if isinstance(out, (tuple, list)) else (out,)
        run._boxed_call = True
        return run
    return compile_graph


def eqfuse_backend(gm: torch.fx.GraphModule, example_inputs, options: dict | None = None, **_: Any):
    """The dynamo backend. ``options`` are ``eqfuse.compile`` options, and ``recompute``
    (default False): True has the backward recompute cheap forward values instead of the
    forward saving them (AOTAutograd's min-cut partitioner, as Inductor uses); False saves
    every value the backward reads."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition

    options = dict(options or {})
    # Recomputing is not the default: on an H100 (benchmarks/models.py, fp16, training
    # step) it took the Llama layer from 44.1 to 49.5 ms for 0.7 GB less at the peak
    # (of 16.5), while BERT's step went from 1539 to 1306 us; GPT-2's graphs came out alike.
    partition = min_cut_rematerialization_partition if options.pop("recompute", False) else default_partition
    # Training graphs hand their activations on to the backward: CUDA graphs would only
    # double their memory (a recording whose outputs are held is not replayed), so they
    # are on for inference graphs unless asked for.
    training = _compiler({"cuda_graphs": False, **options})
    compiler = _compiler(options)
    # No decompositions at this level: eqfuse decomposes when it captures each graph, where
    # validation checks the result against the graph as AOTAutograd gave it. (With torch
    # 2.13's core decompositions here, AOTAutograd's own backward of a GPT-2 block on the
    # CPU was wrong, compilers aside.)
    backend = aot_autograd(fw_compiler=training, bw_compiler=training, inference_compiler=compiler,
                           partition_fn=partition)
    return backend(gm, example_inputs)


backend = eqfuse_backend
