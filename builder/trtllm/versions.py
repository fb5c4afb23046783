"""The TensorRT-LLM release trtforge's `trtllm` backend targets, and the engine version check.

A TensorRT-LLM engine only loads in the TensorRT-LLM (and TensorRT) that built it, and the
Triton repository trtforge writes for it follows the templates of one release of the
tensorrtllm backend. Both are pinned here, once: the build's error message names the image, the
emitter records the release, and `trtforge serve` refuses an engine of another version.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TrtllmTarget:
    """One TensorRT-LLM release and the NGC image that ships it with Triton."""

    tensorrt_llm: str
    """TensorRT-LLM version (what `tensorrt_llm.__version__` says)."""
    image: str
    """NGC image with tritonserver, the `tensorrtllm` backend and this TensorRT-LLM."""
    backend_release: str
    """Release tag of triton-inference-server/tensorrtllm_backend whose model templates (the
    `inflight_batcher_llm` configs) the emitted repository follows."""
    backend_commit: str
    """The commit that tag names (the templates were read there)."""
    backend_source: str = "https://github.com/triton-inference-server/tensorrtllm_backend"


# NVIDIA's Triton/TensorRT-LLM compatibility notes list 25.05-trtllm-python-py3 with TensorRT-LLM
# 0.19.0; tensorrtllm_backend v0.19.0 is the last release that keeps all_models/ in its own tree.
TARGET = TrtllmTarget(tensorrt_llm="0.19.0",
                      image="nvcr.io/nvidia/tritonserver:25.05-trtllm-python-py3",
                      backend_release="v0.19.0",
                      backend_commit="c1e19638304d287f554f738c1411746555ed348c")


def version_mismatch(built: str | None, installed: str | None, engine: str = "this engine") -> str | None:
    """None when an engine built by TensorRT-LLM `built` loads under `installed`; else a message
    naming both. Engines are not portable across TensorRT-LLM versions, so any difference counts
    (patch releases and local suffixes included)."""
    if not built:
        return (f"{engine} records no TensorRT-LLM version (not built with `build-engine --backend "
                f"trtllm`?); rebuild it inside {TARGET.image}")
    if installed is None:
        return (f"{engine} was built with TensorRT-LLM {built}, and TensorRT-LLM is not installed "
                f"here; serve it inside {TARGET.image} (or the image with TensorRT-LLM {built})")
    if built.strip() != installed.strip():
        return (f"{engine} was built with TensorRT-LLM {built}, but TensorRT-LLM {installed} is "
                f"installed here; engines only load in the TensorRT-LLM version that built them: "
                f"rebuild it here (build-engine --backend trtllm --force) or serve it in the image "
                f"with TensorRT-LLM {built}")
    return None
