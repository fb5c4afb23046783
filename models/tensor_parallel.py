"""Tensor parallelism's mapping: which slice of each weight a rank holds (Megatron-style).

    q/k/v heads, gate and up   split by output rows (column-parallel: no communication)
    o_proj and down            split by input columns (row-parallel: one all-reduce after each;
                               their bias is kept on rank 0 only, zeros elsewhere, so it is added once)
    LM head                    vocabulary-parallel: rank r holds rows vocab[r·⌈V/tp⌉, (r+1)·⌈V/tp⌉),
                               the logits are all-gathered (tied models slice the replicated embedding)
    embeddings, norms,         replicated
    positions, rope_inv_freq
    MoE (models/moe.py)        every expert's gate/up rows and down columns split as the dense MLP's (and the
                               shared expert's), over their own widths; the router and the shared-expert
                               gate replicated, so every rank routes every token alike and runs its slice
                               of the same experts (expert parallelism, whole experts per rank, is not built)

KV heads are split like q heads when there are at least as many as ranks; with fewer (Qwen2-0.5B:
2 KV heads, MQA: 1), each KV head is replicated on the `tp / Hkv` ranks whose q heads read it, so
rank r holds KV head `r // (tp / Hkv)` and its q heads keep their GQA grouping.

One rank's network is the generic decoder built with `local_config` (per-rank head counts and
intermediate size) and an LM head of its vocabulary slice (network.py); engine.json records the
mapping (`tensor_parallel`) so that a reader sees what each `rank{r}.safetensors` holds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from trtforge.models.errors import BuildError
from trtforge.models.model_config import ModelConfig


@dataclass(frozen=True)
class TPShard:
    """What rank `rank` of `size` holds (half-open ranges of the unsharded model's indices)."""

    rank: int
    size: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]
    vocab_per_rank: int
    """⌈V/tp⌉: every rank's logits are padded to this width for the all-gather (the last slice may be shorter)."""
    expert_intermediate: tuple[int, int] = (0, 0)
    """MoE: this rank's slice of every routed expert's intermediate features (moe_intermediate_size)."""
    shared_intermediate: tuple[int, int] = (0, 0)
    """MoE with a shared expert (Qwen2-MoE): its slice of shared_expert_intermediate_size."""

    @property
    def num_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def vocab_size(self) -> int:
        return self.vocab[1] - self.vocab[0]


def check_tensor_parallel(cfg: ModelConfig, tp: int) -> None:
    """Raise BuildError when `cfg` cannot be split over `tp` ranks, saying which sizes would work."""
    if tp < 1:
        raise BuildError(f"--tp-size must be ≥ 1, got {tp}.")
    if tp == 1:
        return
    fits = [n for n in range(2, 65) if _fits(cfg, n)]
    hint = f" Sizes that fit this model: {', '.join(map(str, fits))}." if fits else " No size > 1 fits this model."
    if cfg.num_heads % tp:
        raise BuildError(f"--tp-size {tp} does not divide the {cfg.num_heads} attention heads: every rank "
                         f"needs whole heads.{hint}")
    hkv = cfg.num_kv_heads
    if (hkv >= tp and hkv % tp) or (hkv < tp and tp % hkv):
        raise BuildError(f"--tp-size {tp} does not fit the {hkv} KV heads: with at least as many KV heads "
                         f"as ranks, tp must divide them; with fewer, they must divide tp (each is then "
                         f"replicated on tp/Hkv ranks).{hint}")
    if cfg.intermediate_size % tp:
        raise BuildError(f"--tp-size {tp} does not divide the MLP's intermediate size "
                         f"{cfg.intermediate_size}.{hint}")
    for width, what in ((cfg.moe_intermediate_size, "experts' intermediate size (moe_intermediate_size)"),
                        (cfg.shared_expert_intermediate_size, "shared expert's intermediate size")):
        if cfg.num_experts and width % tp:
            raise BuildError(f"--tp-size {tp} does not divide the MoE {what} {width}.{hint}")
    if cfg.vocab_size < tp:
        raise BuildError(f"--tp-size {tp} exceeds the vocabulary ({cfg.vocab_size} tokens).")


def _fits(cfg: ModelConfig, tp: int) -> bool:
    hkv = cfg.num_kv_heads
    moe = not cfg.num_experts or (cfg.moe_intermediate_size % tp == 0 and cfg.shared_expert_intermediate_size % tp == 0)
    return (cfg.num_heads % tp == 0 and cfg.intermediate_size % tp == 0 and cfg.vocab_size >= tp and moe
            and ((hkv >= tp and hkv % tp == 0) or (hkv < tp and tp % hkv == 0)))


