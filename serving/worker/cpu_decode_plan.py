"""The CPU counterpart of CUDA graphs: a decode step as a fixed list of C kernel calls.

A float32 decode step of a few tokens on CPU is bound by reading the weights; everything else
should cost next to nothing. Through the network's modules it does not: per layer ~10 module calls,
view/split ops, routing checks and tensor allocations, run between weight streams that have just
flushed the caches, add ~15 ms to a ~130 ms batch-1 step of a 0.5B model (measured by
`trtforge bench offline`'s decode breakdown). This plan runs the same step as one Python loop over
the layers calling the kernels the network itself uses (plugins/cpu/fused.c, plugins/cpu/linear.c
on the packed weights, plugins/paged_attention/cpu_decode.c) on buffers allocated once per batch
size, with their argument tuples built once:

    embed → per layer: add+RMSNorm → qkv GEMM → RoPE → KV write + attention → o GEMM
          → add+RMSNorm → gate_up GEMM → SiLU·mul → down GEMM → final add+RMSNorm → head GEMM

Speculative decoding's verification steps (a few tokens per sequence, logits at every one) run
here too: the C attention takes one query per entry, so a sequence's query of q tokens is handed
to it as q entries sharing its block table, entry j attending positions 0..start + j. The kernel
writes every new token's K/V before it attends, so each entry sees the drafts before it exactly
as the op's multi-token (prefill) path does.

Like `CudaGraphRunner`, the executor asks `can_run` per step and falls back to the network for
everything else (prefill chunks, mixed steps, more than `MAX_ROWS` tokens — `GEMV_MAX_ROWS` for an
engine with float-activation quantized linears — and long contexts). Only
Llama-style networks qualify (RMSNorm, gated SiLU MLP or MoE experts, whole-head RoPE, q/k norms allowed, none
of the Gemma / Phi-3 switches: `ModelConfig.switches_beyond_llama`); others keep the network path.
Results equal the network's up to float32 rounding (tests/serving/worker/test_cpu_decode_plan.py).
Weight-only quantized engines run the same plan with the quantized GEMV (plugins/cpu/quant_linear.c)
for their decoder linears (QuantLinear) and their LM head when it is quantized too (a tied one also
supplies the embeddings: QuantEmbedding dequantises the looked-up rows) — the int8-activation kernel
where it takes the layer, exactly as each QuantLinear was built to run (its `a8`: models/quantized_layers.py).
Which linears qualify is decided by the layers the network was built with (models/layers.py): a
packed CpuLinear, the packed tied LM head, or a QuantLinear on its C kernels. A pre-quantized
checkpoint's decoder layer (GPTQ / AWQ / compressed-tensors) runs as its `forward` does: an act-order
permutation gathers the input into a scratch buffer first (`trtforge_gather_columns`) and zero points
subtract their correction from the GEMV's output after it (`trtforge_zero_point_correction`, both in
quant_linear.c) — one Python closure per such layer wrapping the three calls; layers without them keep
their single GEMV call.

Mixture-of-Experts layers (Mixtral, Qwen2-MoE, Qwen3-MoE: models/moe.py) run here too, the grouped path of
`SparseMoE` as C calls (plugins/cpu/fused.c): the router GEMV → `trtforge_moe_route` (softmax, top-k, the
(token, slot) pairs numbered in expert order) → `trtforge_gather_rows` (each expert's tokens one contiguous
run) → per expert some token chose, its gate_up GEMV, SiLU·mul and down GEMV on its run of rows (an expert no
token chose is not called: its weights are not read) → `trtforge_moe_combine` (each token's k outputs weighted
and summed in top-k order, plus Qwen2-MoE's sigmoid-gated shared expert). The only host read of a layer is its
expert counts. Qwen3's q/k norms (per-head RMSNorm before RoPE) are one `trtforge_head_rms_norm` call each.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import torch

from trtforge.models.layers import TiedLMHead
from trtforge.models.moe import SparseMoE
from trtforge.models.quantized_layers import QuantLinear
from trtforge.models.rope import rotary_cos_sin
from trtforge.plugins.cpu import fused as cpu_fused, linear as cpu_linear, quant_linear as cpu_quant
from trtforge.plugins.cpu.linear import CpuLinear
from trtforge.plugins.cpu.quant_linear import GEMV_MAX_ROWS
from trtforge.plugins.paged_attention import cpu_native
from trtforge.serving.worker.model_inputs import ModelInputs


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _plan_linear(m: Any, head: bool = False) -> bool:
    """A linear the plan can call: a packed float32 CpuLinear or tied head, or a QuantLinear built
    for its C kernels and of a shape they take (zero points and a permutation: decoder layers only)."""
    if isinstance(m, QuantLinear):
        return (m.native and m.in_features % 8 == 0 and (m.group or 8) % 8 == 0 and m.scales.device.type == "cpu"
                and (m.bias is None or m.bias.dtype == torch.float32)
                and not (head and (m.zeros is not None or m.perm is not None)))
    return isinstance(m, (CpuLinear, TiedLMHead)) and m.packed is not None


def _quant_parts(lin: QuantLinear) -> tuple[Any, tuple, tuple]:
    """(function, weight arguments, shape arguments) of the quantized GEMV of `lin`, called as
    function(x, rows, *weights, y, *shape, threads): the int8-activation kernel where the layer uses it
    (`lin.a8`), as QuantLinear runs it."""
    if lin.vnni is not None:  # packed for the int8 panel GEMM, VNNI or AVX2 (QuantLinear.pack_weights)
        return (cpu_quant.LIBRARY.lib.trtforge_gemm_int8_vnni, (lin.vnni[0].data_ptr(), lin.vnni[1].data_ptr(),
                lin.scales.data_ptr(), _ptr(lin.bias)), (lin.out_features, lin.in_features))
    shape = (lin.out_features, lin.in_features) + (() if lin.scheme == "int8_wo" else (lin.group,))
    return (cpu_quant.gemv_function(lin.scheme, lin.a8), (lin.qweight.data_ptr(), lin.scales.data_ptr(),
            _ptr(lin.bias)), shape)


def _quant_gemv(lin: QuantLinear, x: int, t: int, y: int) -> tuple:
    """The call tuple (function, arguments but threads) of the quantized GEMV of `lin` (`_quant_parts`).
    Every GEMV of the plan returns None or 0; an int8-activation one nonzero when out of memory."""
    fn, weights, shape = _quant_parts(lin)
    return (fn, x, t, *weights, y, *shape)


def _with_extras(lin: QuantLinear, x: int, t: int, y: int, gathered: int | None) -> tuple:
    """The call tuple of a QuantLinear with zero points and/or a permutation: (closure,), called with the
    threads like a GEMV tuple — gather x into `gathered` (perm), the GEMV on it, then the zero-point
    correction on the GEMV's input and output. Layers without either get `_quant_gemv`'s tuple itself."""
    if lin.zeros is None and lin.perm is None:
        return _quant_gemv(lin, x, t, y)
    lib = cpu_quant.LIBRARY.lib
    gather = None if lin.perm is None else (lib.trtforge_gather_columns, x, t, lin.in_features,
                                             lin.perm.data_ptr(), gathered)
    x = x if gather is None else gathered
    gemv_fn, *gemv_args = _quant_gemv(lin, x, t, y)
    correct = None
    if lin.zeros is not None:
        zs = lin.zero_scales_t()  # cached on the layer: alive as long as the plan's pointer
        correct = (lib.trtforge_zero_point_correction, x, t, lin.in_features, zs.shape[0], zs.data_ptr(), y,
                   lin.out_features)

    def call(threads: int) -> int:
        if gather is not None:
            gather[0](*gather[1:])
        if gemv_fn(*gemv_args, threads):
            return 1
        return 0 if correct is None else correct[0](*correct[1:], threads)

    return (call,)


def _mlp_linears(mlp: Any) -> list[Any]:
    """A layer's feed-forward linears: gate_up, down; an MoE block's router, every expert's gate_up and down,
    and the shared expert's gate_up, down and gate."""
    if not isinstance(mlp, SparseMoE):
        return [mlp.gate_up, mlp.down]
    shared = [] if mlp.shared_expert is None else [mlp.shared_expert.gate_up, mlp.shared_expert.down,
                                                   mlp.shared_expert_gate]
    return [mlp.router, *(m for e in mlp.experts for m in (e.gate_up, e.down)), *shared]


