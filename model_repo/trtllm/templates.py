"""Read TensorRT-LLM's `config.pbtxt` templates (the ones with `${...}` placeholders) as facts.

Used twice: `scripts/trtllm_facts.py` records the interface of a release as test data, and
`emit-repo --trtllm-models-dir` compares the templates shipped in the serving image with what
trtforge writes, so that an image of another release is reported instead of half-working.

A template is not valid protobuf text until its placeholders are replaced. The replacement only
needs to parse: quoted placeholders stay (they are string values), data types take the value the
upstream README's fill_template example gives them, and every other placeholder (batch sizes,
counts, `decoupled`) becomes `1`, which parses as an int and as a bool.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

# What upstream's docs fill the data-type placeholders with (TensorRT-LLM backend v0.19.0,
# README "Modify the Model Configuration": LOGITS_DATATYPE=TYPE_FP32,
# encoder_input_features_data_type:TYPE_FP16; from 1.x, whose tensorrt_llm template also has
# ${prompt_embedding_table_data_type}, its docs' fill_template lines pass TYPE_FP16 for it).
DTYPE_PLACEHOLDERS = {"logits_datatype": "TYPE_FP32",
                      "encoder_input_features_data_type": "TYPE_FP16",
                      "prompt_embedding_table_data_type": "TYPE_FP16"}

_UNQUOTED = re.compile(r'(?<!")\$\{(\w+)\}(?!")')


@dataclass(frozen=True)
class Tensor:
    """One input or output as Triton sees it: name, data type, dims and the flags that matter."""

    name: str
    data_type: str
    """Triton type name, e.g. TYPE_INT32."""
    dims: tuple[int, ...]
    optional: bool = False
    reshape: tuple[int, ...] | None = None
    """`reshape: { shape: [...] }` if present (the C++ backend drops the batch-1 dim with it)."""
    ragged: bool = False
    """allow_ragged_batch."""

    def as_list(self) -> list:
        return [self.name, self.data_type, list(self.dims), self.optional,
                None if self.reshape is None else list(self.reshape), self.ragged]


@dataclass
class ModelFacts:
    """What a model's config declares: the parts a client or a composing model depends on."""

    name: str
    backend: str
    platform: str
    inputs: list[Tensor] = field(default_factory=list)
    outputs: list[Tensor] = field(default_factory=list)
    parameters: list[str] = field(default_factory=list)
    """Parameter keys, sorted."""
    fixed: dict[str, str] = field(default_factory=dict)
    """Parameters whose template value is a literal, not a `${...}` placeholder."""
    steps: list[dict] = field(default_factory=list)
    """Ensemble steps: {"model_name", "input_map", "output_map"}."""


def fill_for_parsing(text: str) -> str:
    """The template with every unquoted placeholder replaced so that it parses (see module doc)."""
    def repl(m: re.Match) -> str:
        return DTYPE_PLACEHOLDERS.get(m.group(1), "1")

    return _UNQUOTED.sub(repl, text)


def tensor_of(io: mc.ModelInput | mc.ModelOutput) -> Tensor:
    reshape = tuple(io.reshape.shape) if io.HasField("reshape") else None
    return Tensor(name=io.name, data_type=mc.DataType.Name(io.data_type), dims=tuple(io.dims),
                  optional=bool(getattr(io, "optional", False)), reshape=reshape,
                  ragged=bool(getattr(io, "allow_ragged_batch", False)))


def facts_of(config: mc.ModelConfig) -> ModelFacts:
    """The facts of a parsed ModelConfig (a template after `fill_for_parsing`, or ours)."""
    steps = [{"model_name": s.model_name, "input_map": dict(sorted(s.input_map.items())),
              "output_map": dict(sorted(s.output_map.items()))}
             for s in config.ensemble_scheduling.step]
    return ModelFacts(name=config.name, backend=config.backend, platform=config.platform,
                      inputs=[tensor_of(i) for i in config.input],
                      outputs=[tensor_of(o) for o in config.output],
                      parameters=sorted(config.parameters),
                      fixed={k: v.string_value for k, v in sorted(config.parameters.items())
                             if "${" not in v.string_value},
                      steps=steps)


def read_template(path: str | Path) -> ModelFacts:
    """Parse one upstream config.pbtxt template; raises text_format.ParseError naming the line."""
    config = text_format.Parse(fill_for_parsing(Path(path).read_text()), mc.ModelConfig())
    return facts_of(config)


def differences(ours: ModelFacts, theirs: ModelFacts) -> list[str]:
    """Human-readable differences in tensor names/types/dims and parameter keys (empty: same)."""
    out: list[str] = []
    for kind in ("inputs", "outputs"):
        mine = {t.name: (t.data_type, t.dims) for t in getattr(ours, kind)}
        other = {t.name: (t.data_type, t.dims) for t in getattr(theirs, kind)}
        for name in sorted(set(other) - set(mine)):
            out.append(f"{ours.name}: {kind[:-1]} {name!r} is in the template, not in ours")
        for name in sorted(set(mine) - set(other)):
            out.append(f"{ours.name}: {kind[:-1]} {name!r} is ours only")
        for name in sorted(set(mine) & set(other)):
            if mine[name] != other[name]:
                out.append(f"{ours.name}: {kind[:-1]} {name!r} is {mine[name]} here, "
                           f"{other[name]} in the template")
    for key in sorted(set(theirs.parameters) - set(ours.parameters)):
        out.append(f"{ours.name}: parameter {key!r} is in the template, not in ours")
    for key in sorted(set(ours.parameters) - set(theirs.parameters)):
        out.append(f"{ours.name}: parameter {key!r} is ours only")
    return out
