"""The TensorRT-LLM releases trtforge's `trtllm` backend knows, and the checks on versions.

A TensorRT-LLM engine only loads in the TensorRT-LLM (and TensorRT) that built it, and the Triton
repository trtforge writes for it follows the model templates of one release. Each release whose
templates were read is one `TrtllmRelease` here, with the file that records its interface
(model_repo/trtllm/upstream_<tag>.json). The release is picked by the installed `tensorrt_llm`
(or an explicit version); any other version is drift, an error unless the user overrides it
(`allow_drift=True` or TRTFORGE_TRTLLM_ALLOW_DRIFT=1), and `trtforge serve` refuses an engine of
another version than the one installed.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from importlib import metadata

ALLOW_DRIFT_ENV = "TRTFORGE_TRTLLM_ALLOW_DRIFT"
"""Set to 1 to go on when the TensorRT-LLM version or the image's templates differ from a record."""


@dataclass(frozen=True)
class TrtllmRelease:
    """One TensorRT-LLM release: where its Triton templates were read and what serving it needs."""

    tensorrt_llm: str
    """TensorRT-LLM version (what `tensorrt_llm.__version__` says)."""
    image: str
    """NGC Triton image that ships this TensorRT-LLM and the `tensorrtllm` backend ('' if none is
    known)."""
    backend_release: str
    """Tag the recorded templates belong to; names the facts file upstream_<tag>.json."""
    backend_commit: str
    """The commit the templates were read at (per model in the facts file where they differ)."""
    backend_source: str
    """Repository of the templates: tensorrtllm_backend up to v0.19.0, TensorRT-LLM from v0.20."""
    models_dir: str
    """Where the image (or a checkout) keeps the inflight_batcher_llm python models."""
    launch_script: str
    """Upstream's launcher for multi-process (MPI) repositories such as disaggregated serving."""
    kv_transfer_env: dict[str, str] = field(default_factory=dict)
    """Environment the servers of a disaggregated repository need to hand the KV cache over."""
    kv_transfer_why: str = ""
    """Where kv_transfer_env comes from (upstream's docs or source at this release)."""


V0_19 = TrtllmRelease(
    tensorrt_llm="0.19.0",
    # NVIDIA's Triton/TensorRT-LLM compatibility matrix lists 25.05-trtllm-python-py3 with 0.19.0.
    image="nvcr.io/nvidia/tritonserver:25.05-trtllm-python-py3",
    backend_release="v0.19.0",
    backend_commit="c1e19638304d287f554f738c1411746555ed348c",
    backend_source="https://github.com/triton-inference-server/tensorrtllm_backend",
    models_dir="/app/all_models/inflight_batcher_llm",
    launch_script="/app/scripts/launch_triton_server.py",
    kv_transfer_env={"TRTLLM_USE_MPI_KVCACHE": "1"},
    kv_transfer_why="TensorRT-LLM 0.19.0 docs, advanced/disaggregated-service: TRTLLM_USE_MPI_KVCACHE=1 "
                    "should be set for disaggregated service (the executor's cache transceiver "
                    "reads it; the backend sets no transceiver itself)")

V1_2 = TrtllmRelease(
    tensorrt_llm="1.2.0rc8",
    # No Triton image with 1.2.0rc8 is known: the compatibility matrix ends at 25.12 (TensorRT-LLM
    # 1.1.0), whose templates could not be read. Build and serve where this TensorRT-LLM is installed.
    image="",
    backend_release="v1.2.0rc8",
    backend_commit="0c8de69a1ca6213eebb20a51873890ff128666c2",
    backend_source="https://github.com/NVIDIA/TensorRT-LLM",
    models_dir="triton_backend/all_models/inflight_batcher_llm",
    launch_script="triton_backend/scripts/launch_triton_server.py",
    kv_transfer_env={"TRTLLM_USE_MPI_KVCACHE": "1"},
    kv_transfer_why="triton_backend/inflight_batcher_llm/src/model_instance_state.cc at this commit sets "
                    "CacheTransceiverConfig(BackendType::MPI) itself; TRTLLM_USE_MPI_KVCACHE=1 names the "
                    "same transport for the executor's DEFAULT-backend and buffer checks")

