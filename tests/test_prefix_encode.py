"""PrefixEncoder (lmc/runtime/prefix_encode.py): a chain's re-encoding from its text's last stable cut (after a
special token, before a space between two non-spaces) gives exactly the tokenizer's encoding of the whole text,
on the embedded model's tokenizer."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmc.runtime.prefix_encode import PrefixEncoder


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from lmc.runtime.model.loader import resolve

    return AutoTokenizer.from_pretrained(resolve("smollm2-135m-instruct").tokenizer_dir)


@pytest.fixture(scope="module")
def encoder(tokenizer):
    return PrefixEncoder(tokenizer)


PIECES = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "user", "assistant", "\n", "\n\n", " ", "  ", "Hello",
          " world", "Thought:", " Action:", "x", "123", " 4.5", "é", " ü", "'s", "'", "ll", "re", "don't", "\t",
          "<|im", "_end|>", " ", "a", "b", ".", ",", "(", ")", "[", "]", "=", "😀", "\u00a0", "\r\n", "7"]


def test_the_embedded_tokenizer_cuts_at_chat_tokens_and_spaces(tokenizer):
    enc = PrefixEncoder(tokenizer)
    assert enc.kinds == {"special", "space"}
    assert "<|im_start|>" in enc.splitting.values() and "<|im_end|>" in enc.splitting.values()
    text = "Question: What is 2 + 3?\nThought 1:"
    p = enc.prefix(text, tokenizer.encode(text))
    assert p.cut == text.rindex(" ") and p.text == text[:p.cut + 2]  # before " 1", its witness kept


def test_the_cuts_cover_almost_all_of_a_long_text(tokenizer):
    """What the cut saves: a long raw text (react_agent's prompt) re-encodes from its last few characters."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent.parent / "examples"))
    from react_agent import PROMPT

    enc = PrefixEncoder(tokenizer)
    text = PROMPT + "Question: What is the capital of France?\nThought 1: I need"
    p = enc.prefix(text, tokenizer.encode(text))
    assert len(text) - p.cut <= len(" need")
    assert enc.encode(text + " the capital.", p) == tokenizer.encode(text + " the capital.")


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=30), st.lists(st.sampled_from(PIECES), max_size=12),
       st.lists(st.sampled_from(PIECES), max_size=12))
def test_encoding_from_the_prefix_is_the_full_encoding(tokenizer, encoder, head, middle, tail):
    enc = encoder
    text1 = "".join(head)
    text2 = text1 + "".join(middle)
    text3 = text2 + "".join(tail)
    p1 = enc.prefix(text1, tokenizer.encode(text1))
    ids2 = enc.encode(text2, p1)
    assert ids2 == tokenizer.encode(text2)
    p2 = enc.prefix(text2, ids2, p1)  # found from where p1 ends (or p1 itself)
    assert p2 == enc.prefix(text2, ids2)
    if p2 is not None:
        assert text2.startswith(p2.text) and list(p2.ids) == tokenizer.encode(text2[:p2.cut])
        if p2.cut == len(p2.text):  # after a special token
            assert p2.text.endswith(enc.splitting[p2.ids[-1]])
        else:  # before a space between two non-spaces, with them
            assert len(p2.text) == p2.cut + 2 and p2.text[p2.cut] == " " and not p2.text[p2.cut + 1].isspace()
    assert enc.encode(text3, p2) == tokenizer.encode(text3)


def test_a_prefix_that_is_not_the_texts_is_not_used(tokenizer):
    enc = PrefixEncoder(tokenizer)
    text = "<|im_start|>user\nHi<|im_end|>\n"
    p = enc.prefix(text, tokenizer.encode(text))
    other = "<|im_start|>system\nBe brief<|im_end|>\n"
    assert enc.encode(other, p) == tokenizer.encode(other)


class AppendsEosTokenizer:
    """Test double: the embedded tokenizer with a post-processor that appends EOS to every encoding (as some
    tokenizers' templates do), for which encode(P + S) is not encode(P) + encode(S): the encoder must not split."""

    def __init__(self, tok):
        self.tok, self.added_tokens_decoder = tok, tok.added_tokens_decoder

    def encode(self, text, add_special_tokens=True):
        ids = self.tok.encode(text, add_special_tokens=add_special_tokens)
        return ids + [self.tok.eos_token_id] if add_special_tokens else ids


def test_a_tokenizer_the_identity_fails_for_is_never_split(tokenizer):
    double = AppendsEosTokenizer(tokenizer)
    enc = PrefixEncoder(double)
    assert not enc.enabled
    text = "<|im_start|>user\nHi there<|im_end|>\n"
    assert enc.prefix(text, double.encode(text)) is None
    assert enc.encode(text + "x") == double.encode(text + "x")


def test_gpt2_byte_level_configs():
    """tokenizer.json forms of GPT-2's byte-level BPE (the embedded model's, as transformers 5.25 and, from the
    GGUF, 5.17 write it) are recognized; a normalizer or a prefix space is not."""
    from lmc.runtime.prefix_encode import gpt2_byte_level

    pre = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    bpe = {"type": "BPE", "dropout": None, "byte_fallback": True}
    assert gpt2_byte_level({"normalizer": None, "pre_tokenizer": pre, "model": bpe})
    assert gpt2_byte_level({"normalizer": {"type": "Sequence", "normalizers": []}, "pre_tokenizer": pre, "model": bpe})
    assert not gpt2_byte_level({"normalizer": {"type": "NFC"}, "pre_tokenizer": pre, "model": bpe})
    assert not gpt2_byte_level({"normalizer": None, "pre_tokenizer": {**pre, "add_prefix_space": True}, "model": bpe})
    assert not gpt2_byte_level({"normalizer": None, "pre_tokenizer": {"type": "Metaspace"}, "model": bpe})
