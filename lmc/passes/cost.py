"""Cost model: model calls, prefill tokens and cached tokens for a batch of program instances, estimated with
the real tokenizer by replaying the graph's prompts against a simulated prefix cache.

The prompts are what the stream sends (the template's default system turn included), and the cache replay follows
the engine's scheduler (the last token, and the positions a select scores, are recomputed); tests/test_golden.py
checks the counts against the engine's own. Arguments take example values (or a placeholder), a gen's output is
estimated by `max_new_tokens` filler tokens.
Graphs with branches are costed along their first outcome; costing stops at a graph break (what follows depends on
run-time values).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..ir import ProgramGraph


class _Trie:
    """Longest cached prefix of a token sequence (a radix tree without values)."""

    def __init__(self):
        self.root: dict = {}

    def match_insert(self, tokens: list[int]) -> int:
        node, matched = self.root, 0
        for t in tokens:
            if t in node:
                node, matched = node[t], matched + 1
            else:
                break
        for t in tokens[matched:]:
            node = node.setdefault(t, {})
        return matched


@dataclass
class Cost:
    calls: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0

    @property
    def prefill_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    def as_dict(self) -> dict:
        return {"calls": self.calls, "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "prefill_tokens": self.prefill_tokens}


def estimate(g: ProgramGraph, template, tokenize, instances: list[dict], cache: bool = True,
             batch_prefix: str = "", fork_commits: dict[int, str] | None = None,
             lowered_selects: frozenset[int] = frozenset()) -> Cost:
    cost, trie = Cost(), _Trie()

    def call(prompt: str, scored_from: str | None = None) -> None:
        """One request. As the engine's scheduler does, at least its last token is recomputed (its logits are
        needed), and so is every position whose logprob it returns: a select scores its choices from two tokens
        before the end of `scored_from`, the prompt without the choice (lmc.backend.local)."""
        tokens = tokenize(prompt)
        cost.calls += 1
        cost.prompt_tokens += len(tokens)
        limit = len(tokens) - 1
        if scored_from is not None:
            limit = min(limit, max(len(tokenize(scored_from)) - 3, 0))
        hit = min(trie.match_insert(tokens), max(limit, 0))
        cost.cached_tokens += hit if cache else 0

    if batch_prefix:
        call(batch_prefix)  # the hoisted prefill is a call of its own
    _replay(g, template, instances, call, fork_commits or {}, lowered_selects)
    return cost


def first_prompts(g: ProgramGraph, template, instances: list[dict]) -> list[str]:
    """Each instance's first model call's prompt (the cost model's placeholders for arguments not given)."""
    prompts: list[list[str]] = []

    def call(prompt: str, scored_from: str | None = None) -> None:
        prompts[-1].append(prompt)

    _replay(g, template, instances, call, {}, frozenset(), before_each=lambda: prompts.append([]))
    return [p[0] for p in prompts if p]


def token_aligned_hint(hint: str, prompts: list[str], tokenize) -> str:
    """The longest start of a prefill hint whose tokens begin every prompt's tokens. A hint cut inside a token
    ("Q: " where the prompts go on "Q: What", a space token against " What") leaves its last token one that no
    prompt matches: prefilled for nothing, every time the hint is sent."""
    wanted = [tokenize(p) for p in prompts]
    cut = hint
    while cut:
        tokens = tokenize(cut)
        if all(w[:len(tokens)] == tokens for w in wanted):
            return cut
        cut = cut[:-1]
    return ""


def _replay(g, template, instances, call, commits, lowered, before_each=lambda: None) -> None:
    for i, args in enumerate(instances):
        args = {**{p: f"<{p} #{i}>" for p in g.params}, **args}  # placeholders differ between instances
        before_each()
        _walk(g, next((r for r in g.roots() if g.node(r).stream == 0), None), "", args, call, template, commits,
              lowered)


def _walk(g, nid, text, args, call, template, commits, lowered) -> str:
    while nid is not None:
        node = g.node(nid)
        a = node.attrs
        nxt = g.successors(nid, "order")
        if node.kind == "text":
            text += a["value"]
        elif node.kind == "arg":
            text += str(args[a["name"]])
        elif node.kind == "role_begin":
            if a["role"] != "system" and not text:  # what the stream sends: the template's default system turn
                text += template.default_system
            text += template.prefix[a["role"]]
        elif node.kind == "role_end":
            text += template.suffix[a["role"]]
        elif node.kind == "unordered":
            segs = ["".join(p["text"] if "text" in p else str(args.get(p["arg"], "")) for p in seg)
                    for seg in a["segments"]]
            text += "".join(sorted(segs))
        elif node.kind == "gen":
            call(text)
            text += " x" * int(a["params"].get("max_new_tokens", 16))
        elif node.kind == "select":
            for choice in ([""] if nid in lowered else a["choices"]):  # lowered: one call scores every choice
                call(text + choice, scored_from=text)
            text += a["choices"][0]
        elif node.kind == "var":
            text += " x" * 8
        elif node.kind == "fork":
            if len(g.successors(nid, "fork")) > 1:
                call(text + commits.get(nid, ""))  # the fork's commit hint is a prefill call
            for item, _ in g.successors(nid, "fork"):
                first = g.successors(item, "order")
                _walk(g, first[0][0] if first else None, text, args, call, template, commits, lowered)
            join = nxt[0][0]
            nxt = g.successors(join, "order")
        elif node.kind == "branch":
            nxt = [e for e in nxt if e[1].get("when") == "false"] or nxt
        elif node.kind == "break":
            return text
        nid = nxt[0][0] if nxt else None
    return text
