"""The IR's text format: `print_graph` writes it, `parse_graph` reads it back (parse(print(g)) == g).

    program few_shot(question) {
      %0 = text@0 {"value": "Q: "}
      %1 = arg@0 {"name": "question"} <- order %0
      %2 = gen@0 {"name": "answer", "params": {"max_new_tokens": 16}} <- order %1
    }

Parsing is a lark grammar (grammar.lark) plus JSON literals: loading a .lmir file executes nothing.
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from lark import Lark, Transformer, v_args

from .graph import EDGE_KINDS, IRValidationError, ProgramGraph


def _json(v) -> str:
    return json.dumps(v, sort_keys=True, ensure_ascii=True)


def print_graph(g: ProgramGraph) -> str:
    after = f" after({', '.join(g.inputs)})" if g.inputs is not None else ""
    lines = [f"program {g.name}({', '.join(g.params)}){after} {{"]
    for nid in g.order():
        node = g.node(nid)
        preds = []
        for src, _, a in sorted(g.g.in_edges(nid, data=True), key=lambda e: (EDGE_KINDS.index(e[2]["kind"]), e[0])):
            preds.append(f"{a['kind']} %{src}" + (f":{a['when']}" if "when" in a else ""))
        tail = f" <- {', '.join(preds)}" if preds else ""
        lines.append(f"  %{nid} = {node.kind}@{node.stream} {_json(node.attrs)}{tail}")
    lines.append("}")
    return "\n".join(lines) + "\n"


@v_args(inline=True)
class _ToGraph(Transformer):
    def string(self, s):
        return json.loads(s)

    def number(self, n):
        return json.loads(n)

    def true(self):
        return True

    def false(self):
        return False

    def null(self):
        return None

    def pair(self, k, v):
        return json.loads(k), v

    def object(self, *pairs):
        return dict(pairs)

    def array(self, *items):
        return list(items)

    def names(self, *names):
        return tuple(str(n) for n in names if n is not None)

    def header(self, name, params, inputs=None):
        return str(name), params, inputs

    def pred(self, kind, ref, when=None):
        return str(kind), int(ref[1:]), (str(when) if when is not None else None)

    def preds(self, *ps):
        return list(ps)

    def stmt(self, ref, kind, stream, attrs, preds=None):
        return int(ref[1:]), str(kind), int(stream), attrs, preds or []

    def start(self, header, *stmts):
        g = ProgramGraph(*header)
        for nid, kind, stream, attrs, _ in stmts:
            g.add(kind, stream, node_id=nid, **attrs)
        for nid, _, _, _, preds in stmts:
            for kind, src, when in preds:
                if src not in g.g:
                    raise IRValidationError(f"%{nid} refers to %{src}, which is not defined")
                g.connect(src, nid, kind, when)
        return g


@lru_cache(maxsize=1)
def _parser() -> Lark:
    return Lark((Path(__file__).parent / "grammar.lark").read_text(), parser="lalr")


def parse_graph(text: str, validate: bool = True) -> ProgramGraph:
    """Parse the text format; the graph is validated unless `validate` is False (for tests of the format on
    arbitrary graphs). Syntax errors name the line and column."""
    from lark.exceptions import LarkError, UnexpectedInput, VisitError

    try:
        g = _ToGraph().transform(_parser().parse(text))
    except VisitError as e:
        raise e.orig_exc if isinstance(e.orig_exc, IRValidationError) else IRValidationError(str(e.orig_exc))
    except UnexpectedInput as e:
        where = f"line {e.line}, column {e.column}"
        raise IRValidationError(f"not a valid lmc IR text at {where}:\n{e.get_context(text)}") from None
    except LarkError as e:
        raise IRValidationError(f"not a valid lmc IR text: {e}") from None
    return g.validate() if validate else g
