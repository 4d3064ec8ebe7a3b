"""select_lowering: a select whose choices are each one token after the constant text before it (or after that text
less its last token: a word after a trailing space, as in "Action: " + select(["search", "finish"]), where " search"
is one token) is scored by one request (the next-token logprobs of the choices' ids) instead of one prefill per
choice.

The interpreter scores `select(choices)` with a request per choice (prompt + choice, prompt logprobs from two
tokens before the prompt's end). When the graph shows constant text right before the select (typically the chat
template's assistant header) and every choice tokenizes as exactly one token after that text, the choice ids are
known at compile time and one forward of the prompt (less the token the choices merge with) yields every score:
the same logprob vectors, so the same decision, with one request instead of n and no per-choice recomputation of
the prompt's tail (lmc.protocol.token_select_prompt). The ids ride in the plan's score operation
(lmc.compiler.lower); the backend still checks the tokenization of the real prompt at run time, and the score falls
back to its general form (a prefill of the prompt, then each choice as an extension of it) where it differs.
"""
from __future__ import annotations

from ..ir import ProgramGraph
from .prefix_hoist import render_constant


def _constant_tail(g: ProgramGraph, nid: int) -> list[int]:
    """The run of constant nodes that directly precedes `nid` in its stream (nearest last)."""
    run, cur = [], nid
    while True:
        preds = g.predecessors(cur, "order")
        if len(preds) != 1 or g.node(preds[0]).kind not in ("text", "role_begin", "role_end"):
            return run[::-1]
        cur = preds[0]
        run.append(cur)


def single_token_selects(g: ProgramGraph, template, tokenizer) -> dict[int, list[int]]:
    """select node -> the token id of each choice, for the selects that can be scored in one request."""
    out = {}
    for nid in g.g.nodes:
        node = g.node(nid)
        if node.kind != "select":
            continue
        tail = "".join(render_constant(g, n, template) for n in _constant_tail(g, nid))
        if not tail:
            continue  # what comes before is only known at run time: no plan to make
        base = tokenizer.encode(tail, add_special_tokens=False)
        fulls = [tokenizer.encode(tail + c, add_special_tokens=False) for c in node.attrs["choices"]]
        for cut in (len(base), len(base) - 1):  # after the text, or after the text less its last token
            if cut >= 1 and all(len(f) == cut + 1 and f[:cut] == base[:cut] for f in fulls):
                ids = [f[-1] for f in fulls]
                if len(set(ids)) == len(ids):
                    out[nid] = ids
                break
    return out