def shard_of(cfg: ModelConfig, tp: int, rank: int) -> TPShard:
    hq, hkv, inter, vocab = cfg.num_heads // tp, cfg.num_kv_heads, cfg.intermediate_size // tp, cfg.vocab_size
    if hkv >= tp:
        per = hkv // tp
        kv = (rank * per, (rank + 1) * per)
    else:  # replicated: the tp/Hkv ranks whose q heads share a KV head hold a copy of it
        head = rank // (tp // hkv)
        kv = (head, head + 1)
    v_per = -(-vocab // tp)
    expert, shared = cfg.moe_intermediate_size // tp, cfg.shared_expert_intermediate_size // tp
    return TPShard(rank, tp, (rank * hq, (rank + 1) * hq), kv, (rank * inter, (rank + 1) * inter),
                   (min(vocab, rank * v_per), min(vocab, (rank + 1) * v_per)), v_per,
                   (rank * expert, (rank + 1) * expert), (rank * shared, (rank + 1) * shared))


def local_config(cfg: ModelConfig, shard: TPShard) -> ModelConfig:
    """The decoder layers' config on this rank: its heads, KV heads and MLP slice (hidden size whole)."""
    return dataclasses.replace(cfg, num_heads=shard.num_heads, num_kv_heads=shard.num_kv_heads,
                               intermediate_size=shard.intermediate[1] - shard.intermediate[0],
                               moe_intermediate_size=shard.expert_intermediate[1] - shard.expert_intermediate[0],
                               shared_expert_intermediate_size=shard.shared_intermediate[1]
                               - shard.shared_intermediate[0])


def mapping(cfg: ModelConfig, tp: int) -> dict[str, Any]:
    """engine.json's `tensor_parallel`: the scheme and, per rank, the ranges it holds."""
    ranks = []
    for r in range(tp):
        s = shard_of(cfg, tp, r)
        ranks.append({"file": f"rank{r}.safetensors", "q_heads": list(s.q_heads), "kv_heads": list(s.kv_heads),
                      "intermediate": list(s.intermediate), "vocab": list(s.vocab),
                      **({"expert_intermediate": list(s.expert_intermediate)} if cfg.num_experts else {}),
                      **({"shared_expert_intermediate": list(s.shared_intermediate)}
                         if cfg.shared_expert_intermediate_size else {})})
    return {"scheme": "megatron", "embeddings": "replicated", "lm_head": "vocab-parallel (all-gather)",
            "row_parallel_bias": "rank 0", "kv_heads_replicated": cfg.num_kv_heads < tp,
            "vocab_per_rank": -(-cfg.vocab_size // tp), "ranks": ranks,
            **({"experts": "each expert's columns split (as the MLP's); router replicated"} if cfg.num_experts else {})}


def _rows(t: torch.Tensor, parts: list[tuple[int, int]]) -> torch.Tensor:
    return torch.cat([t[a:b] for a, b in parts], dim=0)


def shard_tensor(name: str, t: torch.Tensor, cfg: ModelConfig,  # noqa: PLR0911 - one return per kind of tensor
                 shard: TPShard) -> torch.Tensor:
    """Rank `shard.rank`'s part of our (unsharded, combined) tensor `name` (models/network.py's names)."""
    d, inter = cfg.head_dim, cfg.intermediate_size
    (q0, q1), (k0, k1), (i0, i1) = shard.q_heads, shard.kv_heads, shard.intermediate
    if ".mlp.experts." in name or ".mlp.shared_expert." in name:  # MoE: gate|up rows and down columns
        return _shard_expert(name, t, cfg, shard)
    if ".attn.qkv." in name:  # rows: q heads | k heads | v heads (llama's concat and GPT-2's c_attn alike)
        q, kv = cfg.q_size, cfg.kv_size
        return _rows(t, [(q0 * d, q1 * d), (q + k0 * d, q + k1 * d), (q + kv + k0 * d, q + kv + k1 * d)])
    if ".mlp.gate_up." in name:  # rows: gate | up
        return _rows(t, [(i0, i1), (inter + i0, inter + i1)])
    if ".mlp.up." in name:
        return t[i0:i1]
    if name.endswith("attn.o_proj.weight"):
        return t[:, q0 * d:q1 * d]
    if name.endswith("mlp.down.weight"):
        return t[:, i0:i1]
    if name.endswith(("attn.o_proj.bias", "mlp.down.bias")):  # added once, after the all-reduce's sum
        return t if shard.rank == 0 else torch.zeros_like(t)
    if name == "lm_head.weight":
        return t[shard.vocab[0]:shard.vocab[1]]
    return t  # embeddings, positions, norms, q/k norms, rope_inv_freq: replicated


def _shard_expert(name: str, t: torch.Tensor, cfg: ModelConfig, shard: TPShard) -> torch.Tensor:
    """A routed or shared expert's part on this rank: gate|up rows, down columns of its own width."""
    routed = ".mlp.experts." in name
    width = cfg.moe_intermediate_size if routed else cfg.shared_expert_intermediate_size
    i0, i1 = shard.expert_intermediate if routed else shard.shared_intermediate
    if ".gate_up." in name:
        return _rows(t, [(i0, i1), (width + i0, width + i1)])
    if name.endswith(".down.weight"):
        return t[:, i0:i1]
    raise ValueError(f"no tensor-parallel split for {name!r}")
