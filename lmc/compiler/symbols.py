"""Symbols: the values a traced program body computes with (its text arguments, generated values, and host values
derived from their meta info), and the graph break raised where the body needs a concrete value the trace does not
have (lmc.compiler.trace)."""
from __future__ import annotations

from ..frontend.program import tracing as _tracing
from ..ir.expr import format_expr
from .values import apply_transforms, holds

_STR_TRANSFORMS = ("strip", "lower", "upper", "lstrip", "rstrip", "casefold", "title")
# str methods modelled symbolically; every other public str method reads the concrete value (a graph break)
_MODELLED = set(_STR_TRANSFORMS) | {"startswith", "endswith"}


class GraphBreak(Exception):
    """The body needs what the trace cannot give it: the segment ends here. `interpret`: what follows cannot be
    resumed by tracing (the interpreter runs it)."""

    def __init__(self, reason: str, interpret: bool = False):
        super().__init__(reason)
        self.reason, self.interpret = reason, interpret


UNKNOWN = object()


class Symbol:
    """An argument or a generated value while tracing. It is not a str: formatting it (f-strings, `+` with
    text, `.format`, `str()`) gives a sentinel that traces into an arg/var node, argument-free transforms
    (`.strip()`) stay symbolic, comparisons with text are decisions, and anything else needs the concrete value:
    `known` when a resumed trace has it (an argument of the instance: the read is recorded as a guard), a graph
    break otherwise. A C function that wants a real str (re, json, ast) raises TypeError: an interpreting break
    at that line, never a silently wrong constant."""

    __slots__ = ("kind", "name", "transforms", "known", "item")

    def __init__(self, kind: str, name: str, transforms: tuple[str, ...] = (), known=UNKNOWN, item: int | None = None):
        # item: the index in a fork's gathered list this symbol is (s["thought"][i] after the join)
        self.kind, self.name, self.transforms, self.known, self.item = kind, name, transforms, known, item

    def __str__(self) -> str:
        at = "" if self.item is None else f"\x01{self.item}"
        return f"\x00{self.kind}:{self.name}{at}{''.join('|' + t for t in self.transforms)}\x00"

    def __format__(self, spec: str) -> str:
        if spec:
            return format(self._concrete("formatting with a spec"), spec)
        return str(self)

    def __lmc_text__(self) -> str:  # what `s += symbol` appends (lmc.frontend.primitives._as_expr)
        return str(self)

    def _concrete(self, why: str):
        """The concrete value (transforms applied), recorded as a guard; a graph break when unknown."""
        if self.known is UNKNOWN:
            raise GraphBreak(f"{why} needs the value of {'argument' if self.kind == 'arg' else 'generated'} {self.name!r}")
        _tracing.get().guard_arg(self.name, self.known)
        return apply_transforms(self.known, self.transforms)

    def _decide(self, op: str, value) -> bool:
        if self.kind == "arg":
            return holds(self._concrete(f"a decision ({op})"), op, value)
        return _tracing.get().decide(self, op, value)

    def __eq__(self, other):
        if isinstance(other, str):
            return self._decide("==", other)
        return self._concrete("a comparison") == (other._concrete("a comparison") if isinstance(other, Symbol)
                                                  else other)

    def __ne__(self, other):
        return not self.__eq__(other)

    def __hash__(self):
        return hash(self._concrete("a dict or set lookup"))

    def __contains__(self, item):
        if isinstance(item, str):
            return self._decide("contains", item)
        return item in self._concrete("a membership test")

    def startswith(self, prefix, *a):
        if a or not isinstance(prefix, str):
            return self._concrete(".startswith()").startswith(prefix, *a)
        return self._decide("startswith", prefix)

    def endswith(self, suffix, *a):
        if a or not isinstance(suffix, str):
            return self._concrete(".endswith()").endswith(suffix, *a)
        return self._decide("endswith", suffix)

    def __bool__(self):
        return self._decide("nonempty", None)

    def __len__(self):
        return len(self._concrete("len()"))

    def __iter__(self):
        return iter(self._concrete("iteration"))

    def __getitem__(self, key):
        return self._concrete("indexing")[key]

    def __int__(self):
        return int(self._concrete("int()"))

    def __float__(self):
        return float(self._concrete("float()"))

    def __index__(self):
        return int(self._concrete("use as an index"))

    def __repr__(self):
        return repr(self._concrete("repr()"))

    def __add__(self, other):
        if isinstance(other, (str, Symbol)):
            return str(self) + str(other)
        if isinstance(other, (int, float, list, tuple)):
            return self._concrete("arithmetic") + other
        return NotImplemented  # an lmc expression: `arg + gen(...)` builds an expression list

    def __radd__(self, other):
        if isinstance(other, str):
            return other + str(self)
        if isinstance(other, (int, float, list, tuple)):
            return other + self._concrete("arithmetic")
        return NotImplemented

    def __lt__(self, other):
        return self._concrete("an ordering comparison") < other

    def __le__(self, other):
        return self._concrete("an ordering comparison") <= other

    def __gt__(self, other):
        return self._concrete("an ordering comparison") > other

    def __ge__(self, other):
        return self._concrete("an ordering comparison") >= other

    def __mul__(self, other):
        return self._concrete("arithmetic") * other

    def __mod__(self, other):
        return self._concrete("%-formatting") % other


