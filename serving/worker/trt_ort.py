"""The TensorRT plan's sibling on CPU: the same exported `rank0.onnx`, run by ONNX Runtime.

`OnnxRuntimePlan` has the call signature of `TensorRTNetwork` (trt_executor.py) and prepares each
step with the same code (trt_step.py: profile choice, integer dtypes, the row asked for when a
step samples none). It also refuses every input shape TensorRT's optimisation profiles refuse
(builder/tensorrt/build.py `profile_shapes`), as IExecutionContext.set_input_shape does. What it
cannot be is TensorRT: the attention node runs as the onnxruntime-extensions Python op on the
plain-PyTorch reference (plugins/paged_attention/onnx_ort.py), float32 only, and the pools are
copied back from `kv_cache_out_{i}` instead of being updated in place through aliasing.

It is how CPU tests run the engine loop over the real export with the plan's step logic; it is
slow (tiny models only) and not an executor to serve with.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from trtforge.builder.tensorrt.build import profile_shapes
from trtforge.plugins.paged_attention.metadata import AttentionMetadata
from trtforge.serving.worker.trt_step import check_in_profile, plan_step


class OnnxRuntimePlan:
    """`rank0.onnx` under ONNX Runtime with the TensorRT plan's profiles (see module doc)."""

    def __init__(self, onnx_path: str | Path, engine_config: Any):
        from trtforge.plugins.paged_attention.onnx_ort import make_session

        self.cfg = engine_config.model
        build = engine_config.build
        self.decode_max_tokens = int(build["max_batch_size"])
        self.max_num_tokens = int(build["max_num_tokens"])
        self.profiles = profile_shapes(engine_config)
        self.session = make_session(onnx_path)
        self._outputs = ["logits", *(f"kv_cache_out_{i}" for i in range(self.cfg.num_layers))]
        self.steps_run = 0
        """Steps executed, zero-row steps included (tests count them)."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 kv_caches: list[torch.Tensor], meta: AttentionMetadata,
                 logits_indices: torch.Tensor) -> torch.Tensor:
        """One step; writes the new KV into kv_caches; float32 logits [S', V] (S' may be 0)."""
        step = plan_step(input_ids, positions, meta, logits_indices, torch.device("cpu"),
                         self.decode_max_tokens, self.max_num_tokens)
        profile = self.profiles[step.profile]
        feed: dict[str, np.ndarray] = {}
        for name, t in step.feeds.items():
            check_in_profile(profile, name, tuple(t.shape))
            feed[name] = t.numpy()
        for i, pool in enumerate(kv_caches):
            check_in_profile(profile, f"kv_cache_{i}", tuple(pool.shape))
            feed[f"kv_cache_{i}"] = pool.detach().cpu().numpy()
        logits, *pools = self.session.run(self._outputs, feed)
        for pool, new in zip(kv_caches, pools):
            pool.copy_(torch.from_numpy(new))
        self.steps_run += 1
        return torch.from_numpy(logits)[:step.rows]
