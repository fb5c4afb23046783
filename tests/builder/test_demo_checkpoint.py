"""The tiny demo checkpoint: vocabulary = its tokenizer, a chat template, and words when it talks."""

from __future__ import annotations

import json
import re

import pytest
from transformers import AutoTokenizer

from trtforge.builder.build import build_engine
from trtforge.builder.build_config import BuildConfig
from trtforge.builder.demo_checkpoint import write_demo_checkpoint
from trtforge.config.sampling import SamplingParams
from trtforge.models.errors import BuildError
from trtforge.serving.engine import LLMEngine


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return write_demo_checkpoint(tmp_path_factory.mktemp("demo") / "ckpt", arch="qwen2", size="tiny")


def test_vocabulary_is_the_tokenizer_and_chat_works(demo):
    tok = AutoTokenizer.from_pretrained(str(demo))
    config = json.loads((demo / "config.json").read_text())
    assert config["vocab_size"] == len(tok) and "random weights" in config["trtforge_demo"]
    assert "chat_template" in json.loads((demo / "tokenizer_config.json").read_text())
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hello"}], tokenize=False,
                                     add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(" the quick brown fox jumps over the lazy dog", add_special_tokens=False)
    assert len(ids) == 9  # the pieces are whole words


def test_greedy_random_model_says_words(demo, tmp_path):
    out, _ = build_engine(str(demo), tmp_path / "eng", BuildConfig(dtype="float32", kv_cache_memory="4MiB",
                                                                   max_seq_len=128), progress=False)
    engine = LLMEngine.from_engine_dir(out)
    prompts = ["The quick brown fox", "Hello", "中文 🚀", "<|im_start|>user\nhi<|im_end|>\n"]
    for result in engine.generate(prompts, [SamplingParams(max_tokens=24)] * len(prompts)):
        assert len(result.output_token_ids) == 24
        assert re.fullmatch(r"( [A-Za-z']+|[.,?!;:])+", result.text), result.text


def test_training_is_for_tiny_only(tmp_path):
    with pytest.raises(BuildError, match="--train-seconds needs --size tiny"):
        write_demo_checkpoint(tmp_path / "big", size="0.5b", train_seconds=1.0)


def test_a_second_of_training_is_recorded(tmp_path):
    out = write_demo_checkpoint(tmp_path / "trained", train_seconds=1.0)
    note = json.loads((out / "config.json").read_text())["trtforge_demo"]
    assert re.match(r"random weights trained 1 s \(\d+ steps\) on the bundled demo text", note), note
