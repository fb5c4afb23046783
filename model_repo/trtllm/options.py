"""Which TensorRT-LLM repository is written, and for which release (TrtllmOptions).

Apart from values.py (which re-exports it) so that the CLI reads its field docs as help text
without importing the emitter (tritonclient, numpy): `trtforge --help` stays light."""

from __future__ import annotations

import os
from dataclasses import dataclass

REPO_KINDS = ("inflight_batcher_llm", "llmapi")


@dataclass(frozen=True)
class TrtllmOptions:
    """Which TensorRT-LLM repository is written, for which release, from which image files."""

    models_dir: str | os.PathLike | None = None
    """The image's all_models/inflight_batcher_llm (python model files, templates to compare)."""
    repo: str = "inflight_batcher_llm"
    """inflight_batcher_llm (the C++ tensorrtllm backend serving a --backend trtllm engine) | llmapi
    (TensorRT-LLM's LLM-API python model, which loads a Hugging Face checkpoint or hub id with its
    PyTorch backend when Triton starts: nothing is built)."""
    version: str | None = None
    """The recorded TensorRT-LLM release to write for, e.g. 0.19.0 or 1.2.0rc8 (default: the installed
    TensorRT-LLM's, else the engine's, else 0.19.0)."""
    allow_drift: bool | None = None
    """Go on past drift (a version without a record, an engine of another version, templates that
    differ from the record), logging the differences, instead of stopping (default:
    whether $TRTFORGE_TRTLLM_ALLOW_DRIFT is 1)."""

    def __post_init__(self):
        if self.repo not in REPO_KINDS:
            raise ValueError(f"trtllm repository {self.repo!r}: choose one of {', '.join(REPO_KINDS)}")
