"""ProgramGraph: an LM program as a networkx DAG.

Nodes (kind -> attributes) follow the SGLang paper's IR plus what data-dependent control flow needs:
    text{value}  arg{name}  gen{name, params}  select{name, choices, method, temperature}  var{name}
    fork{size}  fork_item{index}  join{mode}  role_begin{role}  role_end{role}  image{source}
    var_scope{name, edge: begin|end}  call{name, program, args}  branch{var, op, value}  set_var{name, value}
    break{reason, line, resume, interpret}
A gen or select written without a name is named for the graph and marked `anonymous` (it sets no variable).
A var node may carry `index` (an item of a fork's gathered list) and `transforms` (argument-free str methods applied
to the value, e.g. ["strip"]). A set_var may carry `expr` instead of a constant value, and a branch's `var` (and its
`value`, where it compares two) may be an expression (lmc.ir.expr: host values computed from generated values and
their meta info, as data). A break ends
a segment where the program's host code needs concrete values: `resume` is the number of body operations before
it (where tracing resumes), `interpret` says the interpreter runs the rest instead. A segment traced after a
break reads variables produced before it: they are the graph's `inputs`.
A call runs another program with arguments made of text/arg/var parts; its variables read as var nodes named
"<call name>.<variable>". Every node belongs to a stream (an integer; 0 is the program's main stream, forks open new ones).
Edges have a kind: `order` (next operation of the same stream; out of a branch it also carries `when`, the
outcome that takes it), `data` (a var node reads what a gen/select produced), `fork` (fork -> each branch's
fork_item, and each branch's last node -> the join).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

import networkx as nx

from . import expr as _expr

NODE_KINDS: dict[str, tuple[str, ...]] = {
    "text": ("value",), "arg": ("name",), "gen": ("name", "params"),
    "select": ("name", "choices", "method", "temperature"), "var": ("name",), "fork": ("size",),
    "fork_item": ("index",), "join": ("mode",), "role_begin": ("role",), "role_end": ("role",),
    "image": ("source",), "var_scope": ("name", "edge"), "call": ("name", "program", "args"),
    "branch": ("var", "op", "value"), "break": ("reason", "line", "resume", "interpret"),
    "unordered": ("segments",), "set_var": ("name", "value"),
}
EDGE_KINDS = ("order", "data", "fork")


class IRValidationError(ValueError):
    pass


def _reads(nid: int, node: "Node") -> list[str]:
    """The variables a node reads by name: a var node's, and those of its expressions (a malformed one is an
    IRValidationError naming the problem)."""
    a = node.attrs
    if node.kind == "var":
        return [a["name"]]
    exprs = [a.get("expr")] if node.kind == "set_var" else [a["var"], a["value"]] if node.kind == "branch" else []
    out = []
    for e in filter(_expr.is_expr, exprs):
        problem = _expr.check(e)
        if problem:
            raise IRValidationError(f"%{nid} ({node.kind}): {problem}")
        out += _expr.reads(e)
    return out


@dataclass(frozen=True)
class Node:
    kind: str
    attrs: dict[str, Any] = field(default_factory=dict)
    stream: int = 0


class ProgramGraph:
    def __init__(self, name: str = "program", params: tuple[str, ...] = (), inputs: tuple[str, ...] | None = None):
        # inputs: None for a program's first segment; for a segment after a break, the variables defined before it
        self.name, self.params = name, tuple(params)
        self.inputs = None if inputs is None else tuple(inputs)
        self.g = nx.DiGraph()
        self._next = 0
        # Runtime only (not printed, not compared): the Program each call node names. A graph parsed from text
        # has none, so its calls cannot run. Likewise the choice-method object of a select (by node id), and the
        # body operation each node came from (what the executor records produced values under, for resuming).
        self.callees: dict[str, Any] = {}
        self.methods: dict[int, Any] = {}
        self.op_of: dict[int, int] = {}
        self.plans: dict[int, tuple[Any, Any]] = {}  # id(backend) -> (backend, the executor's plan for it)

    # ---- building ------------------------------------------------------------------------------------------
    def add(self, kind: str, stream: int = 0, after: int | None = None, node_id: int | None = None,
            **attrs) -> int:
        """Add a node (optionally with an `order` edge from `after`); returns its id."""
        if kind not in NODE_KINDS:
            raise IRValidationError(f"unknown node kind {kind!r}; kinds: {sorted(NODE_KINDS)}")
        nid = self._next if node_id is None else node_id
        self._next = max(self._next, nid + 1)
        self.g.add_node(nid, node=Node(kind, dict(attrs), stream))
        if after is not None:
            self.connect(after, nid, "order")
        return nid

    def connect(self, src: int, dst: int, kind: str = "order", when: str | None = None) -> None:
        if kind not in EDGE_KINDS:
            raise IRValidationError(f"unknown edge kind {kind!r}; kinds: {EDGE_KINDS}")
        if kind == "data" and self.g.has_edge(src, dst):
            return  # one edge per pair: an order edge already implies the dependency
        attrs = {"kind": kind}
        if when is not None:
            attrs["when"] = when
        self.g.add_edge(src, dst, **attrs)

    # ---- reading -------------------------------------------------------------------------------------------
    def node(self, nid: int) -> Node:
        return self.g.nodes[nid]["node"]

    def __len__(self) -> int:
        return self.g.number_of_nodes()

    def order(self) -> list[int]:
        """Node ids in a deterministic topological order (smallest id first among ready nodes)."""
        return list(nx.lexicographical_topological_sort(self.g))

    def edges(self) -> Iterator[tuple[int, int, dict]]:
        return iter(sorted(self.g.edges(data=True), key=lambda e: (e[0], e[1])))

    def successors(self, nid: int, kind: str = "order") -> list[tuple[int, dict]]:
        return sorted(((d, a) for _, d, a in self.g.out_edges(nid, data=True) if a["kind"] == kind),
                      key=lambda x: x[0])

    def predecessors(self, nid: int, kind: str | None = None) -> list[int]:
        return sorted(s for s, _, a in self.g.in_edges(nid, data=True) if kind is None or a["kind"] == kind)

    def roots(self) -> list[int]:
        return sorted(n for n in self.g.nodes if self.g.in_degree(n) == 0)

    def count(self, kind: str) -> int:
        return sum(1 for n in self.g.nodes if self.node(n).kind == kind)

    def __eq__(self, other) -> bool:
        if not isinstance(other, ProgramGraph):
            return NotImplemented
        return (self.name, self.params, self.inputs) == (other.name, other.params, other.inputs) and \
            {n: self.node(n) for n in self.g.nodes} == {n: other.node(n) for n in other.g.nodes} and \
            list(self.edges()) == list(other.edges())

    # ---- checks --------------------------------------------------------------------------------------------
    def validate(self) -> "ProgramGraph":
        """Clear errors for what no executor could run."""
        if not nx.is_directed_acyclic_graph(self.g):
            cycle = nx.find_cycle(self.g)
            raise IRValidationError(f"the graph has a cycle: {' -> '.join(f'%{a}' for a, _ in cycle)}")
        produced: set[str] = set(self.inputs or ())
        texts_before: dict[int, bool] = {}
        for nid in self.order():
            node = self.node(nid)
            missing = [a for a in NODE_KINDS[node.kind] if a not in node.attrs]
            if missing:
                raise IRValidationError(f"%{nid} ({node.kind}) lacks attribute(s) {missing}")
            preds = self.predecessors(nid, "order") + self.predecessors(nid, "fork")
            texts_before[nid] = node.kind in ("text", "arg", "var", "gen", "select", "role_begin", "unordered") or \
                any(texts_before[p] for p in preds)
            if node.kind == "fork" and self.inputs is None and not any(texts_before[p] for p in preds):
                raise IRValidationError(f"%{nid}: fork before any text (a fork shares its parent's prefix)")
            for name in _reads(nid, node):
                if name not in produced and name.split(".")[0] + "." not in produced:
                    raise IRValidationError(f"%{nid} reads variable {name!r}, which no earlier node defines")
            if node.kind in ("gen", "select") and node.attrs["name"] is not None:
                produced.add(node.attrs["name"])
            if node.kind == "set_var" or node.kind == "var_scope" and node.attrs["edge"] == "end":
                produced.add(node.attrs["name"])
            if node.kind == "call":
                produced.add(node.attrs["name"] + ".")
            if node.kind == "arg" and node.attrs["name"] not in self.params:
                raise IRValidationError(f"%{nid} reads argument {node.attrs['name']!r}, not a parameter of "
                                        f"{self.name}({', '.join(self.params)})")
        return self

    def static(self) -> bool:
        """No graph break: the whole program is this one segment."""
        return self.count("break") == 0

    def breaks(self) -> list[int]:
        return [n for n in self.order() if self.node(n).kind == "break"]
