"""The pass pipeline: every pass has one signature, a manager runs them in order, validating the graph after each.

A pass takes a segment graph and the target (the backend kind, its chat template, its tokenizer if any) and
returns the graph (rewritten in place, or a new one) and a stats record. What a pass decides for execution is
recorded in the stats under "plan" (fork commit texts, lowered selects, ...), from which the compiled program
builds the executor's Plan. Each pass can be switched off by name (`prog.compile(disable=[...])`,
`lmc compile --disable NAME`); `lmc compile --passes` lists them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ..ir import ProgramGraph
from ..passes import fork_commit_texts
from ..passes.api_speculation import plan_speculation
from ..passes.prefix_hoist import apply_aggressive_hoist, hoist_suggestions
from ..passes.select_lowering import single_token_selects


@dataclass(frozen=True)
class Target:
    """What the passes compile for. kind: "local" (the in-process engine), "endpoint" (a native lmc/SGLang
    server) or "openai" (an OpenAI-compatible API); capabilities: lmc.protocol.Capabilities."""
    kind: str
    chat_template: Any
    tokenizer: Any = None
    capabilities: Any = None


PassFn = Callable[[ProgramGraph, Target], "tuple[ProgramGraph, dict]"]


@dataclass(frozen=True)
class Pass:
    name: str
    doc: str
    run: PassFn
    default: bool = True  # on unless switched off (False: opt-in, it changes the program's prompts)


def _aggressive_hoist(g: ProgramGraph, target: Target):
    return g, {"hoisted_nodes": apply_aggressive_hoist(g)}


def _hoist_suggestions(g: ProgramGraph, target: Target):
    return g, {"suggestions": hoist_suggestions(g)}


def _fork_commit(g: ProgramGraph, target: Target):
    return g, {"plan": {"commits": fork_commit_texts(g, target.chat_template)}}


def _batch_prefix(g: ProgramGraph, target: Target):
    return g, {"plan": {"batch_prefix": True}}


def _select_lowering(g: ProgramGraph, target: Target):
    if target.tokenizer is None or not (target.capabilities and target.capabilities.token_id_selects):
        return g, {"plan": {}, "skipped": "the target cannot score choices by token id" if target.tokenizer
                   else "no tokenizer"}
    return g, {"plan": {"select_tokens": single_token_selects(g, target.chat_template, target.tokenizer)}}


def _fork_batch(g: ProgramGraph, target: Target):
    return g, {"plan": {"fork_batch": True}}


def _api_speculation(g: ProgramGraph, target: Target):
    return g, {"completion_groups": plan_speculation(g, False), "chat_groups": plan_speculation(g, True)}


PASSES: tuple[Pass, ...] = (
    Pass("aggressive_hoist", "move constant text before the arguments of its prompt (changes prompts; opt-in)",
         _aggressive_hoist, default=False),
    Pass("hoist_suggestions", "report constant text after an argument that could be shared if moved",
         _hoist_suggestions),
    Pass("batch_prefix", "prefill the prefix a batch's instances share once, ahead of them", _batch_prefix),
    Pass("fork_commit", "prefill a fork's parent text plus its branches' common start before the branches",
         _fork_commit),
    Pass("fork_batch", "run a fork's branches at once rather than one after another", _fork_batch),
    Pass("select_lowering", "score a select of single-token choices in one request", _select_lowering),
    Pass("api_speculation", "group consecutive gens that one over-generated API call can serve", _api_speculation),
)
PASS_NAMES = tuple(p.name for p in PASSES)


def check_pass_names(names) -> list[str]:
    unknown = [n for n in names if n not in PASS_NAMES]
    if unknown:
        raise ValueError(f"unknown pass(es) {unknown}; the passes are: {', '.join(PASS_NAMES)}")
    return list(names)


@dataclass
class PassManager:
    """Runs the enabled passes in PASSES order; `validate()` after each (and before the first)."""
    enabled: tuple[str, ...] = field(default_factory=lambda: tuple(p.name for p in PASSES if p.default))

    @classmethod
    def configure(cls, disable=(), enable=()) -> "PassManager":
        disable, enable = set(check_pass_names(disable)), set(check_pass_names(enable))
        return cls(tuple(p.name for p in PASSES if (p.default or p.name in enable) and p.name not in disable))

    def run(self, g: ProgramGraph, target: Target) -> tuple[ProgramGraph, dict[str, dict]]:
        g.validate()
        stats: dict[str, dict] = {}
        for p in PASSES:
            if p.name in self.enabled:
                g, stats[p.name] = p.run(g, target)
                g.validate()
        return g, stats
