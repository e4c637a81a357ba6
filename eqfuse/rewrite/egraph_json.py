"""The serialised e-graph, parsed into plain Python: e-classes of e-nodes, with the
primitive arguments (strings, integers, vectors) already turned into Python values.

A term's shape argument is checked against its class's shape analysis (``vshape``):
egglog 13.2 at times hands a term back with another vector of the e-graph in place of its
own (GPT-2's ``Reshape(addmm_2, Vec(8, 1024, 3072))`` seen as ``Vec(8, 3072, 3072)``;
GPT-NeoX's transposed weight read ``LoadStrided(w, Vec(4096, 1024), Vec(1, 4096))`` as
``LoadStrided(w, Vec(1, 4096), Vec(1, 4096))`` on an H200, every process, whose product
then had no kernel: the whole forward ran in eager). The analysis, set where the term was
made, names the shape; the term is read with it (``EGraphView.mended`` lists each), and
validation checks the plan as ever."""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass

CONSTRUCTORS = {"Input", "Kernel", "Load", "LoadStrided", "Const", "Iota", "Where", "Cast", "Broadcast",
                "Reshape", "Permute", "Slice", "Cat", "Gather", "Dot", "ExpDot", "ExpSum"}
OPERATOR_KINDS = ("Unary_", "Binary_", "Reduce_")  # Binary_add -> ENode("Binary", ("add", ...))
SHAPE_ARG = {"LoadStrided": 1, "Reshape": 1, "Broadcast": 1, "Iota": 0}  # where a term spells its shape


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

        shapes = {}  # value class -> its shape analysis
        for n in nodes.values():
            out = f"primitive-{n['eclass']}"
            if n["op"] == "vshape" and out in nodes:
                shapes[nodes[n["children"][0]]["eclass"]] = prim(out)
        self.mended: list[tuple] = []  # (e-node as egglog gave it, its shape as analysed)
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
            at, shape = SHAPE_ARG.get(op), shapes.get(n["eclass"])
            if at is not None and shape is not None and args[at] != shape and _mendable(op, args, shape):
                self.mended.append((ENode(op, tuple(args), n["eclass"]), shape))
                args[at] = shape
            self.classes[n["eclass"]].append(ENode(op, tuple(args), n["eclass"]))

    def is_term_class(self, cid: str) -> bool:
        t = self.class_type.get(cid, "")
        return t.endswith(".Value") or t.endswith(".Tensor")

    def is_value(self, cid: str) -> bool:
        return self.class_type.get(cid, "").endswith(".Value")

    def size(self) -> tuple[int, int]:
        return sum(len(v) for v in self.classes.values()), len(self.classes)


def _mendable(op: str, args: list, shape: tuple) -> bool:
    """Whether ``shape`` fits the term's other arguments: a read's strides are one per dim."""
    return op != "LoadStrided" or len(shape) == len(args[2])


def serialize(egraph) -> EGraphView:
    s = egraph._serialize(split_primitive_outputs=False)
    return EGraphView(s.to_json())
