"""Train a tiny byte-level BPE tokenizer offline (no model hub).

Used by ``trtforge demo-checkpoint`` and by the tests: a real ``tokenizers`` BPE model wrapped
as a ``transformers`` fast tokenizer, so every code path that loads a tokenizer from a checkpoint
directory (``AutoTokenizer.from_pretrained``) runs against the genuine article.

Why byte-level: the ByteLevel pre-tokenizer maps every byte to a printable symbol and the trainer
starts from all 256 of them, so *any* byte string encodes and decodes losslessly — including
multi-byte characters split across tokens, which is what the incremental detokenizer must handle.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

EOS_TOKEN = "<|endoftext|>"
BOS_TOKEN = "<|startoftext|>"
PAD_TOKEN = "<|pad|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOS_TOKEN, BOS_TOKEN, PAD_TOKEN, IM_START, IM_END]

# Mixed English / accented / CJK / emoji lines: enough merges that common words become single
# tokens while rarer characters stay split into several byte tokens.
DEFAULT_TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! Hello again, world of tokens and streams.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "In-flight batching mixes prefill chunks with decode tokens.",
    "Café, naïve, résumé, déjà vu — élan and façade.",
    "中文分词测试：你好，世界！模型推理服务。",
    "日本語のテキストも少し。한국어 문장도 있습니다.",
    "Emoji stream: 🚀 launch, 😀 smile, 👍🏽 thumbs, 🇫🇷 flag.",
    "Numbers 0123456789 and symbols {}[]()<>+-*/=_#@$%^&|~`'\".",
    "def step(self):\n    batch = self.schedule()\n    return self.execute(batch)\n",
]

# ChatML, so the OpenAI-style chat endpoint of a demo checkpoint has a template to apply.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def train_tiny_tokenizer(
    vocab_size: int = 512,
    out_dir: str | Path | None = None,
    texts: list[str] | None = None,
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer and return it as a ``PreTrainedTokenizerFast``.

    Args:
        vocab_size: upper bound on the vocabulary, special tokens included. The result has
            ``len(tokenizer) <= vocab_size`` (fewer when the text runs out of merges), so a model
            config may use ``vocab_size`` directly as its embedding size.
        out_dir: if given, ``save_pretrained`` writes ``tokenizer.json``,
            ``tokenizer_config.json`` and ``special_tokens_map.json`` there.
        texts: training lines; defaults to :data:`DEFAULT_TRAINING_TEXT`.

    Training is deterministic: the same arguments give the same vocabulary and merges.
    """
    min_size = len(pre_tokenizers.ByteLevel.alphabet()) + len(SPECIAL_TOKENS)
    if vocab_size < min_size:
        raise ValueError(
            f"vocab_size={vocab_size} is too small for a byte-level tokenizer: it needs the 256 "
            f"byte symbols plus {len(SPECIAL_TOKENS)} special tokens; use vocab_size >= {min_size}."
        )
    backend = Tokenizer(models.BPE())
    # add_prefix_space=False: a leading space is text, not something the tokenizer invents,
    # so decode(encode(s)) == s for every string s.
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts or DEFAULT_TRAINING_TEXT, trainer=trainer)

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS_TOKEN,
        bos_token=BOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
        # Cleanup would rewrite " ." as "." on decode, which no streamed delta can undo.
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 20,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    if out_dir is not None:
        tokenizer.save_pretrained(str(out_dir))
    return tokenizer