RELEASES: dict[str, TrtllmRelease] = {r.tensorrt_llm: r for r in (V0_19, V1_2)}
"""Every release with a recorded interface, by TensorRT-LLM version."""
TARGET = V0_19
"""The default: the release of the pinned NGC image (docs/tensorrt-llm.md)."""


class TrtllmDrift(ValueError):
    """A TensorRT-LLM version or template that differs from every record; the message names the
    differences and the override (a ValueError, which the commands print without a traceback)."""


def installed_tensorrt_llm() -> str | None:
    """TensorRT-LLM's version from its package metadata (importing it takes seconds and a GPU)."""
    try:
        return metadata.version("tensorrt_llm")
    except metadata.PackageNotFoundError:
        return None


def drift_allowed(allow: bool | None = None) -> bool:
    """The user's override: `allow` when given, else $TRTFORGE_TRTLLM_ALLOW_DRIFT == 1."""
    return bool(allow) if allow is not None else os.environ.get(ALLOW_DRIFT_ENV, "") == "1"


def override_hint() -> str:
    return (f"to go on anyway, set {ALLOW_DRIFT_ENV}=1 (Python: allow_drift=True) and check the "
            "differences yourself")


def _key(version: str) -> tuple:
    """Sortable release key: 1.2.0rc8 -> (1, 2, 0, 0, 8); 0.19.0 -> (0, 19, 0, 1, 0)."""
    m = re.match(r"(\d+)\.(\d+)\.(\d+)(?:rc(\d+))?", version.strip())
    if m is None:
        return (-1,)
    major, minor, patch, rc = m.groups()
    return (int(major), int(minor), int(patch), 0 if rc is not None else 1, int(rc or 0))


def nearest_release(version: str) -> TrtllmRelease:
    """The recorded release closest to `version`: the newest of its major line, else the newest
    older one, else the oldest (used only with the drift override)."""
    ordered = sorted(RELEASES.values(), key=lambda r: _key(r.tensorrt_llm))
    key = _key(version)
    same_major = [r for r in ordered if _key(r.tensorrt_llm)[:1] == key[:1]]
    older = [r for r in ordered if _key(r.tensorrt_llm) <= key]
    return (same_major or older or ordered)[-1]


def release_for(version: str | None, allow_drift: bool | None = None,
                what: str = "TensorRT-LLM") -> TrtllmRelease:
    """The release whose interface trtforge writes for TensorRT-LLM `version` (None: the default).
    TrtllmDrift when no release is recorded for it, unless the override is given (then the
    nearest recorded one)."""
    if version is None:
        return TARGET
    release = RELEASES.get(version.strip())
    if release is not None:
        return release
    if drift_allowed(allow_drift):
        return nearest_release(version)
    raise TrtllmDrift(
        f"{what} {version} has no recorded Triton interface: trtforge records TensorRT-LLM "
        f"{', '.join(RELEASES)} only (docs/tensorrt-llm.md), and a config written for another release "
        f"would misname inputs and parameters (0.19's min_length/random_seed are 1.2's "
        f"min_tokens/seed). Use a recorded release, record this one with scripts/trtllm_facts.py, or "
        f"{override_hint()}.")


def version_mismatch(built: str | None, installed: str | None, engine: str = "this engine") -> str | None:
    """None when an engine built by TensorRT-LLM `built` loads under `installed`; else a message
    naming both. Engines are not portable across TensorRT-LLM versions, so any difference counts
    (patch releases and local suffixes included)."""
    if not built:
        return (f"{engine} records no TensorRT-LLM version (not built with `build-engine --backend "
                f"trtllm`?); rebuild it inside {TARGET.image}")
    if installed is None:
        where = RELEASES[built].image if built in RELEASES and RELEASES[built].image else None
        return (f"{engine} was built with TensorRT-LLM {built}, and TensorRT-LLM is not installed "
                f"here; serve it inside {where or f'the image with TensorRT-LLM {built}'}")
    if built.strip() != installed.strip():
        return (f"{engine} was built with TensorRT-LLM {built}, but TensorRT-LLM {installed} is "
                f"installed here; engines only load in the TensorRT-LLM version that built them: "
                f"rebuild it here (build-engine --backend trtllm --force) or serve it in the image "
                f"with TensorRT-LLM {built}")
    return None
