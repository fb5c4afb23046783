"""Which of TensorRT-LLM's own files each python model needs, and where they come from.

The files are TensorRT-LLM's (Apache-2.0, shipped in the NGC image under /app/all_models and in
the tensorrtllm_backend release); trtforge copies them from there into the repository and never
carries a copy of its own. Paths are relative to `all_models/inflight_batcher_llm` (the
directory `--trtllm-models-dir` names); the disaggregated BLS sits beside it.
"""

from __future__ import annotations

import posixpath
from pathlib import Path

MODEL_FILES: dict[str, dict[str, str]] = {
    "preprocessing": {"model.py": "preprocessing/1/model.py"},
    "postprocessing": {"model.py": "postprocessing/1/model.py"},
    "tensorrt_llm_bls": {"model.py": "tensorrt_llm_bls/1/model.py",
                         "lib/decode.py": "tensorrt_llm_bls/1/lib/decode.py",
                         "lib/triton_decoder.py": "tensorrt_llm_bls/1/lib/triton_decoder.py"},
    "disaggregated_serving_bls": {
        "model.py": "../disaggregated_serving/disaggregated_serving_bls/1/model.py"},
}
"""{model: {path under REPO/model/1/: path under all_models/inflight_batcher_llm/}}."""

LAYOUTS = {False: ("ensemble", "preprocessing", "tensorrt_llm", "postprocessing",
                   "tensorrt_llm_bls"),
           True: ("ensemble", "preprocessing", "context", "generation", "postprocessing",
                  "disaggregated_serving_bls")}
"""The models of a repository, without and with disaggregated serving."""


def model_files(model: str, source: Path | None,
                table: dict[str, str] | None = None) -> tuple[dict[str, Path], list[str]]:
    """({dest: source file} to copy, ["REPO/model/1/dest  ← all_models/... "] still missing);
    `table` ({dest: path under all_models/inflight_batcher_llm}) defaults to MODEL_FILES[model]."""
    found: dict[str, Path] = {}
    missing: list[str] = []
    for dest, rel in (table if table is not None else MODEL_FILES.get(model, {})).items():
        src = (source / rel) if source is not None else None
        if src is not None and src.is_file():
            found[dest] = src
        else:
            origin = posixpath.normpath(f"all_models/inflight_batcher_llm/{rel}")
            missing.append(f"{model}/1/{dest}  <- {origin}")
    return found, missing


def stale_models(disaggregated: bool) -> list[str]:
    """Models of the other layout, removed so that Triton does not load both."""
    return sorted(set(LAYOUTS[not disaggregated]) - set(LAYOUTS[disaggregated]))
