"""The engine model's config.pbtxt `parameters`: names, docs, and string <-> value conversion.

Triton parameters are strings. Each parameter of the engine model is a field of one documented
dataclass under the field's own name: `AdapterOptions` below (the Triton model's own), RuntimeConfig
(device, kv_cache_memory; a phase model's phase and KV handoff, model_repo/phases.py) or
SchedulerConfig (prefill and decode scheduling). So the names an operator reads in config.pbtxt are
the ones `build-engine` and `LLMEngine.from_engine_dir` take, and their docs and defaults are
written once, on the field. Conversion goes through the field's type hint
(config/fields.parse_text), so a typo such as `max_num_seqs: "sixty"` fails the model load with
the parameter's name, the value and what it should be.

Torch-free: the engine model reads this module in the python-backend stub before the engine loads.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from trtforge.config.fields import field_docs, parse_bytes, parse_text
from trtforge.config.runtime import RuntimeConfig
from trtforge.config.scheduler import SchedulerConfig

if TYPE_CHECKING:
    from trtforge.models.engine_dir import EngineConfig

# Parameter names other modules read or write one by one (fields below and of RuntimeConfig).
ENGINE_DIR = "engine_dir"
EXCLUDE_INPUT_DEFAULT = "exclude_input_in_output"
KV_CACHE_MEMORY = "kv_cache_memory"
SPECULATIVE_CONFIG = "speculative_config"


@dataclass(frozen=True)
class AdapterOptions:
    """The engine model's parameters that are neither RuntimeConfig nor SchedulerConfig fields
    (the router takes exclude_input_in_output too)."""

    engine_dir: str = ""
    """Engine directory built by `build-engine` (absolute, or relative to this model's directory)."""
    exclude_input_in_output: bool = False
    """true | false: leave the prompt out of non-streamed text_output when a request does not send
    `exclude_input_in_output` (TensorRT-LLM returns prompt + answer by default). Streamed deltas
    never repeat the prompt."""
    finalize_drain_timeout_s: float = 5.0
    """Seconds the model waits, when unloaded, for in-flight requests to finish before aborting
    them."""
    kv_events_endpoint: str = ""
    """Publish the prefix cache's KV events in vLLM's ZMQ format (serving/kv_events_zmq.py) on this
    ZMQ endpoint, e.g. tcp://127.0.0.1:5557 (what llm-d's KV-cache-aware scheduler subscribes to);
    empty: none."""

    @classmethod
    def from_parameters(cls, parameters: dict[str, str]) -> AdapterOptions:
        """The fields present in `parameters` (others, and empty strings: the defaults)."""
        hints = typing.get_type_hints(cls)
        return cls(**{f.name: parse_text(f.name, parameters[f.name], hints[f.name])
                      for f in dataclasses.fields(cls) if parameters.get(f.name, "") != ""})

    def parameters(self) -> dict[str, str]:
        return {f.name: to_parameter(getattr(self, f.name)) for f in dataclasses.fields(self)}


def parameter_docs() -> dict[str, str]:
    """{parameter name: its help} for every parameter an engine model may have."""
    return {**field_docs(AdapterOptions), **RuntimeConfig.field_docs(), **SchedulerConfig.field_docs()}


def to_parameter(value: Any) -> str:
    """A field value as a Triton parameter string ("" for None, lower-case booleans)."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


# -- RuntimeConfig fields ----------------------------------------------------------------------
def runtime_parameters(**values: Any) -> dict[str, str]:
    """RuntimeConfig fields as parameter strings: the values given (None or "": RuntimeConfig's
    default), checked as the engine model will check them (ValueError naming a bad one)."""
    given = {k: v for k, v in values.items() if v is not None and v != ""}
    if KV_CACHE_MEMORY in given:  # parse_bytes' message says how to write a size, not whose it is
        try:
            parse_bytes(given[KV_CACHE_MEMORY])
        except ValueError as exc:
            raise ValueError(f"{KV_CACHE_MEMORY}: {exc}") from None
    runtime = RuntimeConfig(**given)
    return {name: to_parameter(getattr(runtime, name)) for name in values}


def runtime_config(parameters: dict[str, str]) -> RuntimeConfig:
    """The RuntimeConfig of a model's parameters (fields left out, or empty: the defaults)."""
    names = {f.name for f in dataclasses.fields(RuntimeConfig)}
    return RuntimeConfig.from_text({k: v for k, v in parameters.items() if k in names})


# -- SchedulerConfig fields --------------------------------------------------------------------
def scheduler_parameter_names() -> list[str]:
    """The SchedulerConfig fields that are config.pbtxt parameters, in declaration order (those
    that describe the engine, ENGINE_FIELDS, are not: the kv_cache_memory parameter is)."""
    return [f.name for f in dataclasses.fields(SchedulerConfig)
            if f.init and f.name not in SchedulerConfig.ENGINE_FIELDS]


def scheduler_values(parameters: dict[str, str]) -> dict[str, Any]:
    """SchedulerConfig field values from config.pbtxt parameters (fields not present are left
    out, so that engine.json's defaults apply)."""
    SchedulerConfig.refuse_engine_fields(parameters)
    hints = typing.get_type_hints(SchedulerConfig)
    return {name: parse_text(name, parameters[name], hints[name])
            for name in scheduler_parameter_names() if name in parameters}


def scheduler_config(engine: EngineConfig, overrides: dict[str, Any]) -> SchedulerConfig:
    """The engine's scheduling defaults (engine.json), then `overrides` (None: not given),
    checked by the runtime's own rule (the KV pool's size is not known here: its default stands
    in for it); ValueError (ConfigError) names an unknown field, or a bad value and its range."""
    SchedulerConfig.refuse_engine_fields(overrides)
    known = set(scheduler_parameter_names())
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"unknown scheduling parameter(s) {unknown}; the SchedulerConfig fields "
                         f"are: {', '.join(sorted(known))}.")
    given = {k: v for k, v in overrides.items() if v is not None}
    return SchedulerConfig.for_engine(engine.build, engine.scheduling, overrides=given)


def scheduler_parameters(engine: EngineConfig, overrides: dict[str, Any]) -> dict[str, str]:
    """Every SchedulerConfig parameter: the engine's recorded defaults, then `overrides`;
    validated, so that a bad value fails here rather than at model load."""
    config = scheduler_config(engine, overrides)
    return {name: to_parameter(getattr(config, name)) for name in scheduler_parameter_names()}
