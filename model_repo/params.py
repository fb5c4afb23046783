"""The engine model's config.pbtxt `parameters`: names, docs, and string <-> value conversion.

Triton parameters are strings. Every SchedulerConfig field (prefill and decode scheduling) is one
parameter under its own field name, so the names an operator reads in config.pbtxt are the ones
documented on SchedulerConfig and accepted by `build-engine`/`LLMEngine.from_engine_dir`.
Conversion goes through the field's type hint, so a typo such as `max_num_seqs: "sixty"` fails
the model load with the parameter's name, the value and what it should be.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from trtforge.config.fields import parse_text
from trtforge.config.scheduler import SchedulerConfig

# Parameters of the engine model that are not scheduler fields.
ENGINE_DIR = "engine_dir"
DEVICE = "device"
EXCLUDE_INPUT_DEFAULT = "exclude_input_in_output"
DRAIN_TIMEOUT = "finalize_drain_timeout_s"
KV_CACHE_MEMORY = "kv_cache_memory"

ADAPTER_PARAMETER_DOCS = {
    ENGINE_DIR: "Engine directory built by `build-engine` (absolute, or relative to this model's "
                "directory).",
    DEVICE: "Device the engine runs on: cpu | cuda | cuda:N.",
    EXCLUDE_INPUT_DEFAULT: "true | false: leave the prompt out of non-streamed text_output when a "
                           "request does not send `exclude_input_in_output` (TensorRT-LLM "
                           "returns prompt + answer by default). Streamed deltas never repeat "
                           "the prompt.",
    KV_CACHE_MEMORY: "Memory for the paged KV cache, e.g. 512MiB or 4GiB (decides how many KV "
                     "blocks exist). Empty: the budget recorded in engine.json.",
    DRAIN_TIMEOUT: "Seconds the model waits, when unloaded, for in-flight requests to finish "
                   "before aborting them.",
}


def scheduler_config_cls() -> type:
    """SchedulerConfig (torch-free: this module loads in the python-backend stub before the engine)."""
    return SchedulerConfig


ENGINE_FIELDS = SchedulerConfig.ENGINE_FIELDS
"""SchedulerConfig fields that describe the engine and its KV memory: not parameters (the
kv_cache_memory parameter is)."""
_refuse_engine_fields = SchedulerConfig.refuse_engine_fields


def scheduler_field_docs() -> dict[str, str]:
    return scheduler_config_cls().field_docs()


def to_parameter(value: Any) -> str:
    """A field value as a Triton parameter string ("" for None, lower-case booleans)."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def from_parameter(name: str, text: str, hint: Any) -> Any:
    """Parse one parameter string into the field's type (the rules of every option front:
    builder/config_docs.parse_text); ValueError names the parameter, the value and the type."""
    return parse_text(name, text, hint)


def scheduler_values(parameters: dict[str, str]) -> dict[str, Any]:
    """SchedulerConfig field values from config.pbtxt parameters (fields not present are left
    out, so that engine.json's defaults apply)."""
    _refuse_engine_fields(parameters)
    cls = scheduler_config_cls()
    hints = typing.get_type_hints(cls)
    return {name: from_parameter(name, parameters[name], hints[name])
            for name in scheduler_parameter_names() if name in parameters}


def scheduler_parameter_names() -> list[str]:
    """The SchedulerConfig fields that are config.pbtxt parameters, in declaration order."""
    return [f.name for f in dataclasses.fields(scheduler_config_cls())
            if f.init and f.name not in ENGINE_FIELDS]


def check_unknown_overrides(overrides: dict[str, Any]) -> None:
    _refuse_engine_fields(overrides)
    known = set(scheduler_parameter_names())
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(
            f"unknown scheduling parameter(s) {unknown}; the SchedulerConfig fields are: "
            f"{', '.join(sorted(known))}."
        )
