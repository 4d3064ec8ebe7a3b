"""Role prefixes and suffixes, derived from the tokenizer's own chat template (one source of truth).

Rendering a conversation whose contents are sentinels and cutting around them gives each role's prefix and
suffix, and the default system block some templates insert before the first user turn.
"""
from __future__ import annotations

from dataclasses import dataclass, field

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class ChatTemplate:
    prefix: dict[str, str]
    suffix: dict[str, str]
    default_system: str = ""  # text some templates insert when a conversation has no system turn
    stop_token_ids: tuple[int, ...] = field(default=())

    @classmethod
    def plain(cls) -> "ChatTemplate":
        """`ROLE: text\\n` turns, for models without a chat template (SGLang's "default")."""
        return cls({r: f"{r.upper()}: " for r in ROLES}, {r: "\n" for r in ROLES})

    @classmethod
    def from_tokenizer(cls, tokenizer) -> "ChatTemplate":
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            return cls.plain()

        def render(msgs):
            return tokenizer.apply_chat_template(msgs, tokenize=False)

        a, b, c = "\x00LMC_A\x00", "\x00LMC_B\x00", "\x00LMC_C\x00"
        sys_text = render([{"role": "system", "content": a}])
        prefix, suffix = {}, {}
        prefix["system"], suffix["system"] = sys_text.split(a)
        user_text = render([{"role": "system", "content": a}, {"role": "user", "content": b}])[len(sys_text):]
        prefix["user"], suffix["user"] = user_text.split(b)
        conv = [{"role": "system", "content": a}, {"role": "user", "content": b}, {"role": "assistant", "content": c}]
        asst_text = render(conv)[len(sys_text) + len(user_text):]
        prefix["assistant"], suffix["assistant"] = asst_text.split(c)
        lone_user = render([{"role": "user", "content": b}])
        default_system = lone_user[:lone_user.index(prefix["user"] + b)] if prefix["user"] + b in lone_user else ""
        end = suffix["assistant"].strip()
        ids = tokenizer.encode(end, add_special_tokens=False) if end else []
        return cls(prefix, suffix, default_system, tuple(ids) if len(ids) == 1 else ())
