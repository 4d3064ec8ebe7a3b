"""API usage accounting: calls and tokens per program run (forks included) and per backend."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from ..protocol.backend import current_stream

_USAGE_KEY = "__lmc_usage__"


@dataclass
class Usage:
    calls: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    calls_saved: int = 0  # gens served by a speculative call instead of their own
    retries: int = 0
    cache_hits: int = 0  # requests answered by the response cache (not sent)
    bias_calls: int = 0  # calls made by logit-bias stepping (also counted in calls)

    def add(self, other: "Usage") -> "Usage":
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        return self

    def __add__(self, other: "Usage") -> "Usage":
        return Usage().add(self).add(other)

    @property
    def billed_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "billed_tokens": self.billed_tokens}

    def summary(self) -> str:
        return (f"{self.calls} call(s), {self.prompt_tokens} prompt tokens ({self.cached_tokens} cached), "
                f"{self.completion_tokens} completion tokens, {self.calls_saved} call(s) saved by speculation"
                + (f", {self.cache_hits} response-cache hit(s)" if self.cache_hits else "")
                + (f", {self.bias_calls} logit-bias step call(s)" if self.bias_calls else "")
                + (f", {self.retries} retr{'y' if self.retries == 1 else 'ies'}" if self.retries else ""))


def stream_usage(stream) -> Usage | None:
    """The Usage of a stream, created on first use. It lives in the stream's meta table, which forks copy, so the
    branches of a fork (made after the parent's first call or commit) add to the program's one Usage."""
    if stream is None:
        return None
    u = stream.meta.get(_USAGE_KEY)
    if u is None:
        u = stream.meta[_USAGE_KEY] = Usage()
    return u


def record_usage(metas, backend=None, *, calls: int = 1, usage: Usage | None = None) -> Usage:
    """Add one call's token counts (native meta_info dicts, or a Usage) to the running program and backend."""
    if usage is None:
        usage = Usage(calls=calls)
        for m in metas if isinstance(metas, list) else [metas]:
            usage.prompt_tokens += int(m.get("prompt_tokens") or 0)
            usage.cached_tokens += int(m.get("cached_tokens") or 0)
            usage.completion_tokens += int(m.get("completion_tokens") or 0)
    target = stream_usage(current_stream())
    if target is not None:
        target.add(usage)
    if backend is not None and hasattr(backend, "usage"):
        with backend._usage_lock:
            backend.usage.add(usage)
    return usage


def program_usage(state) -> Usage:
    """The API usage of one program run (a ProgramState), forks included."""
    s = getattr(state, "_s", state)
    u = getattr(s, "meta", {}).get(_USAGE_KEY)
    return Usage().add(u) if u is not None else Usage()


def total_usage(states) -> Usage:
    """Summed usage of the states of a run_batch (a Usage shared by several states counts once)."""
    seen, total = set(), Usage()
    for st in states:
        s = getattr(st, "_s", None)
        u = getattr(s, "meta", {}).get(_USAGE_KEY) if s is not None else None
        if u is not None and id(u) not in seen:
            seen.add(id(u))
            total.add(u)
    return total
