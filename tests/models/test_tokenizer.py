"""The engine's transformers-free tokenizer path gives exactly transformers' ids and text."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from tests.helpers.tokenizers import byte_level_tokenizer, sentencepiece_like_tokenizer
from trtforge.builder.demo_text import corpus_lines
from trtforge.builder.tokenizer_training import train_tiny_tokenizer
from trtforge.models.tokenizer import PlainTokenizer, load_tokenizer

TEXTS = ["The quick brown fox", " leading space", "Café, naïve — déjà vu", "中文分词 🚀👍🏽🇫🇷",
         "<|im_start|>user\nhi<|im_end|>", "tabs\tand\nnewlines\n\n", "", "x" * 300]


@pytest.fixture(scope="module", params=["test", "demo"])
def saved(request, tmp_path_factory):
    tok = (byte_level_tokenizer() if request.param == "test"
           else train_tiny_tokenizer(vocab_size=4096, texts=corpus_lines()))
    directory = tmp_path_factory.mktemp(request.param)
    tok.save_pretrained(str(directory))
    return directory


def test_encode_decode_match_transformers(saved):
    plain, hf = load_tokenizer(saved), AutoTokenizer.from_pretrained(str(saved))
    assert isinstance(plain, PlainTokenizer)
    for text in TEXTS:
        ids = hf.encode(text, add_special_tokens=False)
        assert plain.encode(text, add_special_tokens=False) == ids
        assert plain.encode(text) == hf.encode(text)  # delegated
    ids = list(range(len(hf))) + [len(hf), len(hf) + 7, 151_935]  # every id, and ids past the end
    for skip in (False, True):
        assert plain.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
        for i in ids:  # one at a time, as the detokenizer does
            assert plain.decode([i], skip_special_tokens=skip) == hf.decode([i], skip_special_tokens=skip)
    assert len(plain) == len(hf) and plain.eos_token_id == hf.eos_token_id  # the rest: transformers'


def test_model_specific_or_cleaning_tokenizers_take_the_transformers_path(saved, tmp_path):
    config = json.loads((saved / "tokenizer_config.json").read_text())
    for change in ({"tokenizer_class": "Qwen2Tokenizer"}, {"clean_up_tokenization_spaces": True}):
        directory = tmp_path / "-".join(change)
        directory.mkdir()
        (directory / "tokenizer.json").write_bytes((saved / "tokenizer.json").read_bytes())
        (directory / "tokenizer_config.json").write_text(json.dumps({**config, **change}))
        assert PlainTokenizer.load(directory) is None


def test_sentencepiece_style_decoder_matches(tmp_path):
    sentencepiece_like_tokenizer().save_pretrained(str(tmp_path))
    plain, hf = load_tokenizer(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    if not isinstance(plain, PlainTokenizer):
        pytest.fail("a plain tokenizers checkpoint must take the fast path")
    for text in TEXTS[:4]:
        ids = hf.encode(text, add_special_tokens=False)
        assert plain.encode(text, add_special_tokens=False) == ids
        assert plain.decode(ids) == hf.decode(ids) and plain.decode(ids[1:]) == hf.decode(ids[1:])


def test_loading_does_not_import_transformers(saved):
    code = ("import sys; from trtforge.models.tokenizer import load_tokenizer; "
            f"t = load_tokenizer({str(saved)!r}); t.decode(t.encode('a b', add_special_tokens=False)); "
            "print('transformers' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False False"
