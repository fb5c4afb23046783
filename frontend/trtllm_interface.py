"""The OpenAI front end in front of a `--backend trtllm` repository (TensorRT-LLM's `ensemble`).

A repository written by `emit-repo` for a trtllm engine is TensorRT-LLM's inflight_batcher_llm:
its `ensemble` is a real Triton ensemble (platform "ensemble": preprocessing → tensorrt_llm →
postprocessing) whose inputs are those of one TensorRT-LLM release, recorded in
model_repo/trtllm/upstream_<tag>.json. The release is the record whose ensemble inputs the
repository's ensemble has, name, type and dims (the emitter writes them from that record), so
the front end reads what the served repository really takes, not what the installed package
guesses.

Each request field goes to the input of that release that means the same thing, typed as the
record types it (`seed` is `random_seed` UINT64 in 0.19.0, `seed` in 1.2.0rc8; `min_tokens` is
`min_length` in 0.19.0). A field the release has no input for is a 400 naming the field and the
release (`refusals`), never dropped: top_logprobs, prompt_logprobs, cache_salt, a per-request
skip_special_tokens other than the repository's; guided decoding (structured output, forced tool
calls) when the repository's tensorrt_llm model has no guided_decoding_backend (emit-repo leaves
it unset).

What the ensemble answers (`outputs`): `text_output`; `output_log_probs` (per response, the
tokens it added: TensorRT-LLM streams new tokens only); `num_input_tokens` / `num_output_tokens`
where the release has them (1.x; per response, the tokens it added). No release reports why a
request finished: it is derived (finish_reasons in generation.Tally: "length" when max_tokens
tokens came, else "stop"), and the stop string that ended a request is not known.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trtforge.builder.trtllm.versions import RELEASES, TrtllmRelease
from trtforge.frontend.errors import bad_request
from trtforge.model_repo.interface import ENSEMBLE
from trtforge.model_repo.pbtxt import parameters_of, read_config
from trtforge.model_repo.trtllm import upstream as U
from trtforge.model_repo.trtllm.templates import Tensor

TRITON_PLATFORM = "ensemble"
"""The `platform` of TensorRT-LLM's ensemble (trtforge's own `ensemble` is a python-backend model)."""
ALIASES: dict[str, tuple[str, ...]] = {
    "seed": ("seed", "random_seed"),
    "min_tokens": ("min_tokens", "min_length"),
}
"""trtforge's input name → the names TensorRT-LLM releases give the same input, newest first."""
_NUMPY = {"TYPE_STRING": np.object_, "TYPE_INT32": np.int32, "TYPE_INT64": np.int64,
          "TYPE_FP32": np.float32, "TYPE_UINT64": np.uint64, "TYPE_BOOL": np.bool_}
GUIDED_FIELDS = "response_format / structured_outputs / tool_choice required or named"


def is_trtllm_repo(repo: str | Path) -> bool:
    """The repository's `ensemble` is TensorRT-LLM's (a Triton ensemble), not trtforge's model."""
    path = Path(repo) / ENSEMBLE / "config.pbtxt"
    return path.is_file() and read_config(path).platform == TRITON_PLATFORM


def _signature(tensors: list[Tensor]) -> set[tuple[str, str, tuple[int, ...]]]:
    return {(t.name, t.data_type, tuple(t.dims)) for t in tensors}


def _config_signature(config: Any) -> set[tuple[str, str, tuple[int, ...]]]:
    from tritonclient.grpc import model_config_pb2 as mc

    return {(i.name, mc.DataType.Name(i.data_type), tuple(i.dims)) for i in config.input}


def release_of(repo: str | Path) -> TrtllmRelease:
    """The recorded release whose ensemble inputs the repository's ensemble has; ValueError
    naming the closest record's differences when none matches."""
    config = read_config(Path(repo) / ENSEMBLE / "config.pbtxt")
    have = _config_signature(config)
    diffs: dict[str, set] = {}
    for version, release in RELEASES.items():
        want = _signature(U.tensors("ensemble", "inputs", release))
        if want == have:
            return release
        diffs[version] = want ^ have
    closest = min(diffs, key=lambda v: len(diffs[v]))
    shown = ", ".join(sorted(name for name, _, _ in diffs[closest]))
    raise ValueError(f"{repo}/{ENSEMBLE}/config.pbtxt is TensorRT-LLM's ensemble, but its inputs match no "
                     f"recorded release ({', '.join(RELEASES)}); closest: {closest}, differing in {shown}. "
                     "Re-emit the repository with `trtforge emit-repo --trtllm-version VERSION`.")


