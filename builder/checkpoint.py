"""Reading a Hugging Face checkpoint: local directory or hub id, safetensors (single or sharded),
pickled .bin only when explicitly allowed. Tensors are read one at a time (never the whole model)."""

from __future__ import annotations

import json
import struct
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trtforge.models.errors import BuildError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja",
                   "generation_config.json")
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
SAFE_PICKLE_TORCH = (2, 6)
"""torch.load(weights_only=True) runs no code from the file from torch 2.6 on; before it, a crafted
pickle executes code despite weights_only (CVE-2025-32434)."""


def check_pickle_safe(torch_version: str) -> None:
    """BuildError unless `torch_version` is one whose torch.load(weights_only=True) is safe."""
    release = torch_version.split("+")[0].split(".")
    try:
        major, minor = int(release[0]), int("".join(ch for ch in release[1] if ch.isdigit()) or 0)
    except (IndexError, ValueError):
        major, minor = 0, 0  # unparsable: not known to be safe
    if (major, minor) < SAFE_PICKLE_TORCH:
        need = ".".join(map(str, SAFE_PICKLE_TORCH))
        raise BuildError(f"--allow-pickle needs torch >= {need}: this torch is {torch_version}, whose "
                         f"torch.load(weights_only=True) can still run code from a crafted .bin "
                         f"(CVE-2025-32434). Upgrade torch (pip install 'torch>={need}'), or convert the "
                         f"weights to safetensors on a machine that has it.")


def resolve(path_or_id: str) -> Path:
    """A local checkpoint directory, downloading a hub id (`org/name`) when the machine has network."""
    path = Path(path_or_id).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise BuildError(f"checkpoint {path_or_id!r} is a file; pass the directory holding config.json.")
    if path_or_id.count("/") != 1 or path_or_id.startswith((".", "/", "~")):
        raise BuildError(f"checkpoint directory {path_or_id!r} does not exist (and it is not a hub id "
                         f"like 'Qwen/Qwen2.5-0.5B-Instruct').")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(path_or_id, allow_patterns=_HUB_PATTERNS))
    except Exception as exc:  # noqa: BLE001 - network errors come in many classes: one BuildError
        raise BuildError(
            f"could not download {path_or_id!r} from the Hugging Face hub ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}). This machine may have no network or "
            f"the id may be wrong: download the checkpoint elsewhere and pass its local directory."
        ) from None


def load_hf_config(ckpt: Path) -> Any:
    if not (ckpt / "config.json").is_file():
        raise BuildError(f"{ckpt} has no config.json: it is not a Hugging Face checkpoint directory.")
    try:
        raw = json.loads((ckpt / "config.json").read_text())
    except json.JSONDecodeError as exc:
        raise BuildError(f"{ckpt / 'config.json'} is not valid JSON ({exc}).") from None
    from trtforge.builder.architectures import spec_for

    spec_for(list(raw.get("architectures") or []), raw.get("model_type"))  # clear error first
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(ckpt))
    except Exception as exc:  # noqa: BLE001 - whatever transformers raises: one BuildError naming the file
        raise BuildError(f"transformers cannot read {ckpt / 'config.json'}: {exc}") from None


