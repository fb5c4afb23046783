"""The Mixture-of-Experts block of Mixtral, Qwen2-MoE and Qwen3-MoE: router → top-k → experts run grouped.

    x [T, H] ─router─▶ logits [T, E] ─softmax (float32)─▶ top-k ─▶ weights [T, k], experts [T, k]
                                                        (renormalised to sum 1 where norm_topk_prob)
    the T·k (token, slot) pairs sorted by expert: each expert's tokens are one contiguous run
    for each expert that some token chose:
        y = down(act(gate(x[tokens])) * up(x[tokens]))      one GEMM for gate|up, one for down
    the outputs put back in (token, slot) order, weighted and summed over each token's k slots
    + Qwen2-MoE's shared expert on every token: sigmoid(shared_expert_gate(x)) * shared_expert(x)

The Python loop runs over the experts that were chosen, never over tokens; an expert no token chose is
not called, so a decode step reads only the selected experts' weights (each expert is an ordinary gated
MLP of models/mlp.py: its linears are the kernels the registry chose, CpuLinear's packed GEMM or
QuantLinear's int8/int4 kernels, built by models/layers.py like the dense MLP's). A token's k expert outputs
are summed in its top-k order (transformers adds them in expert order: float32 results differ by rounding).
On CPU a decode step runs this same algorithm as C calls inside the CPU decode plan
(serving/worker/cpu_decode_plan.py, kernels in plugins/cpu/fused.c with this module as their reference); this
path serves prefill chunks, mixed steps and every other device.

`forward_reference` is the obvious formula beside it, the fast path's oracle (tests/models/test_moe_block.py):
every expert on every token, combined by a dense [T, E] matrix of routing weights (zero where a token did
not choose the expert). It is also what runs while a CUDA graph is captured (the grouped path reads the
expert counts on the host, which capture forbids): then every expert is read each step.

With tensor parallelism (models/tensor_parallel.py) every expert's gate/up rows and down columns are split
across ranks like the dense MLP's; the router runs whole on every rank (the same choice everywhere) and the
block's partial sums join the decoder layer's one all-reduce after it.
"""

from __future__ import annotations

import torch
from torch import nn

from trtforge.models.layers import Layers
from trtforge.models.mlp import MLP
from trtforge.models.model_config import ModelConfig


def route(logits: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [T, k], expert ids int64 [T, k]) from router logits [T, E]: softmax in float32,
    top-k, renormalised over the k where `normalize` (transformers' routers, step for step)."""
    logits = logits.float()
    probs = (logits - logits.amax(-1, keepdim=True)).exp()  # softmax written out: torch.softmax wakes the
    probs = probs / probs.sum(-1, keepdim=True)  # [T, E]   thread pool for a few rows (see _grouped)
    weights, experts = torch.topk(probs, k, dim=-1)  # [T, k] each
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


class SparseMoE(nn.Module):
    """State: `router.weight` [E, H]; `experts.{e}.gate_up` / `.down` (gated MLPs of moe_intermediate_size);
    Qwen2-MoE: `shared_expert.gate_up` / `.down` and `shared_expert_gate.weight` [1, H]."""

    def __init__(self, cfg: ModelConfig, layers: Layers):
        super().__init__()
        self.top_k, self.normalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.router = layers.linear("mlp.router", cfg.hidden_size, cfg.num_experts, False)  # never quantized
        self.experts = nn.ModuleList(MLP(cfg, layers, cfg.moe_intermediate_size, "mlp.experts")
                                     for _ in range(cfg.num_experts))
        self.shared_expert = self.shared_expert_gate = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = MLP(cfg, layers, cfg.shared_expert_intermediate_size, "mlp.shared_expert")
            self.shared_expert_gate = layers.linear("mlp.shared_expert_gate", cfg.hidden_size, 1, False)

    def extra_repr(self) -> str:
        return f"top_k={self.top_k}, renormalised={self.normalize}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return self.forward_reference(x)
        weights, experts = route(self.router(x), self.top_k, self.normalize)  # [T, k] each
        out = self._grouped(x, weights, experts)
        return self._add_shared(x, out)

    def _grouped(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum [T, H]: one GEMM pair per chosen expert on its gathered tokens.

        Every step here is one small tensor op per layer (plus the experts' own kernels): no index_add_ or
        per-expert gather, which on a busy 2-core CPU cost ~0.6 ms each whenever they wake torch's thread
        pool for a decode step's few rows (measured: a 1-row index_add_ 647 us at 2 threads, 3.8 us at 1)."""
        t, k = experts.shape
        flat = experts.flatten()  # [T·k]: the expert of each (token, slot) pair
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert, in token order within a group
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()  # one host read per layer
        xs = x.index_select(0, order // k)  # [T·k, H]: each expert's tokens, one contiguous run per expert
        outs, start = [], 0
        for e, n in enumerate(counts):
            if n:  # an expert no token chose is never called: its weights are not read
                outs.append(self.experts[e](xs[start:start + n]))  # [n, H]
            start += n
        ys = torch.cat(outs).index_select(0, torch.argsort(order))  # [T·k, H], back in (token, slot) order
        return (ys.view(t, k, -1) * weights.to(x.dtype).unsqueeze(-1)).sum(1)  # weighted sum over the k slots

    def _add_shared(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if self.shared_expert is None:
            return out
        return out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)  # [T, H]

    def forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        """The same block as the obvious formula: every expert on every token, weighted by a dense [T, E]
        matrix of routing weights (module docstring)."""
        weights, experts = route(self.router(x), self.top_k, self.normalize)  # [T, k] each
        dense = torch.zeros(x.shape[0], len(self.experts), device=x.device)  # [T, E] float32
        dense.scatter_(1, experts, weights)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            out = out + expert(x) * dense[:, e:e + 1].to(x.dtype)  # [T, H]
        return self._add_shared(x, out)
