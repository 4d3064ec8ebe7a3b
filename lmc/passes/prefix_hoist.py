"""prefix_hoist: find text every instance (or every branch of a fork) shares, so it is prefilled once.

Only hints are produced: nothing moves in the program's text, so its meaning never changes.
- `constant_prefix`: the leading constant run of the main stream (text and role markers up to the first
  argument, variable, gen, select, fork or branch). A batch prefills it once before its instances start.
- `fork_commit_texts`: for each fork, the text every branch starts with (up to its first non-constant node);
  the fork's commit hint prefills parent text + that shared text, so the branches find all of it cached.
"""
from __future__ import annotations

from ..ir import ProgramGraph

_CONSTANT = ("text", "role_begin", "role_end")


def _render(g: ProgramGraph, nid: int, template) -> str:
    node = g.node(nid)
    if node.kind == "text":
        return node.attrs["value"]
    return (template.prefix if node.kind == "role_begin" else template.suffix)[node.attrs["role"]]


def _constant_run(g: ProgramGraph, start: int | None, template) -> str:
    out, nid = [], start
    while nid is not None and g.node(nid).kind in _CONSTANT:
        node = g.node(nid)
        if node.kind == "role_begin" and node.attrs["role"] != "system" and template.default_system and not out:
            break  # the template may insert its default system turn here: not a constant of the graph
        out.append(_render(g, nid, template))
        nxt = g.successors(nid, "order")
        nid = nxt[0][0] if len(nxt) == 1 and "when" not in nxt[0][1] else None
    return "".join(out)


def constant_prefix(g: ProgramGraph, template) -> str:
    roots = [r for r in g.roots() if g.node(r).stream == 0]
    return _constant_run(g, roots[0] if roots else None, template)


def fork_commit_texts(g: ProgramGraph, template) -> dict[int, str]:
    """fork node -> text common to the start of all its branches."""
    out = {}
    for nid in g.g.nodes:
        if g.node(nid).kind != "fork":
            continue
        starts = []
        for item, _ in g.successors(nid, "fork"):
            nxt = g.successors(item, "order")
            starts.append(_constant_run(g, nxt[0][0] if nxt else None, template))
        common = starts[0] if starts else ""
        for s in starts[1:]:
            k = 0
            while k < min(len(common), len(s)) and common[k] == s[k]:
                k += 1
            common = common[:k]
        out[nid] = common
    return out
