"""api_speculation: plan which consecutive gens of a stream one over-generated API call can serve.

Completion-style endpoints: a run of gens separated only by constant text (no argument, no select, no role
change, no fork) is one call: generate past the first gen and match the constant text in the output to cut the
later values (SGLang's `num_api_spec_tokens`). Chat-style endpoints: the gens of one assistant turn are one call.
A gen that one call cannot serve (a constraint, a typed gen, logprobs, n > 1) ends a run. This pass plans; the
lowering puts each group into the plan's generate ops (lmc.compiler.lower), and the OpenAI backend executes
exactly those groups.
"""
from __future__ import annotations

from ..ir import ProgramGraph

_FILL = ("text",)
_UNSPECULABLE = ("regex", "json_schema", "dtype", "return_logprob")


def speculable(params: dict) -> bool:
    """Whether an over-generated call can serve this gen (its declared sampling options)."""
    return not any(params.get(k) for k in _UNSPECULABLE) and (params.get("n") or 1) == 1


def plan_speculation(g: ProgramGraph, chat: bool) -> list[list[int]]:
    """Groups of gen node ids, each served by one call (groups of one are left out)."""
    groups: list[list[int]] = []
    for stream in sorted({g.node(n).stream for n in g.g.nodes}):
        current: list[int] = []
        in_assistant = False
        for nid in (n for n in g.order() if g.node(n).stream == stream):
            kind = g.node(nid).kind
            if kind == "role_begin":
                in_assistant = g.node(nid).attrs["role"] == "assistant"
            if kind == "gen" and (not chat or in_assistant) and speculable(g.node(nid).attrs["params"]):
                current.append(nid)
                continue
            if kind in _FILL and (not chat or in_assistant):
                continue
            if kind == "role_end" and chat:
                in_assistant = False
            if len(current) > 1:
                groups.append(current)
            current = []
        if len(current) > 1:
            groups.append(current)
    return groups