def _rows_gemv(lin: Any, packed_linear: Any, gathered: int | None) -> Callable[[int, int, int, int], Any]:
    """f(x, rows, y, threads): the GEMV of `lin` on `rows` rows at address x into y — an MoE expert's run
    of tokens, whose row count is known only once the step is routed. Returns what the kernel returns."""
    if not isinstance(lin, QuantLinear):
        w, bias, n, k = lin.packed.data_ptr(), _ptr(lin.bias), lin.out_features, lin.in_features
        return lambda x, rows, y, threads: packed_linear(x, rows, w, bias, y, n, k, threads)
    if lin.zeros is not None or lin.perm is not None:  # pre-quantized extras: the closure of `_with_extras`
        return lambda x, rows, y, threads: _with_extras(lin, x, rows, y, gathered)[0](threads)
    fn, weights, shape = _quant_parts(lin)
    return lambda x, rows, y, threads: fn(x, rows, *weights, y, *shape, threads)


def _linears(network: Any) -> list[Any]:
    """The linears the plan calls: the LM head, then each layer's qkv, o_proj and feed-forward linears."""
    return [network.head] + [m for layer in network.layers for m in (
        layer.attn.qkv, layer.attn.o_proj, *_mlp_linears(layer.mlp))]


def _gated_mlps(mlp: Any) -> list[Any]:
    """The gated MLPs of a layer's feed-forward block: itself, or an MoE block's experts and shared expert."""
    if not isinstance(mlp, SparseMoE):
        return [mlp]
    return [*mlp.experts, *([] if mlp.shared_expert is None else [mlp.shared_expert])]


