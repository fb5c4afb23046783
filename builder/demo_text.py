"""The demo checkpoint's English: a bundled text, its words, and a few seconds of training on it.

`demo_corpus.txt` is a few KB of plain English written for this project. The demo tokenizer
is trained on it, so its pieces are the text's words (" quick", " brown", " fox"), and a random
model whose LM head can only pick whole words prints words, not byte fragments. `train_briefly`
optionally fits a tiny model to the text for a few seconds, after which it continues a prompt
with the text's phrases (it recites and recombines them: it has seen nothing else).
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import torch

CORPUS = Path(__file__).with_name("demo_corpus.txt")
_WORD = re.compile(r"[A-Za-z']+")
_PUNCTUATION = {".", ",", "?", "!", ";", ":"}


def corpus_text() -> str:
    return CORPUS.read_text(encoding="utf-8")


def corpus_lines() -> list[str]:
    return corpus_text().splitlines(keepends=True)


def word_token_ids(tokenizer: Any) -> list[int]:
    """Ids whose text alone is " word" for a whole word of the corpus, or a punctuation mark: not
    a byte fragment, a piece of a word ("ten" of "often"), a newline or a special token. Every
    word keeps its leading space, so any sequence of them reads as words."""
    words = set(_WORD.findall(corpus_text()))
    special = set(tokenizer.all_special_ids)
    keep = []
    for token_id in range(len(tokenizer)):
        text = tokenizer.decode([token_id])
        if token_id not in special and ((text[:1] == " " and text[1:] in words) or text in _PUNCTUATION):
            keep.append(token_id)
    return keep


@torch.no_grad()
def speak_only_words(model: Any, tokenizer: Any) -> int:
    """Zero the LM-head rows of every non-word token: their logit is then exactly 0 while the
    ~1,000 word rows give random logits whose maximum is far above 0, so greedy decoding of the
    random model picks words only (sampling mostly). Returns how many rows were zeroed."""
    head = model.get_output_embeddings().weight  # [V, H]; with tied embeddings also the inputs'
    quiet = torch.ones(head.shape[0], dtype=torch.bool)
    quiet[word_token_ids(tokenizer)] = False
    head[quiet] = 0
    return int(quiet.sum())


def train_briefly(model: Any, tokenizer: Any, seconds: float, seed: int = 0,
                  window: int = 64, batch: int = 16, lr: float = 3e-3) -> int:
    """Next-token training on random windows of the corpus for `seconds` of wall time (so the
    result depends on the machine's speed). Returns the number of steps taken."""
    ids = torch.tensor(tokenizer.encode(corpus_text(), add_special_tokens=False))
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    steps, deadline = 0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        starts = torch.randint(0, len(ids) - window, (batch,), generator=generator)
        x = torch.stack([ids[s:s + window] for s in starts.tolist()])  # [B, window]
        loss = model(input_ids=x, labels=x).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        steps += 1
    model.eval()
    return steps
