"""Triton repositories for TensorRT-LLM: its `inflight_batcher_llm` models for Triton's
`tensorrtllm` backend (a `--backend trtllm` engine), or its LLM-API python model for a Hugging Face
checkpoint, each following the recorded interface of one release (docs/tensorrt-llm.md)."""
