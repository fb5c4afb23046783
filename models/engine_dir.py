"""The engine directory (docs/architecture.md): engine.json + rank0 weights + tokenizer files.

    ENGINE_DIR/
      engine.json            schema, versions, model, build limits, scheduling and speculative
                             decoding defaults, report, sha256s
      rank0.safetensors      converted weights (torch backend)   | rank0.engine + rank0.onnx (tensorrt)
      rank1.safetensors, …   the other tensor-parallel ranks' shards (--tp-size N; tensor_parallel.py)
      tokenizer.json, …      copied from the checkpoint so the directory is self-contained

Loading checks the schema, the versions and every checksum, and says what differs and how to rebuild
(a large file's digest is remembered while the file is unchanged: verified_files.py).

What a verified directory is (`_check_names`, `_check_files`), so that nothing is opened that the
build did not record:
  * every name in engine.json's `files` is a plain file name in the directory: no `/` or backslash,
    not `.`/`..`, not absolute, and no symbolic link that leads out of the directory;
  * the directory holds engine.json and the listed files, nothing else: an unlisted entry (file,
    link or directory) is refused, not ignored. The set of files a loader opens is not ours to
    enumerate — transformers' AutoTokenizer reads whatever its version and tokenizer class look
    for (config.json, chat_template.json, additional_chat_templates/, vocab.txt, spiece.model, …),
    ONNX Runtime and TensorRT open a model's external data by name — so "refuse what the loader
    would open" would miss a name sooner or later, while build-engine writes nothing unlisted;
  * each listed file has the sha256 recorded at build time.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trtforge.config.speculative import SpeculativeConfig
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
    speculative_config: dict[str, Any] | None = None
    """The engine's default speculative decoding (build-engine --speculative-config): a
    SpeculativeConfig as a JSON object, which runs unless the runtime says otherwise; absent: none
    (engines built before the option have no such key)."""

    def to_json(self) -> str:
        d = dict(self.__dict__)
        d["model"] = self.model.to_dict()
        for key in ("tensor_parallel", "speculative_config"):  # absent when unset: older engine.json keys stay
            if d[key] is None:
                del d[key]
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


def plain_name(name: object) -> bool:
    """A name engine.json may list: one file name inside the directory (no path, no `..`)."""
    return (isinstance(name, str) and name not in ("", ".", "..", ENGINE_JSON)
            and not any(c in name for c in "/\\\0") and not os.path.isabs(name))


def is_weights(name: str) -> bool:
    """The weights or plan of a rank (rank{r}.safetensors, rank0.engine, rank0.onnx and its .data):
    what only the executor opens (`read_engine_config(verify_weights=False)` skips their digests)."""
    return name.startswith("rank")


def write_engine_json(directory: Path, cfg: EngineConfig) -> None:
    cfg.files = {p.name: sha256(p) for p in sorted(directory.iterdir())
                 if p.is_file() and p.name != ENGINE_JSON}
    (directory / ENGINE_JSON).write_text(cfg.to_json())


def read_engine_config(directory: str | Path, verify_checksums: bool = True, *,
                       verify_weights: bool = True) -> EngineConfig:
    """Parse and verify engine.json; raises EngineLoadError explaining any mismatch.

    verify_checksums=False: engine.json's metadata only (its names are still checked), for callers
    that open no other file of the directory. verify_weights=False: every rule but the digests of
    the rank files (`is_weights`), for a caller that loads the tokenizer and not the weights (the
    OpenAI front end: the engine model hashes those when it loads them)."""
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
    _check_speculative_config(path, cfg, rebuild)
    _check_names(path, cfg, rebuild)
    _check_versions(cfg, rebuild)
    if verify_checksums:
        _check_files(directory, cfg, rebuild, verify_weights)
    return cfg


def _check_speculative_config(path: Path, cfg: EngineConfig, rebuild: str) -> None:
    if cfg.speculative_config is None:
        return
    try:
        SpeculativeConfig.parse(cfg.speculative_config)
    except (TypeError, ValueError) as exc:
        raise EngineLoadError(f"{path}: its default speculative_config {cfg.speculative_config!r} is invalid "
                              f"({exc}). {rebuild} --speculative-config JSON") from None


def _check_names(path: Path, cfg: EngineConfig, rebuild: str) -> None:
    if not isinstance(cfg.files, dict) or not all(isinstance(d, str) for d in cfg.files.values()):
        raise EngineLoadError(f"{path}: `files` must map file names to sha256 digests. {rebuild}")
    bad = [name for name in cfg.files if not plain_name(name)]
    if bad:
        raise EngineLoadError(f"{path} lists {', '.join(map(repr, bad[:5]))} under `files`: only plain file "
                              f"names inside the engine directory are allowed (no '/', no '..', not absolute), "
                              f"and build-engine writes no others, so this engine.json was edited. Nothing "
                              f"was loaded. {rebuild}")


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


def _check_files(directory: Path, cfg: EngineConfig, rebuild: str, verify_weights: bool = True) -> None:
    try:
        here = directory.resolve(strict=True)
        entries = {p.name for p in here.iterdir()} - {ENGINE_JSON}
    except OSError as exc:
        raise EngineLoadError(f"{directory} cannot be read ({exc}).") from None
    unlisted = sorted(entries - set(cfg.files))
    if unlisted:
        shown = ", ".join(unlisted[:5]) + (f" and {len(unlisted) - 5} more" if len(unlisted) > 5 else "")
        raise EngineLoadError(f"{directory} holds {shown}, which {ENGINE_JSON} does not list: an engine directory "
                              f"holds only the files whose sha256 the build recorded (a file added after the "
                              f"build could be read by the tokenizer or the weights loader unchecked). Move "
                              f"{'it' if len(unlisted) == 1 else 'them'} out of the directory; if the directory is "
                              f"not as build-engine wrote it, r{rebuild[1:]}")
    for name, digest in cfg.files.items():
        p = here / name
        if p.is_symlink() and p.resolve().parent != here:
            raise EngineLoadError(f"{directory / name} is a symbolic link to {p.resolve()}, outside the engine "
                                  f"directory; engine files must be inside it. {rebuild}")
        if not p.is_file():
            raise EngineLoadError(f"{directory} is incomplete: {name} is listed in {ENGINE_JSON} but missing "
                                  f"(or not a regular file). {rebuild}")
        if not verify_weights and is_weights(name):
            continue
        found = digest_of(p, sha256)  # hashed, or recorded for this unchanged file
        if found != digest:
            raise EngineLoadError(f"{directory / name} does not match the sha256 recorded in {ENGINE_JSON} "
                                  f"(recorded {digest[:12]}…, found {found[:12]}…): modified, replaced or "
                                  f"truncated after the build. {rebuild}")
