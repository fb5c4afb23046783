"""Triton repositories for `--backend trtllm` engines: TensorRT-LLM's `inflight_batcher_llm`
models for Triton's `tensorrtllm` backend (docs/tensorrt-llm.md)."""
