"""prefix_hoist: find text every instance (or every branch of a fork) shares, so it is prefilled once.

Only hints are produced: nothing moves in the program's text, so its meaning never changes.
- `constant_prefix`: the leading constant run of the main stream (text and role markers up to the first
  argument, variable, gen, select, fork or branch). Given a batch's arguments, the run continues through the
  arguments and the prefix is what every instance's rendering shares (few-shot questions often share their
  first words too). A batch prefills it once before its instances start.
- `fork_commit_texts`: for each fork, the text every branch starts with (up to its first non-constant node);
  the fork's commit hint prefills parent text + that shared text, so the branches find all of it cached.
"""
from __future__ import annotations

import os

from ..ir import ProgramGraph

_CONSTANT = ("text", "role_begin", "role_end", "unordered")


def render_constant(g: ProgramGraph, nid: int, template, args: dict | None = None) -> str | None:
    node = g.node(nid)
    if node.kind == "arg":
        return None if args is None or node.attrs["name"] not in args else str(args[node.attrs["name"]])
    if node.kind == "text":
        return node.attrs["value"]
    if node.kind == "unordered":
        if any("text" not in p for seg in node.attrs["segments"] for p in seg):
            return None  # instance-dependent content (its sorted order depends on it too)
        return "".join(sorted("".join(p["text"] for p in seg) for seg in node.attrs["segments"]))
    return (template.prefix if node.kind == "role_begin" else template.suffix)[node.attrs["role"]]


def _constant_run(g: ProgramGraph, start: int | None, template, args: dict | None = None) -> str:
    out, nid = [], start
    while nid is not None and (g.node(nid).kind in _CONSTANT or (args is not None and g.node(nid).kind == "arg")):
        node = g.node(nid)
        if node.kind == "role_begin" and node.attrs["role"] != "system" and template.default_system and not out:
            break  # the template may insert its default system turn here: not a constant of the graph
        text = render_constant(g, nid, template, args)
        if text is None:
            break
        out.append(text)
        nxt = g.successors(nid, "order")
        nid = nxt[0][0] if len(nxt) == 1 and "when" not in nxt[0][1] else None
    return "".join(out)


def constant_prefix(g: ProgramGraph, template, instances: list[dict] | None = None) -> str:
    roots = [r for r in g.roots() if g.node(r).stream == 0]
    start = roots[0] if roots else None
    if not instances:
        return _constant_run(g, start, template)
    return os.path.commonprefix([_constant_run(g, start, template, args) for args in instances])


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


def hoist_suggestions(g: ProgramGraph) -> list[dict]:
    """Constant text placed after an argument inside one prompt (the paper's "instruction after the question"):
    moving it before the argument would make it shareable across instances, but changes the prompt, so it is
    only a suggestion unless hoisting is aggressive."""
    out = []
    for run in _prompt_runs(g):
        seen_arg = False
        for nid in run:
            kind = g.node(nid).kind
            seen_arg |= kind in ("arg", "var")
            if kind == "text" and seen_arg and g.node(nid).attrs["value"].strip():
                out.append({"node": nid, "text": g.node(nid).attrs["value"]})
    return out


def apply_aggressive_hoist(g: ProgramGraph) -> int:
    """Reorder each prompt run so its constant text comes before its arguments (opt-in: changes prompts)."""
    moved = 0
    for run in _prompt_runs(g):
        consts = [n for n in run if g.node(n).kind == "text"]
        others = [n for n in run if g.node(n).kind != "text"]
        first_other = next((i for i, n in enumerate(run) if g.node(n).kind != "text"), len(run))
        if consts == run[:len(consts)]:
            continue
        moved += sum(1 for i, n in enumerate(run) if g.node(n).kind == "text" and i > first_other)
        new = consts + others
        attrs = [(g.node(n).kind, dict(g.node(n).attrs)) for n in new]
        for nid, (kind, a) in zip(run, attrs):  # rewrite in place: the chain's edges stay valid
            g.g.nodes[nid]["node"] = type(g.node(nid))(kind, a, g.node(nid).stream)
    return moved


def _prompt_runs(g: ProgramGraph) -> list[list[int]]:
    """Maximal chains of text/arg nodes in one stream (a prompt piece between model calls)."""
    runs, seen = [], set()
    for nid in g.order():
        if nid in seen or g.node(nid).kind not in ("text", "arg"):
            continue
        run, cur = [], nid
        while cur is not None and g.node(cur).kind in ("text", "arg") and cur not in seen:
            run.append(cur)
            seen.add(cur)
            nxt = g.successors(cur, "order")
            cur = nxt[0][0] if len(nxt) == 1 and "when" not in nxt[0][1] and \
                len(g.predecessors(nxt[0][0], "order")) == 1 else None
        runs.append(run)
    return runs
