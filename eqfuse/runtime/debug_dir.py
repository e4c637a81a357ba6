"""``EQFUSE_DEBUG_DIR``: each compiled graph written to a directory of its own, for a bug
report or a look at what a model became (as ``TORCH_COMPILE_DEBUG`` does for Inductor).

``<dir>/<pid>_<n>_<title>/`` holds ``graph.py`` (the FX graph eqfuse was given),
``explain.txt`` (the plan in words: saturation, rules fired, kernels, eager steps and
why), ``kernels.py`` (the generated Triton module) and ``report.json`` (the build's
figures: phases' seconds, e-graph size, modelled time).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
from pathlib import Path

ENV = "EQFUSE_DEBUG_DIR"
_counter = itertools.count()
log = logging.getLogger("eqfuse")


def dump(compiled, fn) -> Path | None:
    """Write ``compiled`` (a CompiledGraph or LayeredGraph of ``fn``) under
    ``$EQFUSE_DEBUG_DIR``; the directory written, or None where the variable is unset. A
    directory that cannot be written is a warning, never a failed compile."""
    root = os.environ.get(ENV)
    if not root:
        return None
    title = re.sub(r"\W+", "_", getattr(fn, "__name__", type(fn).__name__))[:40]
    where = Path(root) / f"{os.getpid()}_{next(_counter):03d}_{title}"
    code = getattr(fn, "code", None)  # a GraphModule's Python
    try:
        where.mkdir(parents=True, exist_ok=True)
        (where / "graph.py").write_text(code if isinstance(code, str) else f"# not a GraphModule: {fn!r}\n")
        (where / "explain.txt").write_text(compiled.explain() + "\n")
        (where / "kernels.py").write_text(compiled.source)
        (where / "report.json").write_text(json.dumps(compiled.report, indent=1, default=str))
    except OSError as e:
        log.warning("eqfuse: %s=%s: cannot write %s: %s", ENV, root, where, e)
        return None
    return where
