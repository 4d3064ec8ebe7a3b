"""Program hints from the plan: for each LM call of a segment, what remains of its instance after it.

The plan executor sets `stream.hints` (`request_hints`, from the table of the plan's graph) before each generate
and score operation; they are the current hints while that call runs (lmc.protocol.current_hints), and backends
send them with each request (Req.program in the engine, `program` on an lmc server, `nvext` on Dynamo). A plan
loaded from data has no graph: its table comes with it (`table_json`, the `hints` of POST /v1/programs), or its
calls carry no hints.

Per call node n of a segment graph (computed once per graph and default token budget):
- calls_left: the longest chain of LM calls (gen, select, nested call) from n to the segment's end, n included:
  order and fork edges, so parallel branches count once and a branch node's outcomes by the longer one;
- tokens_left: the tokens every node that is not an ancestor of n may generate (gen: max_new_tokens x n, select:
  at most 1), an upper bound of what the instance still generates; None when a break or a nested call is among
  them (host code or another program decides what follows);
- next_use: program steps from n to the nearest later step u that extends n's prompt: a gen/select on n's stream
  or a fork branch of it, or a break there (its host code resumes the stream). For a fork branch, the parent's
  stream after the join counts: the join continues the parent's text, the prefix the branch's prompt starts with
  (the judges' article: without it the instance looked finished once its branches were, and the merge after them
  found the article evicted). The steps are the LM calls (nested ones too) and breaks that must finish after n up
  to and including u, those of parallel branches included: the ledger's step clock counts every finished request
  of the instance, so a branch's next use at the join is as far as the sibling branches' calls plus u.
"""
from __future__ import annotations

import weakref
from collections import deque
from dataclasses import asdict, dataclass, fields

import networkx as nx

from ..ir import ProgramGraph
from ..protocol.hints import ProgramHints, instance_id

_CALLS = ("gen", "select", "call")


@dataclass(frozen=True)
class NodeHints:
    calls_left: int
    tokens_left: int | None
    next_use: int | None


def _tokens(g: ProgramGraph, nid: int, default_max: int) -> int | None:
    node = g.node(nid)
    if node.kind == "gen":
        p = node.attrs["params"]
        return (p.get("max_new_tokens") or default_max) * (p.get("n") or 1)
    if node.kind == "select":
        return 1
    return None if node.kind in ("call", "break") else 0


def _flow(g: ProgramGraph, nid: int) -> list[int]:
    """Successors along the program's flow: order and fork edges."""
    return [d for d, _ in g.successors(nid, "order") + g.successors(nid, "fork")]


def segment_hints(g: ProgramGraph, default_max_tokens: int = 128) -> dict[int, NodeHints]:
    """NodeHints of every gen/select/call node of `g` (see the module docstring)."""
    order = g.order()
    calls: dict[int, int] = {}
    for nid in reversed(order):
        own = 1 if g.node(nid).kind in _CALLS else 0
        calls[nid] = own + max((calls[s] for s in _flow(g, nid)), default=0)
    tokens = {nid: _tokens(g, nid, default_max_tokens) for nid in order}
    out: dict[int, NodeHints] = {}
    for nid in order:
        if g.node(nid).kind not in _CALLS:
            continue
        before = nx.ancestors(g.g, nid)
        left = [tokens[m] for m in order if m not in before]
        out[nid] = NodeHints(calls[nid], None if None in left else sum(left), _next_use(g, nid))
    return out


def _next_use(g: ProgramGraph, start: int) -> int | None:
    """Steps until the nearest node that extends `start`'s prompt (module docstring). The nearest is found by a
    0-1 BFS along the flow (a nested call on the way costs a step); its steps are then counted over the graph."""
    dist = {start: 0}
    todo = deque([start])
    while todo:
        nid = todo.popleft()
        for s in _flow(g, nid):
            kind = g.node(s).kind
            if kind in ("gen", "select", "break"):
                done = nx.ancestors(g.g, start) | {start}
                return sum(1 for m in nx.ancestors(g.g, s) | {s}
                           if m not in done and g.node(m).kind in _CALLS + ("break",))
            d = dist[nid] + (kind == "call")
            if s not in dist or d < dist[s]:
                dist[s] = d
                (todo.append if kind == "call" else todo.appendleft)(s)
    return None


_tables: dict[tuple[int, int], dict[int, NodeHints]] = {}


def hints_table(g: ProgramGraph, stream) -> dict[int, NodeHints]:
    """`segment_hints` of `g` for the stream's default token budget, computed once per graph and budget, and
    dropped with the graph."""
    key = (id(g), stream.defaults.max_new_tokens or 128)
    table = _tables.get(key)
    if table is None:
        table = _tables[key] = segment_hints(g, key[1])
        weakref.finalize(g, _tables.pop, key, None)
    return table


def table_json(table: dict[int, NodeHints]) -> dict[str, dict]:
    """A hints table as JSON data (what lmc.compiler.remote sends with a plan: plan data holds no graph)."""
    return {str(n): asdict(h) for n, h in table.items()}


def table_from_json(data) -> dict[int, NodeHints]:
    """The table of `table_json` data; ValueError naming the node and field that is malformed."""
    if not isinstance(data, dict):
        raise ValueError("hints must map node ids to {calls_left, tokens_left, next_use}")
    out = {}
    for k, h in data.items():
        names = [f.name for f in fields(NodeHints)]
        if not (isinstance(k, str) and k.isdigit()) or not isinstance(h, dict) or set(h) != set(names):
            raise ValueError(f"hints[{k!r}]: a node id mapped to an object of exactly {names}")
        for name in names:
            v = h[name]
            if not (v is None and name != "calls_left") and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise ValueError(f"hints[{k!r}].{name} must be a non-negative integer"
                                 f"{'' if name == 'calls_left' else ' or null'}")
        out[int(k)] = NodeHints(**h)
    return out


def request_hints(table: dict[int, NodeHints], nid: int, stream, program: str) -> ProgramHints | None:
    """The ProgramHints of call node `nid` of a segment of `program` run on `stream` (None for a node that makes
    no LM call)."""
    h = table.get(nid)
    if h is None:
        return None
    return ProgramHints(instance_id(stream), h.calls_left, h.tokens_left, h.next_use, program)
