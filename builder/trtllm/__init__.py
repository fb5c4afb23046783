"""`build-engine --backend trtllm`: build with NVIDIA TensorRT-LLM (docs/tensorrt-llm.md)."""
