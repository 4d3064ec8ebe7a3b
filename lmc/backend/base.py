"""The interface every backend implements (all coroutines run on the frontend's event loop)."""
from __future__ import annotations

from typing import AsyncIterator, Protocol

from ..frontend.chat_template import ChatTemplate
from ..frontend.choices import ChoicesDecision, ChoicesSamplingMethod
from ..frontend.primitives import GenParams, Image


class Backend(Protocol):
    chat_template: ChatTemplate
    supports_images: bool

    async def generate(self, text: str, params: GenParams, images: list[Image]) -> tuple[str | list[str], dict]:
        """Continue `text`; with params.n > 1, a list of n continuations."""

    def generate_stream(self, text: str, params: GenParams, images: list[Image]) -> AsyncIterator[tuple[str, dict]]:
        """Continue `text`, yielding (delta, meta_info or None) as text arrives."""

    async def select(self, text: str, choices: list[str], temperature: float,
                     method: ChoicesSamplingMethod) -> ChoicesDecision: ...

    async def commit(self, text: str) -> None:
        """Hint: `text` is a prefix that several requests are about to share."""

    def flush_cache(self) -> bool: ...
