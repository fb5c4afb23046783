"""The engine directory (docs/architecture.md): engine.json + rank0 weights + tokenizer files.

    ENGINE_DIR/
      engine.json            schema, versions, model, build limits, scheduling defaults, report, sha256s
      rank0.safetensors      converted weights (torch backend)   | rank0.engine + rank0.onnx (tensorrt)
      rank1.safetensors, …   the other tensor-parallel ranks' shards (--tp-size N; tensor_parallel.py)
      tokenizer.json, …      copied from the checkpoint so the directory is self-contained

Loading checks the schema, the versions and every checksum, and says what differs and how to rebuild
(a large file's digest is remembered while the file is unchanged: verified_files.py).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trtforge.models.errors import EngineLoadError
from trtforge.models.model_config import ModelConfig
from trtforge.models.verified_files import digest_of

SCHEMA_VERSION = 1
ENGINE_JSON = "engine.json"


def trtforge_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("trtforge")
    except PackageNotFoundError:
        return "0.0.0+unknown"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


@dataclass
class EngineConfig:
    """Everything engine.json records."""

    model: ModelConfig
    build: dict[str, Any]
    """BuildConfig as built (max_batch_size, max_num_tokens, max_seq_len, kv_block_size, …)."""
    dtype: str
    """Resolved dtype of weights and KV cache."""
    backend: str = "torch"
    scheduling: dict[str, Any] = field(default_factory=dict)
    """Default scheduler parameters (SchedulerConfig fields); every one can be overridden at run time."""
    report: dict[str, Any] = field(default_factory=dict)
    versions: dict[str, str | None] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)
    """sha256 of every other file in the directory."""
    quantization: dict[str, Any] | None = None
    """Weight-only quantisation (build-engine --quantization): scheme, group_size, layers, scales_dtype; None: none."""
    tp_size: int = 1
    schema_version: int = SCHEMA_VERSION
    tensor_parallel: dict[str, Any] | None = None
    """tp_size > 1: what each rank{r}.safetensors holds (models/tensor_parallel.py `mapping`); absent at tp 1."""

    def to_json(self) -> str:
        d = dict(self.__dict__)
        d["model"] = self.model.to_dict()
        if d["tensor_parallel"] is None:  # a single-rank engine.json keeps its keys
            del d["tensor_parallel"]
        return json.dumps(d, indent=2, sort_keys=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "EngineConfig":
        d = dict(d)
        d["model"] = ModelConfig.from_dict(d["model"])
        return cls(**d)

    @property
    def max_seq_len(self) -> int:
        return int(self.build["max_seq_len"])

    @property
    def block_size(self) -> int:
        return int(self.build["kv_block_size"])

    @property
    def kv_cache_dtype(self) -> str:
        """"int8" (--kv-cache-dtype int8) or the model dtype (engines built before the option: the latter)."""
        return "int8" if self.build.get("kv_cache_dtype") == "int8" else self.dtype


def write_engine_json(directory: Path, cfg: EngineConfig) -> None:
    cfg.files = {p.name: sha256(p) for p in sorted(directory.iterdir())
                 if p.is_file() and p.name != ENGINE_JSON}
    (directory / ENGINE_JSON).write_text(cfg.to_json())


def read_engine_config(directory: str | Path, verify_checksums: bool = True) -> EngineConfig:
    """Parse and verify engine.json; raises EngineLoadError explaining any mismatch."""
    directory = Path(directory)
    path = directory / ENGINE_JSON
    rebuild = f"Rebuild it: build-engine CHECKPOINT --output {directory} --force"
    if not path.is_file():
        raise EngineLoadError(f"{directory} is not a trtforge engine directory (no {ENGINE_JSON}). {rebuild}")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise EngineLoadError(f"{path} is not valid JSON ({exc}). {rebuild}") from None
    schema = raw.get("schema_version")
    if schema != SCHEMA_VERSION:
        built_by = raw.get("versions", {}).get("trtforge", "an unknown trtforge")
        raise EngineLoadError(f"{path} has schema version {schema} (written by trtforge {built_by}); this "
                              f"trtforge {trtforge_version()} reads schema {SCHEMA_VERSION}. {rebuild}")
    try:
        cfg = EngineConfig.from_dict(raw)
    except TypeError as exc:
        raise EngineLoadError(f"{path} does not match schema {SCHEMA_VERSION} ({exc}). {rebuild}") from None
    _check_versions(cfg, rebuild)
    if verify_checksums:
        _check_files(directory, cfg, rebuild)
    return cfg


def _check_versions(cfg: EngineConfig, rebuild: str) -> None:
    if cfg.backend == "tensorrt":
        built = cfg.versions.get("tensorrt")
        try:
            import tensorrt

            here = getattr(tensorrt, "__version__", None)
        except ImportError:
            here = None
        if here is not None and built != here:
            raise EngineLoadError(f"this engine's TensorRT plan was built with TensorRT {built} but TensorRT "
                                  f"{here} is installed; plans only load in the version that built them. {rebuild}")


def _check_files(directory: Path, cfg: EngineConfig, rebuild: str) -> None:
    for name, digest in cfg.files.items():
        p = directory / name
        if not p.is_file():
            raise EngineLoadError(f"{directory} is incomplete: {name} is listed in {ENGINE_JSON} but missing. "
                                  f"{rebuild}")
        if digest_of(p, sha256) != digest:  # hashed, or recorded for this unchanged file
            raise EngineLoadError(f"{p} does not match the sha256 recorded in {ENGINE_JSON} (modified or "
                                  f"truncated after the build). {rebuild}")
