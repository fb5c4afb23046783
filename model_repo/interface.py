"""The tensors of the `ensemble` interface (TensorRT-LLM's inflight_batcher_llm) and of the engine model behind it.

Kept free of protobuf/tritonclient imports: the engine model (model.py) reads it inside the
python-backend stub, where only the runtime's own dependencies are guaranteed.
"""

from __future__ import annotations

from dataclasses import dataclass

ENSEMBLE = "ensemble"
"""Name of the model clients call (as in TensorRT-LLM's inflight_batcher_llm repository); in a
trtforge repository it is the decoupled python model running the engine (see emit.py)."""


@dataclass(frozen=True)
class TensorSpec:
    """One input or output tensor of the `ensemble` interface."""

    name: str
    """Tensor name, as TensorRT-LLM's inflight_batcher_llm ensemble spells it."""
    dtype: str
    """model_config_pb2.DataType name, e.g. TYPE_STRING."""
    dims: tuple[int, ...]
    """Shape without the batch dimension (-1 = variable)."""
    optional: bool = True
    """Whether a request may leave it out."""


def _opt(name: str, dtype: str, dims: tuple[int, ...] = (1,)) -> TensorSpec:
    return TensorSpec(name, dtype, dims, optional=True)


INPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("text_input", "TYPE_STRING", (1,), optional=False),
    TensorSpec("max_tokens", "TYPE_INT32", (1,), optional=False),
    _opt("bad_words", "TYPE_STRING", (-1,)),
    _opt("stop_words", "TYPE_STRING", (-1,)),
    _opt("exclude_input_in_output", "TYPE_BOOL"),
    _opt("end_id", "TYPE_INT32"),
    _opt("pad_id", "TYPE_INT32"),
    _opt("top_k", "TYPE_INT32"),
    _opt("top_p", "TYPE_FP32"),
    _opt("temperature", "TYPE_FP32"),
    _opt("seed", "TYPE_UINT64"),
    _opt("repetition_penalty", "TYPE_FP32"),
    _opt("presence_penalty", "TYPE_FP32"),
    _opt("frequency_penalty", "TYPE_FP32"),
    _opt("min_tokens", "TYPE_INT32"),
    _opt("beam_width", "TYPE_INT32"),
    _opt("num_return_sequences", "TYPE_INT32"),
    _opt("length_penalty", "TYPE_FP32"),
    _opt("return_log_probs", "TYPE_BOOL"),
    _opt("num_top_logprobs", "TYPE_INT32"),
    _opt("return_context_logits", "TYPE_BOOL"),
    _opt("return_generation_logits", "TYPE_BOOL"),
    _opt("stream", "TYPE_BOOL"),
    _opt("timeout_s", "TYPE_FP32"),
    _opt("cache_salt", "TYPE_STRING"),
    _opt("guided_decoding_guide_type", "TYPE_STRING"),
    _opt("guided_decoding_guide", "TYPE_STRING"),
    _opt("prompt_logprobs", "TYPE_INT32"),
    _opt("skip_special_tokens", "TYPE_BOOL"),
    _opt("speculative", "TYPE_BOOL"),
)
"""TensorRT-LLM's inputs, then trtforge's (model_repo/request.py says what each does; `speculative`,
model_repo/speculation.py: BOOL, default true; false opts the request out of the engine's
speculative decoding, SamplingParams.speculative: it decodes one token per step while others
speculate)."""

OUTPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("text_output", "TYPE_STRING", (-1,)),
    TensorSpec("cum_log_probs", "TYPE_FP32", (-1,)),
    TensorSpec("output_log_probs", "TYPE_FP32", (-1, -1)),
    TensorSpec("num_input_tokens", "TYPE_INT32", (1,)),
    TensorSpec("num_output_tokens", "TYPE_INT32", (1,)),
    TensorSpec("top_logprobs_ids", "TYPE_INT32", (-1, -1)),
    TensorSpec("top_logprobs", "TYPE_FP32", (-1, -1)),
    TensorSpec("finish_reason", "TYPE_STRING", (-1,)),
    TensorSpec("stop_reason", "TYPE_STRING", (-1,)),
    TensorSpec("stop_token_id", "TYPE_INT32", (1,)),
    TensorSpec("num_cached_tokens", "TYPE_INT32", (1,)),
    TensorSpec("prompt_log_probs", "TYPE_FP32", (-1,)),
    TensorSpec("prompt_logprob_ranks", "TYPE_INT32", (-1,)),
    TensorSpec("prompt_top_logprobs_ids", "TYPE_INT32", (-1, -1)),
    TensorSpec("prompt_top_logprobs", "TYPE_FP32", (-1, -1)),
    TensorSpec("acceptance_rate", "TYPE_FP32", (1,)),
    TensorSpec("total_accepted_draft_tokens", "TYPE_INT32", (1,)),
    TensorSpec("total_draft_tokens", "TYPE_INT32", (1,)),
    TensorSpec("avg_decoded_tokens_per_iter", "TYPE_FP32", (1,)),
)
"""TensorRT-LLM's outputs, then trtforge's (docs/serving.md, Inputs and outputs):

* `top_logprobs_ids` / `top_logprobs` ([n, K] per response, with the batch dimension [1, n, K]):
  for each of the n tokens the response covers, the K most likely tokens (`num_top_logprobs`)
  and their log-probabilities, most likely first, from the raw model distribution (log_softmax
  of the logits before penalties, temperature and filtering: vLLM's "raw_logprobs").
* On the last response of a request: `finish_reason` (stop | length; TensorRT-LLM 1.x LLM-API's
  name), `stop_reason` (the stop string that ended it) or `stop_token_id` (the stop token: EOS,
  `end_id`), and `num_cached_tokens` (prompt tokens served from the prefix cache).
* On the last response of a request to an engine that speculates (docs/speculative-decoding.md),
  TensorRT-LLM's per-request speculative decoding outputs: `total_draft_tokens` (drafts verified),
  `total_accepted_draft_tokens` (of those, accepted), `acceptance_rate` (accepted / drafts, 0 without
  drafts), and `avg_decoded_tokens_per_iter` (tokens generated per engine step that generated any
  for it: 1 + the accepted drafts per step; TensorRT-LLM's LLM-API and trtllm-serve name).
"""


PHASE_INPUTS: tuple[TensorSpec, ...] = (
    _opt("request_type", "TYPE_STRING"),
    _opt("context_phase_params", "TYPE_STRING"),
)
"""Inputs of the `context` and `generation` models of a disaggregated repository (TensorRT-LLM's
names): request_type context_only | generation_only; context_phase_params, the handover the
context model answered with."""

PHASE_OUTPUTS: tuple[TensorSpec, ...] = (TensorSpec("context_phase_params", "TYPE_STRING", (-1,)),)
"""Output of the `context` model: the KV handle (JSON) to pass to the generation model."""