def _transform(name):
    def method(self, *a, **k):
        if a or k:
            return getattr(str, name)(self._concrete(f".{name}() with arguments"), *a, **k)
        return Symbol(self.kind, self.name, self.transforms + (name,), self.known, self.item)

    return method


def _concrete_method(name):
    def method(self, *a, **k):
        value = self._concrete(f".{name}()")
        return getattr(type(value), name)(value, *a, **k)

    return method


for _m in dir(str):
    if _m.startswith("_") or _m in _MODELLED or _m == "maketrans":
        continue
    setattr(Symbol, _m, _concrete_method(_m))
for _m in _STR_TRANSFORMS:
    setattr(Symbol, _m, _transform(_m))


class Derived:
    """A host value the body computes from generated values' meta info while tracing (a select's logprobs, a gen's
    token counts): an expression (lmc.ir.expr). An item by a constant key and arithmetic (+ - * /, unary -, abs(),
    round()) with numbers or other derived values stay symbolic; comparisons are decisions (the body is traced
    both ways, as for a Symbol's); setting a variable to one (or to a list holding some) sets it to the
    expression. What needs the concrete value (str(), float(), formatting, iteration, hashing) is a graph break."""

    __slots__ = ("expr",)

    def __init__(self, expr):
        self.expr = expr

    def _concrete(self, why: str):
        raise GraphBreak(f"{why} needs the value of {format_expr(self.expr)}")

    def __getitem__(self, key):
        if isinstance(key, (int, str)) and not isinstance(key, bool):
            return Derived(["item", self.expr, key])
        return self._concrete("indexing by a non-constant key")

    def __round__(self, ndigits=None):
        if ndigits is None or isinstance(ndigits, int) and not isinstance(ndigits, bool):
            return Derived(["round", self.expr, ndigits])
        return self._concrete("round() with a non-constant ndigits")

    def __neg__(self):
        return Derived(["neg", self.expr])

    def __pos__(self):
        return self

    def __abs__(self):
        return Derived(["abs", self.expr])

    def _decide(self, op: str, other) -> bool:
        operand = _operand(other, str)
        if operand is NotImplemented:
            return self._concrete(f"a comparison ({op}) with {type(other).__name__}")
        return _tracing.get().decide_expr(self.expr, op, operand)

    def __ne__(self, other):
        return not self._decide("==", other)

    def __bool__(self):
        return _tracing.get().decide_expr(self.expr, "nonempty", None)


def _operand(x, *constants):
    """x as an expression operand: a derived value's expression, a number, or one of `constants`' types
    (NotImplemented: anything else)."""
    if isinstance(x, Derived):
        return x.expr
    if isinstance(x, (int, float, *constants)) or x is None and constants:
        return x
    return NotImplemented


def _arithmetic(op: str, reflected: bool):
    def method(self, other):
        operand = _operand(other)
        if operand is NotImplemented:
            return NotImplemented
        return Derived([op, operand, self.expr] if reflected else [op, self.expr, operand])

    return method


for _op, _name in (("+", "add"), ("-", "sub"), ("*", "mul"), ("/", "truediv")):
    setattr(Derived, f"__{_name}__", _arithmetic(_op, False))
    setattr(Derived, f"__r{_name}__", _arithmetic(_op, True))


def _decision(op: str):
    return lambda self, other: self._decide(op, other)


def _needs_value(why: str):
    return lambda self, *a: self._concrete(why)


for _name, _op in (("eq", "=="), ("lt", "<"), ("le", "<="), ("gt", ">"), ("ge", ">=")):
    setattr(Derived, f"__{_name}__", _decision(_op))
for _name, _why in (("hash", "a dict or set lookup"), ("str", "str()"), ("repr", "repr()"), ("format", "formatting"),
                    ("float", "float()"), ("int", "int()"), ("index", "use as an index"), ("iter", "iteration"),
                    ("len", "len()"), ("contains", "a membership test")):
    setattr(Derived, f"__{_name}__", _needs_value(_why))
