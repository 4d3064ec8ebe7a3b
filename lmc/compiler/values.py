"""What a `var` node's transforms and a `branch` node's test mean on a concrete value (one definition, used by
the tracer for known values and by the executor at run time)."""
from __future__ import annotations

import operator
from typing import Any


def apply_transforms(value: Any, transforms) -> Any:
    """Argument-free str methods (`strip`, `lower`, ...) applied in order; non-strings are left as they are."""
    for t in transforms:
        if isinstance(value, str):
            value = getattr(str, t)(value)
    return value


TESTS = ("==", "contains", "startswith", "endswith", "nonempty", "<", "<=", ">", ">=")
_ORDER = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge}


def holds(value: Any, op: str, expected) -> bool:
    """A branch test: `op` is `[transform|...]test`, test one of TESTS (the orderings compare as Python does)."""
    *transforms, test = op.split("|")
    value = apply_transforms(value, transforms)
    if test == "==":
        return value == expected
    if test == "contains":
        return expected in value
    if test == "startswith":
        return str(value).startswith(expected)
    if test == "endswith":
        return str(value).endswith(expected)
    if test == "nonempty":
        return bool(value)
    if test in _ORDER:
        return _ORDER[test](value, expected)
    raise ValueError(f"unknown branch test {op!r}")
