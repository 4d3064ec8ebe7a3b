"""Expressions: the host values a program computes from its generated values (a select's scores, a gen's token
counts), as data. A `set_var` node may set a variable to one (`expr`), and a `branch` may test one (its `var`, and
its `value` where it compares two). Nothing in them is code: the vocabulary is fixed, and evaluation reads the
instance's variables and meta info only.

    E := a JSON scalar (number, string, bool, null)        the constant
       | ["var", name]          a variable's value          | ["meta", name]      its meta info
       | ["item", E, key]       E[key], key an int or str   | ["list", E, ...]    a list
       | [op, E, E]             op one of + - * / (numbers) | ["neg", E] | ["abs", E]
       | ["round", E, ndigits]  ndigits an int or null

An expression is a list exactly when it is not a constant, so constants need no tag.
"""
from __future__ import annotations

import json
import operator
from typing import Any, Callable

MAX_NODES = 256  # an expression's size, a bound on what a hostile plan can make a server evaluate
_BINARY = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}
_UNARY = {"neg": operator.neg, "abs": abs}
OPS = ("var", "meta", "item", "list", *_BINARY, *_UNARY, "round")
_ARITY = {"var": 1, "meta": 1, "item": 2, "round": 2, **dict.fromkeys(_BINARY, 2), **dict.fromkeys(_UNARY, 1)}
_SCALARS = (int, float, str, bool, type(None))


def is_expr(value: Any) -> bool:
    """Whether `value` is an expression to evaluate (a list) rather than a constant."""
    return isinstance(value, list)


def check(e: Any) -> str | None:
    """What is malformed in `e` (None: nothing)."""
    count = 0

    def walk(e) -> str | None:
        nonlocal count
        count += 1
        if count > MAX_NODES:
            return f"an expression of more than {MAX_NODES} nodes"
        if isinstance(e, _SCALARS):
            return None
        if not isinstance(e, list) or not e or e[0] not in OPS:
            return f"{json.dumps(e, default=repr)[:80]} is not an expression; its operators are {list(OPS)}"
        op, args = e[0], e[1:]
        if op != "list" and len(args) != _ARITY[op]:
            return f"{op!r} takes {_ARITY[op]} operand(s), not {len(args)}"
        if op in ("var", "meta"):
            return None if isinstance(args[0], str) else f"{op!r} takes a variable name"
        if op == "item" and not (isinstance(args[1], (int, str)) and not isinstance(args[1], bool)):
            return "an item's key is an int or a str"
        if op == "round" and not (args[1] is None or isinstance(args[1], int) and not isinstance(args[1], bool)):
            return "round's ndigits is an int or null"
        return next((p for a in (args[:1] if op in ("item", "round") else args) if (p := walk(a))), None)

    return walk(e)


def reads(e: Any) -> list[str]:
    """The variables an expression reads (by value or by meta info), in order, once each."""
    out: dict[str, None] = {}

    def walk(e):
        if isinstance(e, list) and e:
            if e[0] in ("var", "meta"):
                out[e[1]] = None
            else:
                for a in e[1:2] if e[0] in ("item", "round") else e[1:]:
                    walk(a)

    walk(e)
    return list(out)


def evaluate(e: Any, var: Callable[[str], Any], meta: Callable[[str], Any]) -> Any:
    """The value of `e` on an instance: `var(name)` and `meta(name)` read its variables and their meta info. Errors
    are the ones Python gives the same computation (a missing key, a division by zero), plus arithmetic on what is
    not a number."""
    if not isinstance(e, list):
        return e
    op, args = e[0], e[1:]
    if op == "var":
        return var(args[0])
    if op == "meta":
        return meta(args[0])
    if op == "item":
        return evaluate(args[0], var, meta)[args[1]]
    if op == "list":
        return [evaluate(a, var, meta) for a in args]
    if op == "round":
        return round(_number(op, evaluate(args[0], var, meta)), args[1])
    values = [_number(op, evaluate(a, var, meta)) for a in args]
    return (_BINARY.get(op) or _UNARY[op])(*values)


def _number(op: str, x):
    if isinstance(x, (int, float)):
        return x
    raise TypeError(f"{op!r} takes numbers, not {type(x).__name__} {x!r:.40}")


def format_expr(e: Any) -> str:
    """An expression as readable text: `round({correct}.meta[0][...] - ..., 3)`."""
    if not isinstance(e, list):
        return json.dumps(e)
    op, args = e[0], e[1:]
    if op == "var":
        return f"{{{args[0]}}}"
    if op == "meta":
        return f"meta({{{args[0]}}})"
    if op == "item":
        return f"{format_expr(args[0])}[{json.dumps(args[1])}]"
    if op == "list":
        return f"[{', '.join(map(format_expr, args))}]"
    if op in _BINARY:
        return f"({format_expr(args[0])} {op} {format_expr(args[1])})"
    if op == "neg":
        return f"-{format_expr(args[0])}"
    return f"{op}({', '.join(format_expr(a) if i == 0 else json.dumps(a) for i, a in enumerate(args))})"
