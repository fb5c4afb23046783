"""Run a `--backend tensorrt` engine: the TensorRT plan in place of the torch network.

`TensorRTNetwork` is called exactly like `CausalLM` —
`net(input_ids, positions, kv_caches, meta, logits_indices) -> float32 logits [S', V]` — so the
runtime's schedule → execute → update loop plugs it in unchanged. The KV pools stay the
runtime's torch CUDA tensors: each layer's pool is bound both as the graph input `kv_cache_{i}`
and as the output `kv_cache_out_{i}` (the plugin aliases them and updates the pool in place).

The plan has two optimization profiles (builder/tensorrt/build.py): 0 for decode steps (at most
max_batch_size tokens), 1 for prefill/mixed steps (up to max_num_tokens). One execution context
per profile, each bound to its profile once, so a step never switches profiles. The step's inputs,
its profile and its rows come from trt_step.py, which the ONNX Runtime sibling (trt_ort.py) shares.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from trtforge.builder.tensorrt.availability import find_tensorrt
from trtforge.plugins.paged_attention.metadata import AttentionMetadata
from trtforge.serving.worker.trt_step import outside_profile, plan_step

INSTALL_HINT = ("install it with `pip install trtforge[tensorrt]` on a machine with an NVIDIA GPU, or run the "
                "NGC image (docs/tensorrt.md); or rebuild the engine with `build-engine --backend torch`")


class TensorRTUnavailable(RuntimeError):
    """The engine is a TensorRT plan but this machine cannot run one (no TensorRT or no GPU)."""


def _require_runtime() -> Any:
    trt, problem = find_tensorrt()
    if problem is not None:
        raise TensorRTUnavailable(f"this engine was built with --backend tensorrt and cannot run here: "
                                  f"{problem}: {INSTALL_HINT}.")
    return trt


class TensorRTNetwork:
    """A deserialized `rank0.engine` with the call signature of `CausalLM.forward`."""

    def __init__(self, engine_dir: str | Path, engine_config: Any):
        trt = _require_runtime()
        import trtforge.plugins.paged_attention.tensorrt_plugin  # noqa: F401  (plugin must be registered)

        self.cfg = engine_config.model
        self.engine_config = engine_config
        build = engine_config.build
        self.decode_max_tokens = int(build["max_batch_size"])
        self.max_num_tokens = int(build["max_num_tokens"])
        plan = (Path(engine_dir) / "rank0.engine").read_bytes()
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        self.engine = self._runtime.deserialize_cuda_engine(plan)
        if self.engine is None:
            raise TensorRTUnavailable(f"TensorRT {trt.__version__} could not load {engine_dir}/rank0.engine "
                                      "(see its log above); rebuild it with this TensorRT version.")
        if self.engine.num_optimization_profiles != 2:
            raise TensorRTUnavailable(f"{engine_dir}/rank0.engine has {self.engine.num_optimization_profiles} "
                                      "optimization profiles, trtforge builds 2; rebuild the engine.")
        stream = torch.cuda.current_stream().cuda_stream
        self.contexts = []
        for profile in range(2):
            ctx = self.engine.create_execution_context()
            ctx.set_optimization_profile_async(profile, stream)
            self.contexts.append(ctx)
        torch.cuda.current_stream().synchronize()

    @classmethod
    def from_engine_dir(cls, engine_dir: str | Path) -> "TensorRTNetwork":
        """Check TensorRT/GPU first (clear error), then engine.json, then load the plan."""
        _require_runtime()
        from trtforge.models.engine_dir import read_engine_config

        return cls(engine_dir, read_engine_config(engine_dir))

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 kv_caches: list[torch.Tensor], meta: AttentionMetadata,
                 logits_indices: torch.Tensor) -> torch.Tensor:
        """One step on the GPU; updates kv_caches in place; returns float32 logits [S', V]
        (S' may be 0: a step whose prefill chunks all stop short of their prompt's end)."""
        device = kv_caches[0].device
        step = plan_step(input_ids, positions, meta, logits_indices, device,
                         self.decode_max_tokens, self.max_num_tokens)
        feeds = dict(step.feeds)  # alive until the step has run: TensorRT holds raw pointers
        ctx = self.contexts[step.profile]
        for i, pool in enumerate(kv_caches):
            feeds[f"kv_cache_{i}"] = pool
        for name, t in feeds.items():
            if not ctx.set_input_shape(name, tuple(t.shape)):
                raise outside_profile(name, tuple(t.shape))
            ctx.set_tensor_address(name, t.data_ptr())
        for i, pool in enumerate(kv_caches):
            ctx.set_tensor_address(f"kv_cache_out_{i}", pool.data_ptr())  # aliased: updated in place
        logits = torch.empty((feeds["logits_indices"].shape[0], self.cfg.vocab_size),
                             dtype=torch.float32, device=device)
        ctx.set_tensor_address("logits", logits.data_ptr())
        if not ctx.execute_async_v3(torch.cuda.current_stream(device).cuda_stream):
            raise RuntimeError("TensorRT failed to run the step (see its log above)")
        return logits[:step.rows]
