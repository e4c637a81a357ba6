"""eqfuse: an equality-saturation kernel compiler for PyTorch.

    compiled = eqfuse.compile(fn, example_inputs)
    compiled(*inputs)         # same result as fn(*inputs)
    compiled.kernels          # generated Triton kernels
    compiled.library_calls    # plain products run as cuBLAS calls (on a GPU)
    compiled.explain()        # the plan in words
"""

import os as _os

import torch as _torch

# Without CUDA, kernels run in Triton's interpreter. Triton decides when it is imported
# whether its own library functions (tl.sum ...) are interpreted, so say so before then.
if "TRITON_INTERPRET" not in _os.environ and not _torch.cuda.is_available():
    _os.environ["TRITON_INTERPRET"] = "1"

from .errors import CaptureError, EqfuseError, ExtractionError, Unschedulable, Unsupported
from .runtime.compiled import VERSION as __version__
from .runtime.compiled import CompiledGraph, Options


def compile(fn, example_inputs, **options) -> CompiledGraph:
    """Compile ``fn`` (a function or nn.Module) for ``example_inputs``.

    Options: ``max_enodes`` (the e-graph's size limit), ``max_seconds`` (the plan search's
    budget: past it the best plan found so far is used), ``rules`` (rulesets to run, rules
    of one's own, ``"-name"`` for a built-in rule left out: eqfuse/workbench.py),
    ``autotune`` (time block-size candidates on the GPU), ``validate`` (check the extracted
    plan against the graph on the example inputs; on by default), ``cublas`` (plain
    products as cuBLAS calls on a GPU; on by default), ``emulate_precision_casts`` (round
    each half-precision result as eager does), ``share_layers`` (a GraphModule of repeated
    blocks compiled as its parts, the blocks once: a ``LayeredGraph``), and the others of
    ``eqfuse.Options``.
    """
    from .runtime import debug_dir
    from .runtime.layered import layered

    opts = Options.make(**options)
    compiled = layered(fn, example_inputs, opts) or CompiledGraph(fn, example_inputs, opts)
    debug_dir.dump(compiled, fn)  # under $EQFUSE_DEBUG_DIR only
    return compiled


__all__ = [
    "CaptureError",
    "CompiledGraph",
    "EqfuseError",
    "ExtractionError",
    "Options",
    "Unschedulable",
    "Unsupported",
    "__version__",
    "compile",
]
