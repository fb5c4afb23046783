"""Speculative decoding at the Triton edge of the engine model: the `speculative` input (a
request's opt-out) and the per-request outputs of its last response (interface.py).

The output names are TensorRT-LLM's (its tensorrtllm backend's `total_draft_tokens`,
`total_accepted_draft_tokens`, `acceptance_rate`; its LLM API's and trtllm-serve's
`avg_decoded_tokens_per_iter`), so clients written for it read them unchanged. Plain numpy (no
pb_utils), so it is testable without Triton.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from trtforge.model_repo.request import GenerationRequest

SPECULATIVE = "speculative"
"""The input: BOOL, default true; false opts the request out of speculative decoding."""
SPECULATION_OUTPUTS = ("total_draft_tokens", "total_accepted_draft_tokens", "acceptance_rate",
                       "avg_decoded_tokens_per_iter")
"""The outputs of a speculating engine's last response of each request."""


def with_speculative_input(parsed: GenerationRequest, arrays: dict[str, np.ndarray]) -> GenerationRequest:
    """The `speculative` input (BOOL, default true) into the request's SamplingParams: false opts
    it out of the engine's speculative decoding."""
    value = arrays.get(SPECULATIVE)
    if value is None:
        return parsed
    if np.asarray(value).size != 1:
        raise ValueError(f"input 'speculative' has shape {list(np.asarray(value).shape)}; send one BOOL per "
                         "request (shape [1], or [1, 1] with the batch dimension).")
    parsed.params = dataclasses.replace(parsed.params, speculative=bool(np.asarray(value).reshape(-1)[0]))
    return parsed


def speculation_arrays(draft_tokens: int, accepted_tokens: int, generated: int, steps: int) -> dict[str, np.ndarray]:
    """TensorRT-LLM's per-request speculative decoding outputs (with the batch dimension), and
    avg_decoded_tokens_per_iter: `generated` tokens over the `steps` that produced them."""
    rate = accepted_tokens / draft_tokens if draft_tokens else 0.0
    per_step = generated / steps if steps else 0.0
    return {"total_draft_tokens": np.array([[draft_tokens]], dtype=np.int32),
            "total_accepted_draft_tokens": np.array([[accepted_tokens]], dtype=np.int32),
            "acceptance_rate": np.array([[rate]], dtype=np.float32),
            "avg_decoded_tokens_per_iter": np.array([[per_step]], dtype=np.float32)}