def _parameter(repo: Path, models: tuple[str, ...], key: str) -> str | None:
    """`key` of the first of `models` the repository has (None: none has it)."""
    for name in models:
        path = repo / name / "config.pbtxt"
        if path.is_file():
            value = parameters_of(read_config(path)).get(key)
            if value is not None:
                return value
    return None


@dataclass(frozen=True)
class TrtllmInterface:
    """What the served TensorRT-LLM ensemble takes and answers."""

    release: TrtllmRelease
    inputs: dict[str, Tensor]
    """The ensemble's inputs at this release, by name (from the record)."""
    outputs: frozenset[str]
    guided_decoding: bool
    """The tensorrt_llm model has a guided_decoding_backend (else a guide is refused)."""
    skips_special_tokens: bool
    """The postprocessing model's skip_special_tokens (a per-request choice no release has)."""

    @property
    def label(self) -> str:
        return f"TensorRT-LLM {self.release.tensorrt_llm}'s ensemble"

    def name_of(self, ours: str) -> str | None:
        """The release's name for trtforge's input `ours`; None where it has none."""
        return next((n for n in ALIASES.get(ours, (ours,)) if n in self.inputs), None)

    def has_output(self, name: str) -> bool:
        return name in self.outputs

    def absent(self, field: str, ours: str, why: str = "") -> Exception:
        """The 400 for a request field this release has no input for."""
        return bad_request(f"{field}: {self.label} has no input for it ({ours!r} is not among its inputs), so "
                           f"this server cannot honour it{why}; leave it out.", param=field.split(" ")[0])

    def arrays(self, values: dict[str, Any]) -> dict[str, np.ndarray]:
        """{release's input name: array [1, n] typed as the record types it} for trtforge's names;
        a name without a counterpart is an error here (refusals() said 400 before)."""
        out = {}
        for ours, value in values.items():
            if value is None:
                continue
            name = self.name_of(ours)
            if name is None:
                raise self.absent(ours, ours)
            dtype = self.inputs[name].data_type
            items = list(value) if isinstance(value, (list, tuple)) else [value]
            if dtype == "TYPE_STRING":
                items = [str(v).encode("utf-8") for v in items]
            out[name] = np.array([items], dtype=_NUMPY[dtype])
        return out


def load_interface(repo: str | Path) -> TrtllmInterface:
    """The interface of the repository's TensorRT-LLM ensemble (see module doc)."""
    repo = Path(repo)
    release = release_of(repo)
    engines = ("tensorrt_llm", "context", "generation")
    skip = _parameter(repo, ("postprocessing",), "skip_special_tokens")
    return TrtllmInterface(
        release=release,
        inputs={t.name: t for t in U.tensors("ensemble", "inputs", release)},
        outputs=frozenset(t.name for t in U.tensors("ensemble", "outputs", release)),
        guided_decoding=bool(_parameter(repo, engines, "guided_decoding_backend")),
        skips_special_tokens=(skip or "true").strip().lower() in ("true", "1"))


def engine_dir_of_trtllm(repo: str | Path) -> Path:
    """The engine directory of a trtllm repository: preprocessing's tokenizer_dir (emit-repo writes
    the engine directory there; its tokenizer and engine.json are what the front end reads)."""
    value = _parameter(Path(repo), ("preprocessing",), "tokenizer_dir")
    if not value:
        raise ValueError(f"{repo}/preprocessing/config.pbtxt names no tokenizer_dir; re-emit the repository "
                         "with `trtforge emit-repo`, or pass --served-engine-dir ENGINE_DIR.")
    path = Path(value)
    return path if path.is_absolute() else Path(repo) / "preprocessing" / path
