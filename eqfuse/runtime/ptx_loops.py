"""Keeps ptxas from unrolling the K loops of eqfuse's tensor-core kernels.

A product's K loop has a trip count known at compile time (K and BLOCK_K are
constexprs), and ptxas sometimes unrolls it whole: BERT's weight-gradient product
(768 x 768, K = 4096, 128 x 128 tiles on 8 warps) became 128 HGMMA instructions of SASS
in place of 4, and ptxas took 3.4 s over it on an H100 host, against 0.03 s for the same
loop kept (its cubin the slowest of the training step's 45, so the step's cold compile
waited on it). Whether ptxas unrolls follows no rule eqfuse can see: the same loop with
B read K-major, or with 128 x 256 tiles, stayed a loop.

So Triton's PTX stage is wrapped (``knobs.runtime.add_stages_inspection_hook``, chained
after any hook already set): in PTX that eqfuse generated, each product's K loop (see
``nounroll_products``) gets ``.pragma "nounroll";`` in its header block, which ptxas
honours. The loads are software-pipelined by Triton either way (its ``num_stages``), not
by ptxas's unrolling; the weight gradient above ran 21.9 us kept against 20.6 unrolled
(benchmarks/nounroll_probe.py), for 4 s less of compile.

Only PTX whose ``.file`` names a module eqfuse wrote (``eqfuse_<key>.py`` in its cache,
or the module an export compiles, named to ``install``) is touched; other Triton kernels
in the process compile as they would. The mark is not in Triton's cache key: a kernel
compiled before this module existed stays unrolled in that cache.

The module imports nothing of eqfuse: the compile workers (compile_worker.py, a script
that imports no eqfuse) install it too.
"""

from __future__ import annotations

import os
import re

ENABLED = True  # benchmarks/nounroll_probe.py turns it off to compare
# LLVM's NVPTX printer marks each loop's header block: "$L__BB0_1: // =>This Inner Loop Header: Depth=1"
INNER_LOOP_HEADER = re.compile(r"^(\$L__BB\w+):[^\n]*Inner Loop Header", re.M)
# `.file 1 "/path/eqfuse_<key>.py"`, or `.file 1 "/path" "eqfuse_<key>.py"`
FILE = re.compile(r'^\s*\.file\s+\d+\s+(.*)$', re.M)
GENERATED = re.compile(r'[/"]eqfuse_\w+\.py"')  # runtime/cache.py's load_module names them so
_also: set[str] = set()  # further modules' paths (an export's kernels.py)
PRAGMA = '\t.pragma "nounroll";'


def nounroll_products(ptx: str) -> str:
    """``ptx`` with ``.pragma "nounroll";`` opening each product's K loop: an innermost loop
    (its header's label up to the last branch back to it) that issues ``wgmma.mma_async``,
    computes no exponential (an attention kernel's key loop is left as ptxas makes it:
    marked, the causal one measured 6% slower on an H100, where identical kernels differed
    by up to 4% in that probe) and whose back branch tests its counter against a constant
    (a trip count known at compile time: the loops ptxas unrolls whole)."""
    out, done = [], 0
    for header in INNER_LOOP_HEADER.finditer(ptx):
        branch = re.compile(rf"@(%p\d+)\s+bra(?:\.uni)?\s+{re.escape(header.group(1))};")
        branches = list(branch.finditer(ptx, header.end()))
        if not branches:
            continue
        back = branches[-1]  # the last branch back to the header closes the loop
        body = ptx[header.end():back.start()]
        counted = re.search(rf"setp\.[\w.]+\s+{re.escape(back.group(1))},\s*%\w+,\s*-?\d+;", body)
        if "wgmma.mma_async" not in body or "ex2." in body or not counted:
            continue
        line_end = ptx.find("\n", header.end()) + 1 or len(ptx)
        out += [ptx[done:line_end], PRAGMA + "\n"]
        done = line_end
    return "".join(out) + ptx[done:]


def _generated(ptx: str) -> bool:
    """Whether a ``.file`` of ``ptx`` is a module eqfuse wrote."""
    return any(GENERATED.search(line) or any(os.path.dirname(p) in line and os.path.basename(p) in line
                                             for p in _also)
               for line in FILE.findall(ptx))


def _wrap_ptx_stage(stages: dict) -> None:
    make_ptx = stages.get("ptx")
    if make_ptx is None:
        return

    def ptx_stage(src, metadata):
        ptx = make_ptx(src, metadata)
        if ENABLED and isinstance(ptx, str) and _generated(ptx):
            return nounroll_products(ptx)
        return ptx
    stages["ptx"] = ptx_stage


def install(also=()) -> None:
    """Wrap Triton's PTX stage in this process (once; any hook set before runs first);
    ``also``: paths of further modules whose kernels are eqfuse's."""
    try:
        from triton import knobs
        knobs.runtime.add_stages_inspection_hook  # noqa: B018 - Triton 3.4 or later has the hook
    except (ImportError, AttributeError):
        return  # an older Triton: ptxas unrolls as it will
    _also.update(str(p) for p in also)
    before = knobs.runtime.add_stages_inspection_hook
    if getattr(before, "eqfuse_nounroll", False):
        return

    def hook(backend, stages, options, language, capability):
        if before is not None:
            before(backend, stages, options, language, capability)
        _wrap_ptx_stage(stages)
    hook.eqfuse_nounroll = True
    knobs.runtime.add_stages_inspection_hook = hook
