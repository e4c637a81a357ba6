"""The serialised e-graph, parsed into plain Python: e-classes of e-nodes, with the
primitive arguments (strings, integers, vectors) already turned into Python values."""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass

CONSTRUCTORS = {"Input", "Kernel", "Load", "LoadStrided", "Const", "Iota", "Where", "Cast", "Broadcast",
                "Reshape", "Permute", "Slice", "Cat", "Gather", "Dot", "ExpDot", "ExpSum"}
OPERATOR_KINDS = ("Unary_", "Binary_", "Reduce_")  # Binary_add -> ENode("Binary", ("add", ...))


@dataclass(frozen=True)
class ENode:
    op: str
    args: tuple  # e-class ids (str) for Value/Tensor children, Python values for primitives
    eclass: str

    def children(self, is_class) -> list[str]:
        return [a for a in self.args if isinstance(a, str) and is_class(a)]


class EGraphView:
    def __init__(self, serialized_json: str):
        data = json.loads(serialized_json)
        nodes = data["nodes"]
        self.class_type = {cid: d.get("type", "") for cid, d in data.get("class_data", {}).items()}
        self.lets: dict[str, str] = {}
        for cid, d in data.get("class_data", {}).items():
            for name in (d.get("let") or "").split(","):
                name = name.strip().lstrip("$")
                if name:
                    self.lets[name] = cid
        self.classes: dict[str, list[ENode]] = defaultdict(list)
        memo: dict[str, object] = {}

        def prim(node_id):
            if node_id in memo:
                return memo[node_id]
            n = nodes[node_id]
            op = n["op"]
            if op.startswith('"'):
                v = json.loads(op)
            elif op in ("Vec", "vec-of") or op.startswith("Vec"):
                v = tuple(prim(c) for c in n["children"])
            else:
                try:
                    v = int(op)
                except ValueError:
                    v = float(op)
            memo[node_id] = v
            return v

        for n in nodes.values():
            op, args = n["op"], []
            kind = next((k for k in OPERATOR_KINDS if op.startswith(k)), None)
            if kind is not None:
                op, args = kind[:-1], [op[len(kind):]]
            elif op not in CONSTRUCTORS:
                continue
            for c in n["children"]:
                cclass = nodes[c]["eclass"]
                args.append(cclass if self.is_term_class(cclass) else prim(c))
            self.classes[n["eclass"]].append(ENode(op, tuple(args), n["eclass"]))

    def is_term_class(self, cid: str) -> bool:
        t = self.class_type.get(cid, "")
        return t.endswith(".Value") or t.endswith(".Tensor")

    def is_value(self, cid: str) -> bool:
        return self.class_type.get(cid, "").endswith(".Value")

    def size(self) -> tuple[int, int]:
        return sum(len(v) for v in self.classes.values()), len(self.classes)


def serialize(egraph) -> EGraphView:
    s = egraph._serialize(split_primitive_outputs=False)
    return EGraphView(s.to_json())
