"""Logit-bias stepping: the last-resort lowering of `select`, typed gens and regexes on an OpenAI-compatible
endpoint (lmc.OpenAI with `constraints="logit_bias"`, or "auto" where nothing better fits).

The value is written by calls of one token each. A call's `logit_bias` puts +100 on the tokens that keep the text
written so far a prefix of some string the constraint accepts (partial matching of the `regex` package), so the
model takes its most likely allowed token at temperature 0 and samples among the allowed ones otherwise. Once the
text is a full match, the end-of-text ids and the whitespace tokens the pattern cannot take are allowed too, and
writing one ends the value (it is not part of it). A select stops as soon as one choice is left, and needs no call
at all for the rest of that choice.

A map holds at most MAX_BIAS_TOKENS ids (OpenAI refuses larger ones): the shortest allowed tokens are kept, since
they can spell whatever the longer ones could. This module is the model's side of it (tokenizer, vocabulary as
text, allowed ids); lmc/backend/openai.py makes the calls.
"""
from __future__ import annotations

from ..protocol import REGEX_BOOL, REGEX_STR

BIAS = 100
MAX_BIAS_TOKENS = 300
# Typed gens are stepped over the value alone: REGEX_INT / REGEX_FLOAT pad it with [ \n]*, which here is the
# whitespace token that ends the value (the dtype conversion strips it anyway).
DTYPE_PATTERNS = {int: r"[-+]?[0-9]+", float: r"[-+]?[0-9]*\.?[0-9]+", bool: REGEX_BOOL, str: REGEX_STR}


def load_tokenizer(spec):
    """`spec` itself when it is a tokenizer; from a name: a tiktoken encoding ("o200k_base") or a transformers
    tokenizer directory (local files only: nothing is fetched from a hub)."""
    if not isinstance(spec, str):
        return spec
    try:
        import tiktoken

        return tiktoken.get_encoding(spec)
    except (ImportError, ValueError):
        pass
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(spec, local_files_only=True)


def _token_texts(tok) -> tuple[dict[int, str], set[int]]:
    """({id: text} of the ordinary tokens that decode to whole characters, the tokenizer's end-of-text ids)."""
    texts: dict[int, str] = {}
    if hasattr(tok, "decode_single_token_bytes"):  # a tiktoken Encoding
        special = {tok.encode_single_token(s) for s in tok.special_tokens_set}
        for i in range(tok.n_vocab):
            try:
                t = tok.decode_single_token_bytes(i).decode("utf-8")
            except (KeyError, UnicodeDecodeError):  # a gap in the ids, or part of a character
                continue
            if i not in special and t:
                texts[i] = t
        return texts, {tok.eot_token}
    # transformers: each token decoded after an anchor token and cut there, because tokenizers that drop the
    # leading space of a text (SentencePiece) would otherwise lose the space of tokens like "▁Paris"
    anchor = tok.encode("a", add_special_tokens=False)
    head = tok.decode(anchor)
    special = set(tok.all_special_ids)
    for i, s in enumerate(tok.batch_decode([anchor + [i] for i in range(len(tok))])):
        t = s[len(head):]
        if i not in special and s.startswith(head) and t and "\ufffd" not in t:
            texts[i] = t
    return texts, {tok.eos_token_id} - {None}


class Vocabulary:
    """The model's tokens as text, grouped by first character (so a step tests a few hundred characters, then
    the tokens of the viable ones), and the ids that end a generation."""

    def __init__(self, tokenizer, end_ids=()):
        texts, eos = _token_texts(tokenizer)
        self.by_first: dict[str, list[tuple[str, int]]] = {}
        for i, t in texts.items():
            self.by_first.setdefault(t[0], []).append((t, i))
        self.whitespace = [(t, i) for i, t in texts.items() if t.isspace()]
        self.end_ids = sorted(eos | set(end_ids))

    def extensions(self, pattern, value: str) -> list[tuple[str, int]]:
        """(text, id) of the tokens t for which value + t is still a prefix of a match."""
        out = []
        for ch, toks in self.by_first.items():
            if pattern.fullmatch(value + ch, partial=True):
                out += [(t, i) for t, i in toks if len(t) == 1 or pattern.fullmatch(value + t, partial=True)]
        return out


class Stepper:
    """One constrained value written token by token. `bias()` is the next call's logit_bias, or None when no call
    is needed (nothing can extend the value, or one choice is left); `feed(text)` takes that call's output and
    says whether it ended the value; `result` is the value (for a select, the one choice left)."""

    def __init__(self, vocab: Vocabulary, pattern: str, choices: list[str] | None = None):
        import regex  # a dependency of both transformers and tiktoken, so present wherever a tokenizer is

        self.vocab, self.choices = vocab, choices
        self.pattern = regex.compile(pattern)
        self.value = ""
        self._complete = False

    @classmethod
    def select(cls, vocab: Vocabulary, choices: list[str]) -> "Stepper":
        import regex

        return cls(vocab, "|".join(regex.escape(c) for c in choices), choices)

    def _alive(self) -> list[str]:
        return [c for c in self.choices if c.startswith(self.value)]

    @property
    def result(self) -> str:
        if self.choices is not None and len(self._alive()) == 1:
            return self._alive()[0]
        return self.value

    def _viable(self, text: str) -> bool:
        return self.pattern.fullmatch(text, partial=True) is not None

    def bias(self) -> dict[str, int] | None:
        if self.choices is not None and len(self._alive()) == 1:
            return None
        exts = self.vocab.extensions(self.pattern, self.value)
        if not exts:
            return None
        self._complete = self.pattern.fullmatch(self.value) is not None
        end_ids, candidates = [], exts
        if self._complete:  # the model may end here: an end-of-text id, or whitespace the pattern cannot take
            end_ids = self.vocab.end_ids
            candidates = exts + [(t, i) for t, i in self.vocab.whitespace if not self._viable(self.value + t)]
        kept = [i for _, i in sorted(candidates, key=lambda x: len(x[0]))][:MAX_BIAS_TOKENS - len(end_ids)]
        return {str(i): BIAS for i in end_ids + kept}

    def feed(self, text: str) -> bool:
        if self._complete and (text == "" or (text.isspace() and not self._viable(self.value + text))):
            return True
        if not text or not self._viable(self.value + text):
            raise ValueError(f"the endpoint did not honour logit_bias: after {self.value!r} it wrote {text!r}, "
                             f"which the constraint {self.pattern.pattern!r} does not allow")
        self.value += text
        return False
