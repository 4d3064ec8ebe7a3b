"""Other views of a ProgramGraph: Graphviz DOT, Mermaid, and JSON (node-link)."""
from __future__ import annotations

import json

from .graph import ProgramGraph

_SHAPES = {"gen": "box", "select": "box", "fork": "trapezium", "join": "invtrapezium", "branch": "diamond",
           "break": "octagon", "call": "component"}


def label(g: ProgramGraph, nid: int, width: int = 40) -> str:
    node = g.node(nid)
    a = node.attrs
    detail = {"text": lambda: repr(a["value"]), "arg": lambda: a["name"], "gen": lambda: a["name"],
              "select": lambda: f"{a['name']} {a['choices']}", "var": lambda: a["name"],
              "fork": lambda: str(a["size"]), "fork_item": lambda: str(a["index"]), "join": lambda: a["mode"],
              "role_begin": lambda: a["role"], "role_end": lambda: a["role"], "image": lambda: str(a["source"]),
              "var_scope": lambda: f"{a['edge']} {a['name']}", "call": lambda: a["program"],
              "branch": lambda: f"{a['var']} {a['op']} {a['value']!r}", "break": lambda: a["reason"],
              "set_var": lambda: a["name"],
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
