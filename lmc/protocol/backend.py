"""The interface every backend implements (all coroutines run on the frontend's event loop), with what a
backend can do declared as data, not probed for."""
from __future__ import annotations

import contextvars
from dataclasses import dataclass
from typing import Any, AsyncIterator, Protocol

from .chat_template import ChatTemplate
from .choices import ChoicesDecision, ChoicesSamplingMethod
from .params import GenParams, Image


@dataclass(frozen=True)
class Capabilities:
    """What a backend offers beyond the protocol's required methods.

    images: it accepts image() content (a vision model behind an API).
    token_id_selects: `select_tokens` scores single-token choices by their ids in one request (select lowering).
    batch_prefix_sharing: it computes a prefix shared by queued requests once (a batch needs no prefix hint).
    server_plans: it runs a compiled segment whole, server-side (lmc.RuntimeEndpoint on an lmc server, through
        POST /v1/programs; lmc.compiler.remote).
    planned_speculation: `generate` takes `speculation=SpecStep`, and runs API speculation as a plan says.
    engine_chains: `chain(steps)` runs a chain of gens and single-token selects as one engine request that keeps
        its KV between them, and a fork ending it as child requests on that KV (lmc.Local;
        lmc.runtime.continuation), streaming each step's result (a branch's tagged with it).
    """
    images: bool = False
    token_id_selects: bool = False
    batch_prefix_sharing: bool = False
    server_plans: bool = False
    planned_speculation: bool = False
    engine_chains: bool = False


@dataclass(frozen=True)
class SpecStep:
    """A gen's place in the API-speculation groups a compiled plan fixed (lmc.passes.api_speculation): the first
    gen of group `group` makes one over-generated call (at least `tokens` tokens, no stop) and the others take
    their values from its text, or run as normal calls where the model did not follow the template. `group`
    None: a gen of a plan outside every group, a normal call."""
    group: int | None = None
    first: bool = False
    tokens: int = 0


NO_CAPABILITIES = Capabilities()


def capabilities(backend) -> Capabilities:
    """A backend's declared capabilities; a backend that declares none (a test double, a third-party backend
    written against the required methods only) has none."""
    return getattr(backend, "capabilities", NO_CAPABILITIES)


# The program stream whose work is executing: each stream sets it in its own task, so a backend coroutine it awaits
# can account usage to the program (lmc.backend.usage).
_current_stream: contextvars.ContextVar = contextvars.ContextVar("lmc_current_stream", default=None)


def current_stream() -> Any:
    return _current_stream.get()


def set_current_stream(stream: Any) -> None:
    _current_stream.set(stream)


class Backend(Protocol):
    chat_template: ChatTemplate
    capabilities: Capabilities

    async def generate(self, text: str, params: GenParams, images: list[Image]) -> tuple[str | list[str], dict]:
        """Continue `text`; with params.n > 1, a list of n continuations."""

    def generate_stream(self, text: str, params: GenParams, images: list[Image]) -> AsyncIterator[tuple[str, dict]]:
        """Continue `text`, yielding (delta, meta_info or None) as text arrives."""

    async def select(self, text: str, choices: list[str], temperature: float,
                     method: ChoicesSamplingMethod) -> ChoicesDecision: ...

    async def select_tokens(self, text: str, choices: list[str], token_ids: list[int],
                            method: ChoicesSamplingMethod) -> ChoicesDecision | None:
        """Only with capabilities.token_id_selects: score choice i as the single token token_ids[i] after `text`
        in one request; None where the prompt's real tokenization disagrees (the caller then uses select)."""

    async def commit(self, text: str) -> None:
        """Hint: `text` is a prefix that several requests are about to share."""

    def flush_cache(self) -> bool: ...