MAX_ROWS = 256
"""The plan takes decode batches up to this size (the packed float32 GEMM and the int8-activation
kernels take any row count; the module path would add ~15 ms a step and gather the KV for SDPA)."""


MAX_QUERY_LEN = 17
"""Longest query per sequence the plan takes: a decode token plus up to 16 drafts."""


def _per_token(inputs: ModelInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(block tables, seq_lens) with one entry per token: its sequence's table, position + 1."""
    m = inputs.meta
    if m.max_query_len == 1:
        return m.block_tables, m.seq_lens
    q_lens = m.query_start_loc[1:] - m.query_start_loc[:-1]
    tables = torch.repeat_interleave(m.block_tables, q_lens.long(), dim=0).contiguous()
    return tables, (inputs.positions + 1).to(torch.int32)


def _failed(kind: str) -> None:
    raise MemoryError(f"CPU decode plan: the quantised {kind} GEMV could not allocate its int8 activation rows")


class _MoECalls:
    """One MoE layer of a step of t tokens on the plan's buffers (module docstring): router GEMV ("h" → "logits")
    → route → gather ("h" → "moe_x", expert order) → per chosen expert gate_up, SiLU·mul, down on its run of
    rows ("moe_x" → "moe_y") → [shared expert, "h" → "shared_y"; its gate → "shared_gate"] → combine → "x"."""

    def __init__(self, moe: SparseMoE, t: int, p: dict[str, int], gemv: Callable[..., tuple], libs: tuple[Any, Any],
                 counts: torch.Tensor, gathered: int | None):
        fused, linear = libs
        hidden, k, experts = moe.router.in_features, moe.top_k, len(moe.experts)
        self.counts, self.silu = counts, fused.trtforge_silu_mul
        self.router = gemv("h", moe.router, "logits")
        self.route = (fused.trtforge_moe_route, p["logits"], t, experts, k, int(moe.normalize), p["moe_w"],
                      p["moe_ids"], counts.data_ptr(), p["moe_pos"], p["moe_tok"])
        self.gather = (fused.trtforge_gather_rows, p["h"], p["moe_tok"], t * k, hidden, p["moe_x"])
        self.experts = [(_rows_gemv(e.gate_up, linear.trtforge_packed_linear, gathered), e.gate_up.out_features // 2,
                         _rows_gemv(e.down, linear.trtforge_packed_linear, gathered)) for e in moe.experts]
        self.rows = (p["moe_x"], p["moe_gate_up"], p["moe_act"], p["moe_y"], 4 * hidden)
        self.shared: tuple = ()
        if moe.shared_expert is not None:
            se = moe.shared_expert
            self.shared = (gemv("h", se.gate_up, "gate_up"), gemv("act", se.down, "shared_y"),
                           gemv("h", moe.shared_expert_gate, "shared_gate"))
            self.shared_silu = (p["gate_up"], p["act"], t, se.gate_up.out_features // 2)
        self.combine = (fused.trtforge_moe_combine, p["moe_y"], p["moe_pos"], p["moe_w"], t, k, hidden,
                        p["shared_y"] if self.shared else None, p["shared_gate"] if self.shared else None, p["x"])

    def run(self, threads: int) -> None:
        if self.router[0](*self.router[1:], threads):
            _failed("router")
        self.route[0](*self.route[1:])
        self.gather[0](*self.gather[1:])
        xs, gate_up, act, ys, row = self.rows
        start = 0  # first row of the expert's run
        for (gate_up_gemv, width, down_gemv), n in zip(self.experts, self.counts.tolist()):
            if n:  # an expert no token chose is not called
                g, a = gate_up + 8 * width * start, act + 4 * width * start
                if gate_up_gemv(xs + row * start, n, g, threads):
                    _failed("expert gate_up")
                self.silu(g, a, n, width)
                if down_gemv(a, n, ys + row * start, threads):
                    _failed("expert down")
                start += n
        if self.shared:
            gate_up_call, down_call, gate_call = self.shared
            for call, silu_after in ((gate_up_call, True), (down_call, False), (gate_call, False)):
                if call[0](*call[1:], threads):
                    _failed("shared expert")
                if silu_after:
                    self.silu(*self.shared_silu)
        self.combine[0](*self.combine[1:])


class CpuDecodePlan:
    """Pure-decode steps of up to `max_rows` tokens of a float32 Llama-style network on CPU."""

    def __init__(self, network: Any, kv_caches: list[torch.Tensor], libs: tuple[Any, Any, Any],
                 kv_scales: list[torch.Tensor] | None = None):
        self.network, self.kv_caches, self.kv_scales = network, kv_caches, kv_scales
        self.fused, self.linear, self.attention = libs
        self.cfg = network.cfg
        self._prepared: dict[int, tuple[dict[str, torch.Tensor], list[tuple], tuple]] = {}
        self._buffers: dict[str, torch.Tensor] = {}  # [rows, width] each; a step of t tokens uses rows :t
        float_gemv = any(isinstance(m, QuantLinear) and not m.a8 for m in _linears(network))
        self.max_rows = GEMV_MAX_ROWS if float_gemv else MAX_ROWS
        """Most tokens a step may have: MAX_ROWS, or the float-activation quantized GEMVs' limit
        where a layer runs one."""
        self._gather_width = max((m.in_features for m in _linears(network)
                                  if isinstance(m, QuantLinear) and m.perm is not None), default=0)
        """Widest input an act-order layer gathers (its scratch buffer "gathered"; 0: none has a permutation)."""
        moes = [layer.mlp for layer in network.layers if isinstance(layer.mlp, SparseMoE)]
        self._moe = None if not moes else (moes[0].top_k, len(moes[0].experts),
                                           max(e.gate_up.out_features // 2 for m in moes for e in m.experts))
        """(top-k, experts, widest expert) of the MoE layers; None: a dense model."""
        self._counts = torch.zeros(len(moes[0].experts) if moes else 0, dtype=torch.int64)
        """An MoE layer's pairs per expert (trtforge_moe_route writes them; the step's one host read per layer)."""

    @classmethod
    def build(cls, network: Any, kv_caches: list[torch.Tensor],
              kv_scales: list[torch.Tensor] | None = None) -> "CpuDecodePlan | None":
        """A plan for `network`, or None where it does not qualify (then the network runs every step).
        kv_scales: int8 KV pools' scales (the attention calls cpu_decode.c's int8 kernel)."""
        c = getattr(network, "cfg", None)
        pool_dtype = torch.float32 if kv_scales is None else torch.int8
        if c is None or not hasattr(network, "layers") or kv_caches[0].dtype != pool_dtype \
                or kv_caches[0].device.type != "cpu":
            return None
        if getattr(network, "shard", None) is not None:  # a tensor-parallel rank: no place for the all-reduce
            return None
        llama_style = (c.norm == "rms" and c.gated_mlp and c.activation == "silu" and c.position == "rope"
                       and c.switches_beyond_llama() in ([], ["num_experts"]))  # MoE blocks and q/k norms: here too
        linears = _linears(network) if llama_style else []
        if not llama_style or not all(_plan_linear(m, head=i == 0) for i, m in enumerate(linears)):
            return None
        widths = [m.gate_up.out_features // 2 for layer in network.layers for m in _gated_mlps(layer.mlp)]
        if c.hidden_size % 8 or c.head_dim % 8 or any(w % 8 for w in widths):
            return None
        libs = (cpu_fused.library(), cpu_linear.library(), cpu_native.library())
        quantized = any(isinstance(m, QuantLinear) for m in linears)
        if quantized and cpu_quant.library() is None:
            return None
        return cls(network, kv_caches, libs, kv_scales) if all(lib is not None for lib in libs) else None

    def can_run(self, inputs: ModelInputs) -> bool:
        """Pure decode (every token has a logits row, in order: one per sequence, or a speculative
        verification's few) of at most `max_rows` tokens whose contexts the C attention takes.
        (`run` is always inference: no autograd.)"""
        t, m = inputs.num_tokens, inputs.meta
        return (t <= self.max_rows and inputs.logits_indices.shape[0] == t
                and m.max_query_len <= MAX_QUERY_LEN and m.max_seq_len * t <= cpu_native.MAX_CONTEXT_TOKENS
                and m.slot_mapping.dtype == torch.int64 and m.block_tables.dtype == torch.int32
                and m.seq_lens.dtype == torch.int32 and m.block_tables.is_contiguous()
                and torch.equal(inputs.logits_indices, torch.arange(t)))

    # ---- buffers and argument tuples, once per batch size ------------------------------------
    def _prepare(self, t: int) -> tuple[dict[str, torch.Tensor], list[tuple], tuple]:
        """(buffers, per-layer call tuples, final-norm call) for t tokens."""
        if t in self._prepared:
            return self._prepared[t]
        c, net = self.cfg, self.network
        qkv_width = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        dense = max([m.gate_up.out_features // 2 for layer in net.layers for m in _gated_mlps(layer.mlp)
                     if not isinstance(layer.mlp, SparseMoE) or m is layer.mlp.shared_expert], default=8)
        shapes = {"x": c.hidden_size, "residual": c.hidden_size, "h": c.hidden_size, "o": c.hidden_size,
                  "qkv": qkv_width, "attn": c.num_heads * c.head_dim, "gate_up": 2 * dense, "act": dense}
        if self._gather_width:
            shapes["gathered"] = self._gather_width
        if self._moe is not None:  # an MoE layer's (token, slot) pairs: k rows per token
            k, experts, width = self._moe
            shapes.update({"logits": experts, "moe_w": k, "moe_x": k * c.hidden_size, "moe_gate_up": k * 2 * width,
                           "moe_act": k * width, "moe_y": k * c.hidden_size, "shared_y": c.hidden_size,
                           "shared_gate": 1, "moe_ids": (k, torch.int64), "moe_pos": (k, torch.int64),
                           "moe_tok": (k, torch.int64)})
        if not self._buffers or self._buffers["x"].shape[0] < t:  # grow: every prepared pointer is stale
            rows = min(self.max_rows, -(-t // 16) * 16)
            specs = {name: w if isinstance(w, tuple) else (w, torch.float32) for name, w in shapes.items()}
            self._buffers = {name: torch.empty(rows, w, dtype=dtype) for name, (w, dtype) in specs.items()}
            self._prepared.clear()
        buf = {name: b[:t] for name, b in self._buffers.items()}  # leading rows: contiguous
        p = {name: b.data_ptr() for name, b in buf.items()}
        eps = ctypes.c_float(c.norm_eps)

        def gemv(x: str, lin: CpuLinear | TiedLMHead | QuantLinear, y: str) -> tuple:
            if isinstance(lin, QuantLinear):
                return _with_extras(lin, p[x], t, p[y], p.get("gathered"))
            return (self.linear.trtforge_packed_linear, p[x], t, lin.packed.data_ptr(),
                    _ptr(getattr(lin, "bias", None)), p[y], lin.out_features, lin.in_features)

        row = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        calls = []  # per layer: (norm_in, qkv, q/k norms, o, norm_post, mlp: (gate_up, silu, down) or MoE calls)
        for i, layer in enumerate(net.layers):
            first = i == 0
            qk_norms = () if not c.qk_norm else (  # Qwen3: per head, in place, before RoPE
                (self.fused.trtforge_head_rms_norm, p["qkv"], layer.attn.q_norm.weight.data_ptr(), t, c.num_heads,
                 row, c.head_dim, eps),
                (self.fused.trtforge_head_rms_norm, p["qkv"] + 4 * c.num_heads * c.head_dim,
                 layer.attn.k_norm.weight.data_ptr(), t, c.num_kv_heads, row, c.head_dim, eps))
            if isinstance(layer.mlp, SparseMoE):
                mlp: Any = _MoECalls(layer.mlp, t, p, gemv, (self.fused, self.linear), self._counts,
                                     p.get("gathered"))
            else:
                mlp = (gemv("h", layer.mlp.gate_up, "gate_up"),
                       (self.fused.trtforge_silu_mul, p["gate_up"], p["act"], t, layer.mlp.gate_up.out_features // 2),
                       gemv("act", layer.mlp.down, "x"))
            calls.append((
                # layer 0: residual = embeddings (in "residual"), normalised as is; later layers add x first
                (self.fused.trtforge_rms_norm, p["residual"] if first else p["x"], None if first else p["residual"],
                 layer.input_norm.weight.data_ptr(), p["h"], t, c.hidden_size, eps),
                gemv("h", layer.attn.qkv, "qkv"),
                qk_norms,
                gemv("attn", layer.attn.o_proj, "o"),
                (self.fused.trtforge_rms_norm, p["o"], p["residual"], layer.post_attn_norm.weight.data_ptr(),
                 p["h"], t, c.hidden_size, eps),
                mlp,
            ))
        final = (self.fused.trtforge_rms_norm, p["x"], p["residual"], net.final_norm.weight.data_ptr(), p["h"], t,
                 c.hidden_size, eps)
        self._prepared[t] = buf, calls, final
        return self._prepared[t]

    # ---- one step ----------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, inputs: ModelInputs) -> torch.Tensor:
        c, net, m = self.cfg, self.network, inputs.meta
        t = inputs.num_tokens
        buf, calls, final = self._prepare(t)
        if isinstance(net.embed_tokens, torch.nn.Embedding):
            torch.index_select(net.embed_tokens.weight, 0, inputs.input_ids, out=buf["residual"])
        else:  # QuantEmbedding: rows of the int8 tied head
            net.embed_tokens(inputs.input_ids, out=buf["residual"])
        cos, sin = rotary_cos_sin(inputs.positions, net.rope_inv_freq, c.rope_attention_scaling, torch.float32)
        threads = torch.get_num_threads()
        hq, hkv, d = c.num_heads, c.num_kv_heads, c.head_dim
        qkv, row = buf["qkv"].data_ptr(), (hq + 2 * hkv) * d
        rope = (qkv, cos.data_ptr(), sin.data_ptr(), t, hq + hkv, row, d)
        _, num_blocks, block_size, _, _ = self.kv_caches[0].shape
        tables, seq_lens = _per_token(inputs)  # alive until the layers are done
        attention = (m.slot_mapping.data_ptr(), tables.data_ptr(), tables.shape[1],
                     seq_lens.data_ptr(), buf["attn"].data_ptr(), t, hq, hkv, d, d ** -0.5, 0.0)
        k, v = qkv + 4 * hq * d, qkv + 4 * (hq + hkv) * d  # byte offsets of the k and v heads
        rope_fn = self.fused.trtforge_rope
        if self.kv_scales is None:
            attention_fn, pools = self.attention.trtforge_decode_attention, [(p.data_ptr(),) for p in self.kv_caches]
        else:  # int8 KV: pool and scales
            attention_fn = self.attention.trtforge_decode_attention_int8
            pools = [(p.data_ptr(), s.data_ptr()) for p, s in zip(self.kv_caches, self.kv_scales)]
        windows = [getattr(layer.attn, "window", 0) for layer in net.layers]  # sliding window per layer (0: full)
        for (norm_in, qkv_call, qk_norms, o_call, norm_post, mlp), pool, window in zip(calls, pools, windows):
            norm_in[0](*norm_in[1:])
            if qkv_call[0](*qkv_call[1:], threads):
                _failed("qkv")
            for norm in qk_norms:
                norm[0](*norm[1:])
            rope_fn(*rope)
            if attention_fn(qkv, row, k, row, v, row, *pool, num_blocks, block_size, *attention, window, threads):
                raise ValueError(f"decode attention: a block id, slot or sequence length is out of range "
                                 f"(seq_lens={seq_lens.tolist()}, slot_mapping={m.slot_mapping.tolist()})")
            if o_call[0](*o_call[1:], threads):
                _failed("o_proj")
            norm_post[0](*norm_post[1:])
            if type(mlp) is not tuple:  # an MoE layer
                mlp.run(threads)
                continue
            gate_up, silu, down = mlp
            if gate_up[0](*gate_up[1:], threads):
                _failed("gate_up")
            silu[0](*silu[1:])
            if down[0](*down[1:], threads):
                _failed("down")
        final[0](*final[1:])
        return self._logits(buf["h"].data_ptr(), t, threads)

    def _logits(self, hidden: int, t: int, threads: int) -> torch.Tensor:
        """The LM head over the final hidden states at address `hidden` ([t, hidden_size] float32)."""
        head = self.network.head
        logits = torch.empty(t, head.out_features)
        if isinstance(head, QuantLinear):
            call = _quant_gemv(head, hidden, t, logits.data_ptr())
            if call[0](*call[1:], threads):
                _failed("LM head")
        else:
            self.linear.trtforge_packed_linear(hidden, t, head.packed.data_ptr(), None, logits.data_ptr(),
                                               head.out_features, head.in_features, threads)
        return logits