def check_tokenizer(ckpt: Path) -> None:
    if not any((ckpt / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise BuildError(f"{ckpt} has no tokenizer (none of tokenizer.json, tokenizer.model, vocab.json): "
                         f"an engine must be self-contained; copy the tokenizer files into the checkpoint.")
    from transformers import AutoTokenizer

    try:
        AutoTokenizer.from_pretrained(str(ckpt))
    except Exception as exc:  # noqa: BLE001 - whatever transformers raises: one BuildError naming the file
        raise BuildError(f"the tokenizer in {ckpt} cannot be loaded by transformers: {exc}") from None


_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}


def _safetensors_header(f: Path) -> dict[str, tuple[str, tuple[int, ...], int, int]]:
    """{name: (dtype code, shape, absolute begin, absolute end)} from a safetensors file's header."""
    try:
        with open(f, "rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(length))
    except (struct.error, json.JSONDecodeError, UnicodeDecodeError, OSError) as exc:
        raise BuildError(f"{f} is not a readable safetensors file ({exc}).") from None
    header.pop("__metadata__", None)
    out = {}
    for name, entry in header.items():
        if entry["dtype"] not in _ST_DTYPES:
            raise BuildError(f"{f}: tensor {name!r} has dtype {entry['dtype']}, which trtforge cannot convert.")
        begin, end = entry["data_offsets"]
        out[name] = (entry["dtype"], tuple(entry["shape"]), 8 + length + begin, 8 + length + end)
    return out


@dataclass
class TensorInfo:
    file: Path
    shape: tuple[int, ...]
    dtype: str
    begin: int = 0
    end: int = 0


class TensorReader:
    """Index of every tensor in the checkpoint; `get(name)` reads one tensor from its file."""

    def __init__(self, ckpt: Path, allow_pickle: bool = False):
        self.ckpt = ckpt
        self.index: dict[str, TensorInfo] = {}
        self._stack = ExitStack()
        self._handles: dict[Path, Any] = {}
        self._pickled: dict[Path, dict[str, torch.Tensor]] = {}
        for f in self._weight_files(allow_pickle):
            self._index_file(f)

    def _weight_files(self, allow_pickle: bool) -> list[Path]:
        c = self.ckpt
        index = c / "model.safetensors.index.json"
        if index.is_file():
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            missing = [n for n in names if not (c / n).is_file()]
            if missing:
                raise BuildError(f"{index.name} lists shard(s) that are missing from {c}: {', '.join(missing)}.")
            return [c / n for n in names]
        files = sorted(c.glob("*.safetensors"))
        if files:
            return files
        bins = sorted(c.glob("*.bin"))
        if bins and not allow_pickle:
            raise BuildError(f"{c} holds only pickled weights ({bins[0].name}); pickles can run code when "
                             f"loaded. Convert to safetensors, or pass --allow-pickle to load them with "
                             f"torch.load(weights_only=True) (torch >= {SAFE_PICKLE_TORCH}).")
        if bins:
            check_pickle_safe(torch.__version__)
            return bins
        raise BuildError(f"{c} has no weights (no *.safetensors, model.safetensors.index.json or *.bin).")

    def _index_file(self, f: Path) -> None:
        if f.suffix == ".bin":
            sd = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
            self._pickled[f] = sd
            for name, t in sd.items():
                self.index[name] = TensorInfo(f, tuple(t.shape), str(t.dtype).replace("torch.", ""))
            return
        for name, (dtype, shape, begin, end) in _safetensors_header(f).items():
            self.index[name] = TensorInfo(f, shape, dtype, begin, end)
        self._handles[f] = self._stack.enter_context(open(f, "rb"))

    def has(self, name: str) -> bool:
        return name in self.index

    def get(self, name: str) -> torch.Tensor:
        """Read one tensor with plain file reads (not mmap), so pages of tensors already converted
        do not stay resident: peak memory is the output's tensor, not the whole checkpoint."""
        info = self.index[name]
        if info.file in self._pickled:
            return self._pickled[info.file][name]
        f = self._handles[info.file]
        buf = torch.empty(info.end - info.begin, dtype=torch.uint8)
        f.seek(info.begin)
        if f.readinto(memoryview(buf.numpy())) != len(buf):
            raise BuildError(f"{info.file} is truncated: tensor {name!r} runs past the end of the file.")
        return buf.view(_ST_DTYPES[info.dtype]).reshape(info.shape)

    def close(self) -> None:
        self._stack.close()
        self._pickled.clear()

    def __enter__(self) -> "TensorReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def tokenizer_files(ckpt: Path) -> list[Path]:
    return [ckpt / f for f in TOKENIZER_FILES if (ckpt / f).is_file()]


