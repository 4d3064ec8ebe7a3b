"""Program hints: what the compiled plan knows about a request's program, carried with the request to the engine.

Every LM call a compiled program makes belongs to one program instance (forks included) and sits at a known place
in the instance's plan. The compiler computes these hints from the plan (lmc.compiler.hints); they travel with
the request (`Engine.generate(..., program=...)`, the `program` field of native `/generate` and of the OpenAI
routes, `nvext.agent_hints` for NVIDIA Dynamo) so that a scheduler can order and cache by program, not by request.
Hints never change what a request computes: a server may ignore them.

Imports nothing of lmc (the bottom layer).
"""
from __future__ import annotations

import uuid
from dataclasses import asdict, dataclass
from typing import Any

from .backend import current_stream

MAX_INSTANCE_ID_CHARS = 128
INSTANCE_KEY = "_lmc_instance"  # where a program stream keeps its instance id (its meta table, which forks copy)


class HintsError(ValueError):
    """A `program` value that is not valid hints; the message names the field."""


@dataclass(frozen=True)
class ProgramHints:
    """One request's place in its program instance.

    instance: the program instance's id (every request of one instance, forks included, carries the same one).
    calls_left: LM calls on the instance's critical path from this request to the end of the known plan, this
        request included (>= 1). Parallel fork branches count once: it is the longest chain still to run.
    tokens_left: an upper bound of the tokens the instance may still generate, this request's included; None when
        the plan cannot bound it (host code, a nested program or an interpreted rest may follow).
    next_use: program steps (LM calls, and a host-code break) until a later request of the instance extends this
        request's prompt (1: the very next step; for a fork branch, the parent's step after the join, which extends
        the prefix the branch starts with, the sibling branches' calls counted on the way); None when no later use
        is known (its prefix may go first).
    program: the program's name (a workload class: Dynamo's session_type_id); "" when unknown.
    """

    instance: str
    calls_left: int = 1
    tokens_left: int | None = None
    next_use: int | None = None
    program: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None and v != ""}

    @classmethod
    def from_dict(cls, d: Any, field: str = "program") -> "ProgramHints":
        """Hints from their JSON object; HintsError naming `field.key` on a missing, unknown or mistyped entry."""
        if isinstance(d, ProgramHints):
            return d
        if not isinstance(d, dict):
            raise HintsError(f"{field} must be an object with the request's program hints "
                             f"({', '.join(cls.__dataclass_fields__)}), got {type(d).__name__}")
        unknown = sorted(set(d) - set(cls.__dataclass_fields__))
        if unknown:
            raise HintsError(f"{field}: unknown field(s) {unknown}; the hints are "
                             f"{', '.join(cls.__dataclass_fields__)}")
        instance = d.get("instance")
        if not isinstance(instance, str) or not 0 < len(instance) <= MAX_INSTANCE_ID_CHARS:
            raise HintsError(f"{field}.instance must be a non-empty string of at most {MAX_INSTANCE_ID_CHARS} "
                             "characters (the program instance's id)")
        program = d.get("program", "")
        if not isinstance(program, str) or len(program) > MAX_INSTANCE_ID_CHARS:
            raise HintsError(f"{field}.program must be a string of at most {MAX_INSTANCE_ID_CHARS} characters")
        calls = d.get("calls_left", 1)
        if not _count(calls) or calls < 1:
            raise HintsError(f"{field}.calls_left must be an integer >= 1, got {calls!r}")
        for key in ("tokens_left", "next_use"):
            v = d.get(key)
            if v is not None and (not _count(v) or v < (1 if key == "next_use" else 0)):
                raise HintsError(f"{field}.{key} must be null or an integer >= {1 if key == 'next_use' else 0}, "
                                 f"got {v!r}")
        return cls(instance, calls, d.get("tokens_left"), d.get("next_use"), program)

    def dynamo_nvext(self) -> dict[str, Any]:
        """The hints in NVIDIA Dynamo's request extension: `nvext.agent_context` (the instance is the session and
        the trajectory) and `nvext.agent_hints` (`osl`: the output tokens this request may still take, bounded
        by the instance's; `priority`: higher for instances with fewer calls left, shortest work first;
        `speculative_prefill`: the next step extends this prompt)."""
        hints: dict[str, Any] = {"priority": max(0, 100 - self.calls_left)}
        if self.tokens_left is not None:
            hints["osl"] = self.tokens_left
        if self.next_use == 1:
            hints["speculative_prefill"] = True
        return {"agent_context": {"session_type_id": self.program or "lmc_program", "session_id": self.instance,
                                  "trajectory_id": self.instance},
                "agent_hints": hints}


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v < 2**63


def new_instance_id() -> str:
    return uuid.uuid4().hex


def instance_id(stream: Any) -> str:
    """The program instance id of a program stream (made on first use; forks copy the stream's meta table, so a
    fork's branches share their parent's)."""
    meta = stream.meta
    key = meta.get(INSTANCE_KEY)
    if key is None:
        key = meta[INSTANCE_KEY] = new_instance_id()
    return key


def current_hints() -> ProgramHints | None:
    """The hints of the LM call the running program stream is making (set by the plan executor before each
    generate / score operation; None outside compiled programs)."""
    return getattr(current_stream(), "hints", None)


__all__ = ["ProgramHints", "HintsError", "INSTANCE_KEY", "instance_id", "new_instance_id", "current_hints"]
