"""Other views of a ProgramGraph: Graphviz DOT, Mermaid, and JSON (node-link)."""
from __future__ import annotations

import json

from .expr import format_expr, is_expr
from .graph import ProgramGraph

_SHAPES = {"gen": "box", "select": "box", "fork": "trapezium", "join": "invtrapezium", "branch": "diamond",
           "break": "octagon", "call": "component"}


def label(g: ProgramGraph, nid: int, width: int = 40) -> str:
    node = g.node(nid)
    a = node.attrs
    detail = {"text": lambda: repr(a["value"]), "arg": lambda: a["name"], "gen": lambda: a["name"],
              "select": lambda: f"{a['name']} {a['choices']}",
              "var": lambda: a["name"] + (f"[{a['index']}]" if "index" in a else ""),
              "fork": lambda: str(a["size"]), "fork_item": lambda: str(a["index"]), "join": lambda: a["mode"],
              "role_begin": lambda: a["role"], "role_end": lambda: a["role"], "image": lambda: str(a["source"]),
              "var_scope": lambda: f"{a['edge']} {a['name']}", "call": lambda: a["program"],
              "branch": lambda: f"{format_expr(a['var']) if is_expr(a['var']) else a['var']} {a['op']} "
                                f"{format_expr(a['value']) if is_expr(a['value']) else repr(a['value'])}",
              "break": lambda: a["reason"], "set_var": lambda: a["name"],
              "unordered": lambda: f"{len(a['segments'])} segments"}[node.kind]()
    detail = detail if len(detail) <= width else detail[:width - 3] + "..."
    return f"%{nid} {node.kind} {detail}"


def to_dot(g: ProgramGraph) -> str:
    lines = [f'digraph "{g.name}" {{', "  rankdir=TB;", '  node [fontname="monospace", fontsize=10];']
    for nid in g.order():
        text = label(g, nid).replace("\\", "\\\\").replace('"', '\\"')
        lines.append(f'  n{nid} [label="{text}", shape={_SHAPES.get(g.node(nid).kind, "ellipse")}];')
    for src, dst, a in g.edges():
        style = {"order": "solid", "data": "dashed", "fork": "bold"}[a["kind"]]
        extra = f', label="{a["when"]}"' if "when" in a else ""
        lines.append(f"  n{src} -> n{dst} [style={style}{extra}];")
    lines.append("}")
    return "\n".join(lines) + "\n"


def to_mermaid(g: ProgramGraph) -> str:
    lines = ["flowchart TD"]
    for nid in g.order():
        text = label(g, nid).replace('"', "#quot;")
        lines.append(f'  n{nid}["{text}"]')
    arrows = {"order": "-->", "data": "-.->", "fork": "==>"}
    for src, dst, a in g.edges():
        lines.append(f"  n{src} {arrows[a['kind']]}{'|' + a['when'] + '|' if 'when' in a else ''} n{dst}")
    return "\n".join(lines) + "\n"


def graph_dict(g: ProgramGraph) -> dict:
    return {
        "name": g.name, "params": list(g.params), "inputs": None if g.inputs is None else list(g.inputs),
        "nodes": [{"id": n, "kind": g.node(n).kind, "stream": g.node(n).stream, **g.node(n).attrs} for n in g.order()],
        "edges": [{"source": s, "target": d, **a} for s, d, a in g.edges()],
    }


def to_json(g: ProgramGraph) -> str:
    return json.dumps(graph_dict(g), indent=2, sort_keys=True, default=repr)


def graph_from_dict(d: dict) -> ProgramGraph:
    """The graph of `graph_dict(g)` (JSON data, e.g. from a client), validated. IRValidationError naming the node
    or edge at fault for anything malformed."""
    from .graph import IRValidationError

    if not isinstance(d, dict) or not isinstance(d.get("nodes"), list) or not isinstance(d.get("edges", []), list):
        raise IRValidationError("a program graph is an object with a `nodes` list and an `edges` list")
    params, inputs = d.get("params", []), d.get("inputs")
    if not isinstance(params, list) or not all(isinstance(p, str) for p in params) or \
            not (inputs is None or isinstance(inputs, list) and all(isinstance(p, str) for p in inputs)):
        raise IRValidationError("params and inputs must be lists of names")
    g = ProgramGraph(str(d.get("name", "program")), tuple(params), None if inputs is None else tuple(inputs))
    for k, n in enumerate(d["nodes"]):
        if not isinstance(n, dict) or not isinstance(n.get("id"), int) or isinstance(n.get("id"), bool):
            raise IRValidationError(f"nodes[{k}] must be an object with an integer id")
        attrs = {a: v for a, v in n.items() if a not in ("id", "kind", "stream")}
        stream = n.get("stream", 0)
        if not isinstance(stream, int) or n["id"] in g.g:
            raise IRValidationError(f"%{n['id']}: a duplicate id or a non-integer stream")
        try:
            g.add(n.get("kind"), stream=stream, node_id=n["id"], **attrs)
        except (IRValidationError, TypeError) as e:
            raise IRValidationError(f"%{n['id']}: {e}") from None
    for k, e in enumerate(d.get("edges", [])):
        ok = isinstance(e, dict) and e.get("source") in g.g and e.get("target") in g.g
        if not ok:
            raise IRValidationError(f"edges[{k}] must join two nodes of the graph (source, target)")
        try:
            g.connect(e["source"], e["target"], e.get("kind", "order"), e.get("when"))
        except IRValidationError as err:
            raise IRValidationError(f"edges[{k}]: {err}") from None
    return g.validate()
