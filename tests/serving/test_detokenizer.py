"""Incremental detokenizer against the real tokenizers' full decode."""

from __future__ import annotations

import random

import pytest

from tests.helpers.tokenizers import byte_level_tokenizer, sentencepiece_like_tokenizer
from trtforge.serving.detokenizer import IncrementalDetokenizer

TEXT = "Hello, world! Café déjà vu — 中文分词 🚀👍🏽 done.\n  two  spaces\tand tab ¿sí?"
TOKENIZERS = {"byte_level": byte_level_tokenizer, "sentencepiece": sentencepiece_like_tokenizer}


def _stream(tokenizer, ids, chunk=1, **kwargs):
    detok = IncrementalDetokenizer(tokenizer, [1, 2], **kwargs)
    deltas = [detok.step(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(detok.flush())
    return detok, deltas


@pytest.mark.parametrize("name", TOKENIZERS)
def test_every_step_matches_decode_of_prefix(name):
    tok = TOKENIZERS[name]()
    ids = tok.encode(TEXT, add_special_tokens=False)
    final = tok.decode(ids, skip_special_tokens=True)
    detok = IncrementalDetokenizer(tok, [])
    streamed = ""
    for k, token in enumerate(ids, start=1):
        delta = detok.step([token])
        assert "\ufffd" not in delta
        streamed += delta
        assert final.startswith(streamed)  # never emitted, then retracted
        prefix = tok.decode(ids[:k], skip_special_tokens=True)
        if not prefix.endswith("\ufffd"):  # no character split at this point: nothing held
            assert streamed == prefix
    assert streamed == final == TEXT
    assert detok.flush() == ""


@pytest.mark.parametrize("name", TOKENIZERS)
def test_split_multibyte_characters_are_held_back(name):
    tok = TOKENIZERS[name]()
    ids = tok.encode("中🚀", add_special_tokens=False)
    assert len(ids) > 2  # the characters really are split across tokens
    _, deltas = _stream(tok, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == "中🚀"


def test_sentencepiece_spaces_survive_streaming():
    tok = sentencepiece_like_tokenizer()
    ids = tok.encode("Hello world again streaming spaces", add_special_tokens=False)
    naive = "".join(tok.decode([i]) for i in ids)  # the TensorRT-LLM streaming bug
    assert naive != "Hello world again streaming spaces"
    _, deltas = _stream(tok, ids)
    assert "".join(deltas) == "Hello world again streaming spaces"


@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize("chunk", [2, 3, 7])
def test_multi_token_steps(name, chunk):
    tok = TOKENIZERS[name]()
    ids = tok.encode(TEXT, add_special_tokens=False)
    _, deltas = _stream(tok, ids, chunk=chunk)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(skip):
    tok = byte_level_tokenizer()
    ids = tok.encode("one two", add_special_tokens=False)
    ids = ids[:1] + [tok.eos_token_id, tok.pad_token_id] + ids[1:] + [tok.eos_token_id]
    detok, deltas = _stream(tok, ids, skip_special_tokens=skip)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip) == detok.output_text
    assert ("<|endoftext|>" in detok.output_text) is not skip


def _soup(tok, rng):
    """Random ids: byte-level gets any id (invalid UTF-8 included); for the byte-fallback
    tokenizer, <0xNN> pieces only appear as whole characters, since ByteFallback renders a run
    of bytes that is invalid *as a whole* as U+FFFDs — ASCII bytes too, retroactively."""
    if tok is byte_level_tokenizer():
        return [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 40))]
    pieces = [i for t, i in tok.get_vocab().items() if not t.startswith("<0x")]
    ids = []
    while len(ids) < rng.randrange(1, 40):
        if rng.random() < 0.2:
            ids += tok.encode(chr(rng.choice([0xE9, 0x4E2D, 0x1F680, 0x10348])),
                              add_special_tokens=False)
        else:
            ids.append(rng.choice(pieces))
    return ids


@pytest.mark.parametrize("name", TOKENIZERS)
def test_random_token_soup_matches_decode(name):
    """Random ids (lone byte tokens, specials, odd spacing) still concatenate to decode()."""
    tok = TOKENIZERS[name]()
    rng = random.Random(0)
    for _ in range(30):
        ids = _soup(tok, rng)
        for skip in (True, False):
            detok, deltas = _stream(tok, ids, chunk=rng.choice([1, 1, 2]), skip_special_tokens=skip)
            assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip), ids


def test_incomplete_tail_is_flushed_as_decode_shows_it():
    tok = byte_level_tokenizer()
    ids = tok.encode("ok 中", add_special_tokens=False)
    cut = next(k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tok, [])
    streamed = "".join(detok.step([t]) for t in ids[:cut])
    assert "\ufffd" not in streamed
    assert streamed + detok.flush() == tok.decode(ids[:cut])


def test_prompt_context_keeps_the_first_leading_space():
    tok = sentencepiece_like_tokenizer()
    prompt = tok.encode("Hello", add_special_tokens=False)
    full = tok.encode("Hello world again", add_special_tokens=False)
    assert full[: len(prompt)] == prompt
    output = full[len(prompt):]
    detok = IncrementalDetokenizer(tok, prompt, use_prompt_context=True)
    streamed = "".join(detok.step([t]) for t in output) + detok.flush()
    assert streamed == " world again"
    plain = IncrementalDetokenizer(tok, prompt)  # default: exactly decode(output_ids)
    assert "".join(plain.step([t]) for t in output) == tok.decode(output) == "world again"


class _CountingTokenizer:
    """The real tokenizer, recording how many ids each decode call is given."""

    def __init__(self, tokenizer):
        self.tokenizer, self.window_sizes = tokenizer, []

    def decode(self, ids, skip_special_tokens=False):
        self.window_sizes.append(len(ids))
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_work_per_token_is_bounded_by_the_window():
    tok = byte_level_tokenizer()
    ids = tok.encode(TEXT * 8, add_special_tokens=False)
    counting = _CountingTokenizer(tok)
    _, deltas = _stream(counting, ids)
    assert "".join(deltas) == tok.decode(ids)
    assert len(ids) > 200 and max(counting.window_sizes) <= 8
    assert len(counting.window_sizes) <= 3 * len(ids) + 2
