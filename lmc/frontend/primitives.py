"""The language's vocabulary: what `s += ...` accepts. SGLang's names and signatures.

An expression is a `Text`, a `Gen`, a `Select`, a role marker, an `Image`, or an `ExprList` of them (built with
`+`, so `"Q: " + gen("a")` works). Constructors validate eagerly: a bad regex fails where it is written.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Callable

# re-exported: the language's names (lmc.gen's params, the regex constants) live in the protocol below it
from ..protocol.params import DEFAULT_PARAMS, REGEX_BOOL, REGEX_FLOAT, REGEX_INT, REGEX_STR, GenParams  # noqa: F401
from ..protocol.params import Image as ProtocolImage

_DTYPES = {int: int, "int": int, float: float, "float": float, bool: bool, "bool": bool, str: str, "str": str}


class Expr:
    def __add__(self, other) -> "ExprList":
        return ExprList([self, _as_expr(other)])

    def __radd__(self, other) -> "ExprList":
        return ExprList([_as_expr(other), self])


def _as_expr(x) -> Expr:
    if isinstance(x, Expr):
        return x
    if isinstance(x, str):
        return Text(x)
    if hasattr(x, "__lmc_text__"):  # a value being traced (lmc.compiler.trace.Symbol)
        return Text(x.__lmc_text__())
    raise TypeError(f"cannot append {type(x).__name__} to a program state: use a str or an lmc expression")


@dataclass(eq=False)
class ExprList(Expr):
    items: list[Expr]

    def __add__(self, other) -> "ExprList":
        return ExprList([*self.items, _as_expr(other)])

    def __radd__(self, other) -> "ExprList":
        return ExprList([_as_expr(other), *self.items])

    def flatten(self) -> list[Expr]:
        out = []
        for e in self.items:
            out.extend(e.flatten() if isinstance(e, ExprList) else [e])
        return out


@dataclass(eq=False)
class Text(Expr):
    value: str


@dataclass(eq=False)
class Gen(Expr):
    name: str | None
    params: GenParams = field(default_factory=GenParams)


@dataclass(eq=False)
class Select(Expr):
    name: str | None
    choices: list[str]
    temperature: float = 0.0
    choices_method: Callable | None = None


@dataclass(eq=False)
class RoleBegin(Expr):
    role: str


@dataclass(eq=False)
class RoleEnd(Expr):
    role: str


@dataclass(eq=False)
class Unordered(Expr):
    """Segments whose order the author declares irrelevant (few-shot examples, retrieved documents). They render
    in one canonical (sorted) order, interpreted and compiled alike, so that across instances they become a
    shared prefix."""

    segments: list[str]

    def render(self) -> str:
        return render_unordered(self.segments)


def render_unordered(segments: list[str]) -> str:
    """Order-free segments in their one canonical order (interpreted and compiled alike)."""
    return "".join(sorted(segments))


def unordered(*segments: str) -> Unordered:
    if not segments or not all(isinstance(x, str) for x in segments):
        raise ValueError("unordered() takes one or more strings")
    return Unordered(list(segments))


class Image(ProtocolImage, Expr):
    """An image in a program's text (the protocol's Image, as an expression)."""


def gen(name: str | None = None, max_tokens: int | None = None, min_tokens: int | None = None,
        n: int | None = None, stop: str | list[str] | None = None, stop_token_ids: list[int] | None = None,
        temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
        min_p: float | None = None, frequency_penalty: float | None = None, presence_penalty: float | None = None,
        ignore_eos: bool | None = None, return_logprob: bool | None = None, logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None, dtype=None, choices: list[str] | None = None,
        choices_method: Callable | None = None, regex: str | None = None, json_schema=None,
        seed: int | None = None) -> Expr:
    """Generate into variable `name`. With `choices`, this is `select`."""
    if choices is not None:
        return select(name, choices, temperature or 0.0, choices_method)
    if regex is not None:
        try:
            re.compile(regex)
        except re.error as e:
            raise ValueError(f"gen({name!r}): invalid regex {regex!r}: {e}") from None
    if dtype is not None:
        if dtype not in _DTYPES:
            raise ValueError(f"gen({name!r}): dtype must be int, float, bool or str, not {dtype!r}")
        dtype = _DTYPES[dtype]
    if json_schema is not None and not isinstance(json_schema, str):
        if hasattr(json_schema, "model_json_schema"):  # a pydantic model class
            json_schema = json_schema.model_json_schema()
        json_schema = json.dumps(json_schema)
    return Gen(name, GenParams(
        max_new_tokens=max_tokens, min_new_tokens=min_tokens, n=n, stop=stop, stop_token_ids=stop_token_ids,
        temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty, ignore_eos=ignore_eos, return_logprob=return_logprob,
        logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num, seed=seed, regex=regex,
        json_schema=json_schema, dtype=dtype))


def gen_int(name: str | None = None, max_tokens: int | None = None, **kw) -> Expr:
    return gen(name, max_tokens, dtype=int, **kw)


def gen_string(name: str | None = None, max_tokens: int | None = None, **kw) -> Expr:
    return gen(name, max_tokens, dtype=str, **kw)


def select(name: str | None = None, choices: list[str] | None = None, temperature: float = 0.0,
           choices_method: Callable | None = None) -> Select:
    if not choices or not all(isinstance(c, str) for c in choices):
        raise ValueError(f"select({name!r}) needs a non-empty list of strings as choices")
    return Select(name, list(choices), temperature, choices_method)


def image(path_or_bytes) -> Image:
    """An image from a file path or encoded bytes. Kept in the state; API backends send it as vision content."""
    if isinstance(path_or_bytes, (bytes, bytearray)):
        data = bytes(path_or_bytes)
        mime = "image/png" if data[:8] == b"\x89PNG\r\n\x1a\n" else "image/jpeg"
        return Image(data, mime)
    with open(path_or_bytes, "rb") as f:
        data = f.read()
    return Image(data, "image/png" if str(path_or_bytes).lower().endswith(".png") else "image/jpeg")


def _role(role: str):
    def wrap(expr=None) -> ExprList:
        return ExprList([RoleBegin(role)] + ([_as_expr(expr)] if expr is not None else []) + [RoleEnd(role)])

    wrap.__name__ = role
    return wrap


system, user, assistant = _role("system"), _role("user"), _role("assistant")


def system_begin() -> RoleBegin:
    return RoleBegin("system")


def system_end() -> RoleEnd:
    return RoleEnd("system")


def user_begin() -> RoleBegin:
    return RoleBegin("user")


def user_end() -> RoleEnd:
    return RoleEnd("user")


def assistant_begin() -> RoleBegin:
    return RoleBegin("assistant")


def assistant_end() -> RoleEnd:
    return RoleEnd("assistant")
