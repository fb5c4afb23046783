"""Quantization accuracy on TRAINED checkpoints, measured on held-out text (not run in CI).

Random-weight checkpoints have almost flat next-token distributions, so their top-1 agreement
says little about a real model (docs/quantization.md). No trained checkpoint can be downloaded
here, so this script trains small ones itself, on text every Python install has: the standard
library's source. Files are split by name (a stable hash) into a training part and a held-out
part; a byte-level BPE tokenizer (builder/tokenizer_training.py) is trained on the training part,
then a Qwen2- and a Llama-family model (HF transformers, random init) are trained for
--train-seconds each. The float32 / int8_wo / int4_wo engines of each checkpoint are then
teacher-forced on held-out windows (tests/builder/quant_accuracy.py: mean KL(float32 ‖ quantized)
and greedy top-1 agreement over every position).

    python scripts/quant_accuracy_trained.py --work out/quant_trained [--train-seconds 240] [--json f]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import sysconfig
import time
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.builder.quant_accuracy

from tests.builder.quant_accuracy import measure
from trtforge.builder.tokenizer_training import train_tiny_tokenizer

VOCAB, HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = 4096, 256, 768, 4, 4, 2
"""Model shapes: intermediate a multiple of 128 so int4 takes group 128, the default."""


def corpus(limit_bytes: int) -> tuple[list[str], list[str]]:
    """(training files' text, held-out files' text) from the standard library, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, held, size = [], [], 0
    for f in sorted(root.glob("*.py")):
        text = f.read_text(errors="replace")
        (held if zlib.crc32(f.name.encode()) % 10 == 0 else train).append(text)
        size += len(text)
        if size >= limit_bytes:
            break
    return train, held


def make_model(arch: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=2048,
                  rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=0, pad_token_id=0)
    if arch == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=True))
    return LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=False))


def train(model, ids: torch.Tensor, seconds: float, window: int = 128, batch: int = 16, lr: float = 2e-3) -> dict:
    """Next-token training on random windows, cosine learning rate over the time budget."""
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    model.train()
    start, steps, losses = time.monotonic(), 0, []
    while (elapsed := time.monotonic() - start) < seconds:
        for group in opt.param_groups:
            group["lr"] = lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * elapsed / seconds)))
        starts = torch.randint(0, len(ids) - window, (batch,), generator=g).tolist()
        x = torch.stack([ids[s:s + window] for s in starts])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        steps += 1
        losses.append(loss.item())
    model.eval()
    return {"steps": steps, "final_train_loss": sum(losses[-20:]) / len(losses[-20:])}


def held_out_loss(model, windows: list[list[int]]) -> float:
    with torch.no_grad():
        x = torch.tensor(windows)
        return model(input_ids=x, labels=x).loss.item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", required=True)
    ap.add_argument("--train-seconds", type=float, default=240.0)
    ap.add_argument("--archs", default="qwen2,llama")
    ap.add_argument("--windows", type=int, default=8, help="held-out windows of --window tokens")
    ap.add_argument("--window", type=int, default=100)
    ap.add_argument("--corpus-mb", type=float, default=6.0)
    ap.add_argument("--reuse", action="store_true", help="use WORK/ckpt_<arch> where it exists instead of training")
    ap.add_argument("--int4-head", action="store_true",
                    help="also measure int4_wo with --lm-head-quantization int4_wo (key int4_wo_int4_head)")
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.manual_seed(0)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    train_text, held_text = corpus(int(args.corpus_mb * 1e6))
    saved = [work / f"ckpt_{a}" for a in args.archs.split(",") if (work / f"ckpt_{a}" / "tokenizer.json").is_file()]
    if args.reuse and saved:  # the tokenizer the saved checkpoints were trained with
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(saved[0]))
    else:
        tokenizer = train_tiny_tokenizer(vocab_size=VOCAB, texts=[ln for t in train_text for ln in t.splitlines(True)])
    ids = torch.tensor(tokenizer.encode("".join(train_text), add_special_tokens=False))
    held = tokenizer.encode("".join(held_text), add_special_tokens=False)
    stride = len(held) // args.windows
    windows = [held[i * stride:i * stride + args.window] for i in range(args.windows)]
    report = {"corpus": {"train_files": len(train_text), "held_out_files": len(held_text), "train_tokens": len(ids),
                         "held_out_tokens": len(held), "vocab": len(tokenizer)},
              "shapes": {"hidden": HIDDEN, "intermediate": INTERMEDIATE, "layers": LAYERS, "heads": HEADS,
                         "kv_heads": KV_HEADS}}
    for arch in args.archs.split(","):
        ckpt = work / f"ckpt_{arch}"
        if args.reuse and (ckpt / "config.json").is_file():
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(str(ckpt))
            stats = {"reused": str(ckpt)}
        else:
            model = make_model(arch)
            stats = train(model, ids, args.train_seconds)
            model.save_pretrained(str(ckpt), safe_serialization=True)
            tokenizer.save_pretrained(str(ckpt))
        stats["held_out_loss"] = held_out_loss(model, windows)
        print(arch, stats, flush=True)
        got = measure(ckpt, work / f"engines_{arch}", {"int8_wo": None, "int4_wo": 128}, windows)
        if args.int4_head:
            got["int4_wo_int4_head"] = measure(ckpt, work / f"engines_{arch}_h4", {"int4_wo": 128}, windows,
                                               lm_head_quantization="int4_wo")["int4_wo"]
        report[arch] = {"training": stats, **got}
        print(arch, json.dumps(got), flush=True)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text)


if __name__ == "__main__":
    main()
