"""Re-encoding a growing text from a stable cut near its end: the canonical ids, for the cost of the last words.

A chain's text (continuation.py) grows at every step, and each step re-encodes all of it, as a step-by-step run
encodes each prompt (`tokenizer.encode(text)`), so the tokens stay canonical; a select encodes the text once more
per choice, and again with select fusion. On the scheduler thread that was most of the host's work outside the
forwards where forwards are fast: 45% of it for 32 react_agent instances (py-spy, the dummy model on the CPU; one
encode of its 200-token text costs ~0.28 ms, most of it the pre-tokenizer's regex over the whole text).

A cut at character c of a text T is stable when, for every text N that starts with T,
    encode(N) == encode(T[:c]) + encode(N[c:], add_special_tokens=False).
A chain keeps the last stable cut its text is known to have, with the ids before it (`EncodedPrefix`), and a
re-encoding then encodes only the text after the cut. Two kinds of cut are stable:
- After an added token that splits cleanly (not lstrip / rstrip / single_word / normalized): a Hugging Face
  tokenizer splits its input on added tokens before anything else, then normalizes, pre-tokenizes and runs its
  model on each piece between them on its own. With a chat template: the start of the current turn.
- Before a space that has a non-space on each side, under GPT-2's byte-level pre-tokenizer (its regex, no
  normalizer: SmolLM2, the embedded model): no pattern of that regex matches across such a space (a word, number
  or punctuation run stops at it; the optional leading space only starts a match), and whether one of the matches
  before it is what it is depends on at most the two characters after it, so the pieces before the space, and so
  their tokens (BPE never merges across pieces), are those of T[:c] whatever follows. The witness, the space and
  the character after it, must be in T (`EncodedPrefix.text` holds it).
Where a tokenizer might not meet these (another pre-tokenizer or normalizer, a post-processor that appends a
token, an added token with a space inside), probes at start-up check the identity, and a kind of cut that fails
one is never used: `encode` is then the full encoding.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property

WITNESS = 2  # characters of the text after a space cut that its stability depends on


def gpt2_byte_level(cfg: dict) -> bool:
    """Whether a tokenizer.json config is GPT-2's byte-level BPE: no normalizer (none, or an empty sequence, as
    transformers writes one converted from GGUF), the ByteLevel pre-tokenizer with its regex and no prefix space."""
    norm, pre, model = cfg.get("normalizer"), cfg.get("pre_tokenizer") or {}, cfg.get("model") or {}
    no_norm = norm is None or (norm.get("type") == "Sequence" and not norm.get("normalizers"))
    return (no_norm and pre.get("type") == "ByteLevel" and pre.get("use_regex", True)
            and not pre.get("add_prefix_space") and model.get("type") == "BPE" and not model.get("dropout"))


@dataclass(frozen=True)
class EncodedPrefix:
    """A stable cut of a text: a new text that starts with `text` encodes as `ids` + the encoding of the rest from
    `cut` on (`cut` <= len(text); a space cut's text reaches WITNESS characters past it)."""

    text: str
    cut: int
    ids: tuple[int, ...]


class PrefixEncoder:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self.splitting: dict[int, str] = {
            i: t.content for i, t in decoder.items()
            if t.content and not (t.lstrip or t.rstrip or t.single_word or t.normalized)}
        self.added = [t.content for t in decoder.values()]
        # the kinds of cut in use: "special", "space"
        self.kinds = frozenset(k for k, ok in (("special", bool(self.splitting)), ("space", self._gpt2_byte_level()))
                               if ok and self._holds(k))

    @property
    def enabled(self) -> bool:
        return bool(self.kinds)

    def _gpt2_byte_level(self) -> bool:
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None or any(" " in t for t in self.added):
            return False
        return gpt2_byte_level(json.loads(backend.to_str()))

    def _holds(self, kind: str) -> bool:
        """Whether the probes find cuts of this kind, and encoding from each gives the full encoding."""
        if kind == "special":
            heads = [h for t in list(self.splitting.values())[:3] for h in (t, "Hi" + t, "a\n" + t + "\n" + t)]
        else:
            heads = ["a b", "Hello world", "x. y", "don't stop", "3 4", "it 's", "é ü", "a\n b c", "f(x) = y"]
        enc = self.tokenizer.encode
        tails = ("", "x", " x", "\n", "\n\n y", "hello world", "'s", "'ll do", "  ", " é ü", "1 2",
                 *list(self.splitting.values())[:3])
        for head in heads:
            p = self.prefix(head, enc(head), kinds=frozenset([kind]))
            if p is None:
                return False
            for tail in tails:
                if self.encode(head + tail, p) != enc(head + tail):
                    return False
        return True

    @cached_property
    def _token_bytes(self) -> list[bytes]:
        """Token id -> its bytes (the byte-level alphabet decoded; an added token's text)."""
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        char_byte = {c: b for b, c in bytes_to_unicode().items()}
        backend = self.tokenizer.backend_tokenizer
        added = {i: t.content.encode() for i, t in (self.tokenizer.added_tokens_decoder or {}).items()}
        out = []
        for i in range(backend.get_vocab_size(with_added_tokens=True)):
            tok = backend.id_to_token(i)
            out.append(added[i] if i in added else bytes(char_byte[c] for c in tok) if tok is not None else b"")
        return out

    def encode(self, text: str, prefix: EncodedPrefix | None = None) -> list[int]:
        """`tokenizer.encode(text)`, from `prefix` where it is one of text's."""
        if prefix is not None and text.startswith(prefix.text):
            return [*prefix.ids, *self.tokenizer.encode(text[prefix.cut:], add_special_tokens=False)]
        return self.tokenizer.encode(text)

    def prefix(self, text: str, ids: list[int], known: EncodedPrefix | None = None, *,
               kinds: frozenset[str] | None = None) -> EncodedPrefix | None:
        """The last stable cut of `text` (encoded: `ids`) at or after `known`'s, where that is one of text's: the
        answer is then at least `known`. `kinds`: the kinds of cut to look for (default: those in use)."""
        kinds = self.kinds if kinds is None else kinds
        known = known if known is not None and text.startswith(known.text) else None
        lo_char, lo_tok = (known.cut, len(known.ids)) if known is not None else (0, 0)
        best = known
        if "special" in kinds:
            for q in range(len(ids) - 1, lo_tok - 1, -1):
                tok = self.splitting.get(ids[q])
                if tok is not None:  # every occurrence of an added token's text is that token: its last is ids[q]
                    end = text.rfind(tok) + len(tok)
                    best = EncodedPrefix(text[:end], end, tuple(ids[:q + 1]))
                    lo_char, lo_tok = end, q + 1
                    break
        if "space" in kinds:
            cut = self._space_cut(text, ids, lo_char, lo_tok)
            if cut is not None:
                c, i = cut
                best = EncodedPrefix(text[:c + WITNESS], c, tuple(ids[:i]))
        return best

    def _space_cut(self, text: str, ids: list[int], lo_char: int, lo_tok: int) -> tuple[int, int] | None:
        """(c, i): the last space cut of text after lo_char, and the index of its token in ids (the token that
        starts at c); None where there is none."""
        nbytes = len(text.encode())
        sizes = self._token_bytes
        c = len(text) - WITNESS
        while True:
            c = text.rfind(" ", lo_char + 1, c + 1)
            if c < 0:
                return None
            if not text[c - 1].isspace() and not text[c + 1].isspace():
                break
            c -= 1
        at = len(text[:c].encode())
        pos, i = nbytes, len(ids)
        while i > lo_tok and pos > at:  # walk the tokens back from the end to the one starting at c
            i -= 1
            pos -= len(sizes[ids[i]])
        return (c, i) if pos == at else None
