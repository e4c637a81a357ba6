"""The saturation schedule, driven from Python one step at a time.

egglog-python has no node or time limit of its own, so every step is one iteration of one
ruleset, after which the driver counts e-nodes and checks the clock. Phases, looped:

    algebra (bounded: commutativity would blow up) -> views -> fusion to a fixpoint

The loop ends when a whole round changes nothing (saturated), or on the node or time
limit; the report records which.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field


@dataclass
class Limits:
    max_enodes: int = 50_000
    max_seconds: float = 10.0
    algebra_iterations: int = 2  # per round: bounded
    max_rounds: int = 4


@dataclass
class SaturationReport:
    iterations: int = 0
    rounds: int = 0
    enodes: int = 0
    eclasses: int = 0
    rules_fired: Counter = field(default_factory=Counter)
    seconds: float = 0.0
    stop_reason: str = ""

    def as_dict(self) -> dict:
        return {"iterations": self.iterations, "rounds": self.rounds, "enodes": self.enodes,
                "eclasses": self.eclasses, "rules_fired": dict(self.rules_fired),
                "seconds": round(self.seconds, 4), "stop_reason": self.stop_reason}


def count_enodes(egraph) -> int:
    return sum(n for _, n in egraph.all_function_sizes())


def saturate(egraph, limits: Limits | None = None, enabled=("algebra", "views", "fusion"),
             rounding_kept: bool = False) -> SaturationReport:
    """Run the ``enabled`` rulesets within ``limits``; ``rounding_kept``: without the rules
    that drop a rounding to a narrow float (``rules.rulesets``). ``enabled`` is the option
    ``rules``: ruleset names, a user's rules, built-in rules left out (``rules.chosen``)."""
    from .rules import chosen, rulesets

    limits = limits or Limits()
    choice = chosen(enabled)
    enabled = choice.enabled
    rs = rulesets(rounding_kept, choice)
    report = SaturationReport()
    start = time.perf_counter()

    def step(name) -> bool:
        run = egraph.run(rs[name])
        report.iterations += 1
        for rule, n in run.num_matches_per_rule.items():
            if n:
                report.rules_fired[_rule_name(rule)] += n
        return run.updated

    def over_limit() -> str | None:
        report.enodes = count_enodes(egraph)
        if report.enodes > limits.max_enodes:
            return f"e-node limit ({report.enodes} > {limits.max_enodes})"
        if time.perf_counter() - start > limits.max_seconds:
            return f"time limit ({limits.max_seconds:g} s)"
        return None

    reason = None
    for _ in range(limits.max_rounds):
        report.rounds += 1
        changed = False
        for phase in ("algebra", "views", "fusion"):
            if phase not in enabled:
                continue
            iterations = limits.algebra_iterations if phase == "algebra" else 1_000
            for _ in range(iterations):  # fusion and views run to their fixpoint
                updated = step(phase)
                changed |= updated
                reason = over_limit()
                if reason or not updated:
                    break
            if reason:
                break
        if reason:
            break
        if not changed:
            reason = "saturated"
            break
    report.stop_reason = reason or f"round limit ({limits.max_rounds})"
    report.enodes = count_enodes(egraph)
    report.seconds = time.perf_counter() - start
    return report


def _rule_name(key) -> str:
    # Rules are declared with name=...; egglog reports them by a declaration carrying it.
    return getattr(key, "name", None) or str(key)
