"""The rule workbench: what a rule of one's own, or a built-in rule left out, changes.

A researcher writes algebra rules in a file of their own, as the built-in ones are
written (``eqfuse.rewrite.rules.AlgebraRule`` over the builder: ``k.unary("exp", x)``,
``k.binary("mul", x, k.const(2.0))``, ``k.where(c, x, y)``; the op names of
``eqfuse.schema.ops``), listed in ``RULES``::

    from eqfuse.rewrite.rules import AlgebraRule
    RULES = [AlgebraRule("exp-log", 1, lambda k, x: (k.unary("exp", k.unary("log", x)), x), ("pos",))]

``eqfuse rules try my_rules.py`` checks each rule's soundness first (its sides on random
and special values, ``rewrite/soundness.py``), then compiles every example, and the zoo
families named with ``--zoo``, with the built-in rules and with them plus the file's,
and prints what changed: kernels, the modelled time of the plan, how often the rules
fired, and whether the outputs still match eager. ``eqfuse rules ablate NAME`` does the
same with a built-in rule left out. Both are the option ``rules`` of ``eqfuse.compile``
and of the backend: ``rules=(*RULESET_NAMES, my_rule)``, ``rules=(*RULESET_NAMES, "-name")``.
"""

from __future__ import annotations

import importlib.util
from collections import Counter
from dataclasses import dataclass, field

import torch

from .errors import EqfuseError
from .rewrite.rules import RULESET_NAMES, AlgebraRule


@dataclass
class Outcome:
    """A workload compiled under one choice of rules."""
    kernels: int
    fallbacks: int
    modelled_us: float
    fired: Counter = field(default_factory=Counter)
    matches: bool = True


def load_rules(path: str) -> list[AlgebraRule]:
    """The ``RULES`` list of the Python file at ``path``."""
    spec = importlib.util.spec_from_file_location("eqfuse_user_rules", path)
    if spec is None:
        raise EqfuseError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except FileNotFoundError:
        raise EqfuseError(f"no file {path}") from None
    found = getattr(module, "RULES", None)
    if not isinstance(found, (list, tuple)) or not found or not all(isinstance(r, AlgebraRule) for r in found):
        raise EqfuseError(f"{path} defines no RULES: a list of eqfuse.rewrite.rules.AlgebraRule")
    return list(found)


def _reports(graph) -> list:
    """A compiled graph's build reports: its own, or each part's (a graph in parts)."""
    return graph.report.get("parts", [graph.report])


def _outcome(graphs, matches: bool) -> Outcome:
    reports = [r for g in graphs for r in _reports(g)]
    fired: Counter = Counter()
    for r in reports:
        fired.update(r.get("saturation", {}).get("rules_fired", {}))
    modelled = sum(r.get("extraction", {}).get("plan_cost_us", 0.0) for r in reports)
    return Outcome(sum(len(g.kernels) for g in graphs), sum(len(g.fallbacks) for g in graphs),
                   round(modelled, 3), fired, matches)


def run_example(example, rules: tuple, device: str = "cpu") -> Outcome:
    """An example of ``eqfuse.examples`` at its demo shape, compiled under ``rules``."""
    import eqfuse

    from .examples import ATTENTION_EXAMPLES, MATMUL_EXAMPLES, matches

    torch.manual_seed(0)
    inputs = example.make_inputs(*example.demo_shape, torch.float32, device)
    compiled = eqfuse.compile(example.fn, inputs, rules=rules, plan_cache=False, autotune=False)
    contraction = example.name in MATMUL_EXAMPLES or example.name in ATTENTION_EXAMPLES
    return _outcome([compiled], matches(compiled(*inputs), example.fn(*inputs), contraction=contraction))


def run_family(name: str, rules: tuple, device: str = "cpu") -> Outcome:
    """A zoo family's tiny model, inference through ``torch.compile(backend="eqfuse")``."""
    import eqfuse.backend

    from . import zoo

    family = zoo.BY_NAME[name]
    model = zoo.family_model(family, device=device)
    kwargs = zoo.inputs(family, model)
    torch._dynamo.reset()
    eqfuse.backend.history.clear()
    with torch.no_grad():
        want = zoo.main_output(model(**kwargs))
        compiled = torch.compile(model, backend="eqfuse", options={"rules": rules, "plan_cache": False})
        got = zoo.main_output(compiled(**kwargs))
    graphs = list(eqfuse.backend.history)
    torch._dynamo.reset()
    scale = want.abs().max().item() if want.numel() else 0.0
    return _outcome(graphs, torch.allclose(got, want, rtol=1e-4, atol=1e-4 * scale))


def workloads(only=None, zoo_families=()) -> list:
    """(name, runner) for the examples whose name contains any of ``only`` (all by
    default) and the zoo families named."""
    from .examples import ALL_EXAMPLES

    chosen = [(name, lambda rules, ex=ex: run_example(ex, rules)) for name, ex in ALL_EXAMPLES.items()
              if not only or any(o in name for o in only)]
    return chosen + [(f"zoo:{f}", lambda rules, f=f: run_family(f, rules)) for f in zoo_families]


def compare(variant: tuple, baseline: tuple = RULESET_NAMES, only=None, zoo_families=(), progress=None) -> list[dict]:
    """Each workload under ``baseline`` and under ``variant`` (values of the option
    ``rules``): a row of what each gave."""
    rows = []
    chosen = workloads(only, zoo_families)
    for i, (name, run) in enumerate(chosen):
        if progress:
            progress(f"[{i + 1}/{len(chosen)}] {name}")
        rows.append({"workload": name, "baseline": run(baseline), "variant": run(variant)})
    return rows


def format_rows(rows: list[dict], watched: list[str]) -> str:
    """The rows as a table: kernels, modelled microseconds and the ``watched`` rules'
    firings, baseline -> variant; then how many workloads changed."""
    head = f"{'workload':28s} {'kernels':>9s} {'modelled us':>21s} {'fired':>11s}  eager"
    lines = [head, "-" * len(head)]
    changed = 0
    for r in rows:
        b, v = r["baseline"], r["variant"]
        fired_b, fired_v = (sum(o.fired[name] for name in watched) for o in (b, v))
        differs = (b.kernels, b.modelled_us, b.fallbacks) != (v.kernels, v.modelled_us, v.fallbacks)
        changed += differs
        mark = "" if v.matches else "   DIFFERS FROM EAGER"
        modelled = f"{b.modelled_us:>10.3f}->{v.modelled_us:<10.3f}"
        lines.append(f"{r['workload']:28s} {b.kernels:>4d}->{v.kernels:<4d} {modelled} {fired_b:>5d}->{fired_v:<5d}  "
                     f"{'ok' if v.matches else 'no'}{mark}" + ("   *" if differs else ""))
    lines.append(f"\n{changed} of {len(rows)} workloads changed (*); 'fired': {', '.join(watched)}")
    return "\n".join(lines)
