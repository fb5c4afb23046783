"""Whether TensorRT can run here: one check for the build (`--backend tensorrt`) and the runtime
(a TensorRT engine loaded by the executor), each of which words its own error around the answer."""

from __future__ import annotations

from typing import Any

MIN_TENSORRT = (10, 6)
"""Python plugins (`tensorrt.plugin`, which runs the PagedAttention plugin) arrived in 10.6."""


def find_tensorrt() -> tuple[Any, str | None]:
    """(the `tensorrt` module, None), or (None, what is missing: TensorRT, its version, a GPU)."""
    try:
        import tensorrt as trt
    except ImportError:
        return None, f"TensorRT >= {'.'.join(map(str, MIN_TENSORRT))} is not installed"
    if not hasattr(trt, "__version__"):  # e.g. a stray directory named tensorrt on sys.path
        return None, (f"the `tensorrt` found at {list(getattr(trt, '__path__', []))} is not NVIDIA "
                      "TensorRT")
    if tuple(int(x) for x in trt.__version__.split(".")[:2]) < MIN_TENSORRT:
        return None, (f"TensorRT {trt.__version__} is too old for the PagedAttention plugin (Python "
                      f"plugins need >= {'.'.join(map(str, MIN_TENSORRT))})")
    import torch

    if not torch.cuda.is_available():
        return None, f"TensorRT runs on an NVIDIA GPU, and torch sees no CUDA device (torch {torch.__version__})"
    return trt, None
