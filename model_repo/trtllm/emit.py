"""`emit-repo` for an engine built with `--backend trtllm`: a repository for Triton's
`tensorrtllm` backend, laid out as TensorRT-LLM's `inflight_batcher_llm`.

    REPO/ensemble            platform "ensemble": preprocessing → tensorrt_llm → postprocessing
    REPO/preprocessing       python: tokenizer (TensorRT-LLM's model.py)
    REPO/tensorrt_llm        backend "tensorrtllm": the engine, in-flight batching, paged KV
    REPO/postprocessing      python: detokenizer (TensorRT-LLM's model.py)
    REPO/tensorrt_llm_bls    python: the same chain as one BLS model (TensorRT-LLM's model.py)

With `disaggregated`: `context` and `generation` (two tensorrt_llm models, each its own GPU,
MPI participant and scheduling values) and `disaggregated_serving_bls` replace tensorrt_llm and
tensorrt_llm_bls, and the ensemble calls disaggregated_serving_bls, as upstream's
all_models/disaggregated_serving/README.md lays it out (started as launch.py says).

The configs follow the recorded interface of one release (builder/trtllm/versions.py): the one
TrtllmOptions.version names, else the installed TensorRT-LLM's, else the one the engine was built with.
A version without a record, an engine of another version, or templates in the image that differ
from the record stop the emission with the differences named (TrtllmDrift), unless the user
overrides (TrtllmOptions.allow_drift, $TRTFORGE_TRTLLM_ALLOW_DRIFT=1). The python models' code is TensorRT-LLM's:
it is copied from `models_dir` when one is found; otherwise the files to add are listed.
TrtllmOptions(repo="llmapi") writes the LLM-API repository instead (emit_llmapi.py, llmapi.py).
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

from trtforge.builder.trtllm.versions import (
    TrtllmDrift,
    TrtllmRelease,
    drift_allowed,
    installed_tensorrt_llm,
    override_hint,
    release_for,
)
from trtforge.config.runtime import RuntimeConfig
from trtforge.model_repo.params import KV_CACHE_MEMORY, runtime_parameters, scheduler_config
from trtforge.model_repo.pbtxt import config_text, write_model
from trtforge.model_repo.trtllm import configs as C, upstream as U
from trtforge.model_repo.trtllm.files import model_files, stale_models
from trtforge.model_repo.trtllm.launch import launch_note
from trtforge.model_repo.trtllm.mapping import not_carried_over
from trtforge.model_repo.trtllm.templates import differences, facts_of, read_template
from trtforge.model_repo.trtllm.values import (
    PhaseModel,
    TrtllmOptions,
    TrtllmRepoOptions,
    python_model_parameters,
    tensorrt_llm_parameters,
)
from trtforge.models.engine_dir import EngineConfig

log = logging.getLogger(__name__)

# Upstream's disaggregated serving README: context on GPU 0 as MPI rank 1, generation on GPU 1
# as rank 2 (rank 0 is the orchestrator).
PHASES = (PhaseModel("context", gpu_device_ids="0", participant_ids="1"),
          PhaseModel("generation", gpu_device_ids="1", participant_ids="2", chunked_context=False))
IMAGE_MODELS_DIR = "/app/all_models/inflight_batcher_llm"
DEFAULT_OPTIONS = TrtllmOptions()


def emit_trtllm_repo(engine_dir: Path, repo_dir: str | os.PathLike, engine: EngineConfig, *,
                     device: str = RuntimeConfig.device, triton_max_batch_size: int | None = None,
                     exclude_input_in_output: bool = False, kv_cache_memory: str | None = None,
                     disaggregated: bool = False, trtllm: TrtllmOptions = DEFAULT_OPTIONS,
                     **scheduler_overrides: Any) -> Path:
    """Write the trtllm repository for `engine_dir` into `repo_dir` (see module doc); returns it.

    Scheduler overrides are SchedulerConfig fields, validated as for any engine; those without
    a TensorRT-LLM counterpart are reported (logged and written into tensorrt_llm's config)."""
    allow_drift = trtllm.allow_drift
    release = engine_release(engine, trtllm.version, allow_drift)
    scheduling = scheduler_config(engine, scheduler_overrides)
    kv_memory = runtime_parameters(kv_cache_memory=kv_cache_memory)[KV_CACHE_MEMORY]
    opts = TrtllmRepoOptions(
        triton_max_batch_size=triton_max_batch_size or int(engine.build["max_batch_size"]),
        kv_cache_memory=kv_memory or engine.build["kv_cache_memory"],
        exclude_input_in_output=exclude_input_in_output, gpu_device_ids=_gpu_ids(device))
    notes = not_carried_over(scheduling, engine.build)
    configs = _configs(engine_dir, engine, scheduling, opts, disaggregated, release)
    source = find_models_dir(trtllm.models_dir)
    check_templates(template_differences(configs, source), release, allow_drift)
    repo = Path(repo_dir)
    repo.mkdir(parents=True, exist_ok=True)
    for name in stale_models(disaggregated):
        shutil.rmtree(repo / name, ignore_errors=True)
    missing = []
    for name, config in configs.items():
        files, absent = model_files(name, source)
        missing += absent
        header = _header(name, config, engine, source, release,
                         notes if config.backend == "tensorrtllm" else [])
        write_model(repo, name, config_text(config, header), files)
    _report(notes, missing, release)
    if disaggregated:
        log.warning("%s is a disaggregated repository; %s", repo,
                    launch_note(repo.resolve(), release, [p.name for p in PHASES]))
    return repo


def engine_release(engine: EngineConfig, explicit: str | None, allow_drift: bool | None) -> TrtllmRelease:
    """The release to write for (explicit > installed > the engine's), checked against the
    version the engine was built with: TrtllmDrift on any difference, unless overridden."""
    built = engine.versions.get("tensorrt_llm")
    version = explicit or installed_tensorrt_llm() or built
    release = release_for(version, allow_drift)
    if built and version and built.strip() != version.strip() and not drift_allowed(allow_drift):
        raise TrtllmDrift(f"the engine was built with TensorRT-LLM {built}, and the repository would be "
                          f"written for TensorRT-LLM {version} ({'asked for' if explicit else 'installed'}): "
                          f"an engine only loads in the TensorRT-LLM that built it. Rebuild it with "
                          f"{version} or write the repository for {built}; {override_hint()}.")
    return release


def _configs(engine_dir: Path, engine: EngineConfig, scheduling: Any, opts: TrtllmRepoOptions,
             disaggregated: bool, release: TrtllmRelease) -> dict:
    queue = scheduling.max_queue_size
    out = {"ensemble": C.ensemble_config(opts, release, "disaggregated_serving_bls" if disaggregated
                                         else "tensorrt_llm"),
           "preprocessing": C.preprocessing_config(
               opts, queue, python_model_parameters("preprocessing", engine_dir, release), release),
           "postprocessing": C.postprocessing_config(
               opts, python_model_parameters("postprocessing", engine_dir, release), release)}
    if not disaggregated:
        out["tensorrt_llm"] = C.tensorrt_llm_config(
            "tensorrt_llm", opts, queue,
            tensorrt_llm_parameters(engine_dir, engine, scheduling, opts, release), release)
        out["tensorrt_llm_bls"] = C.bls_config(
            "tensorrt_llm_bls", opts, python_model_parameters("tensorrt_llm_bls", engine_dir, release),
            release)
        return out
    for phase in PHASES:
        out[phase.name] = C.tensorrt_llm_config(
            phase.name, opts, queue,
            tensorrt_llm_parameters(engine_dir, engine, scheduling, opts, release, phase), release)
    out["disaggregated_serving_bls"] = C.bls_config(
        "disaggregated_serving_bls", replace(opts, instance_count=1),
        python_model_parameters("disaggregated_serving_bls", engine_dir, release), release)
    return out


def _gpu_ids(device: str) -> str:
    """emit-repo's --device for the tensorrt_llm model: cuda:N → "N", else every visible GPU."""
    kind, _, index = device.partition(":")
    if kind not in ("cpu", "cuda") or (index and not index.isdigit()):
        raise ValueError(f"--device {device!r}: write cpu, cuda or cuda:N")
    return index


def find_models_dir(given: str | os.PathLike | None) -> Path | None:
    """Where TensorRT-LLM's python models are: the argument, $TRTFORGE_TRTLLM_MODELS_DIR, then
    the NGC image's /app/all_models/inflight_batcher_llm; None when none exists."""
    if given is not None:
        if not Path(given).is_dir():
            raise FileNotFoundError(f"--trtllm-models-dir {given}: no such directory (give the "
                                    f"image's {IMAGE_MODELS_DIR})")
        return Path(given)
    for candidate in (os.environ.get("TRTFORGE_TRTLLM_MODELS_DIR"), IMAGE_MODELS_DIR):
        if candidate and Path(candidate).is_dir():
            return Path(candidate)
    return None


def template_differences(configs: dict, source: Path | None) -> list[str]:
    """How the templates in `source` (an image's) differ from what would be written (none: same)."""
    if source is None:
        return []
    out = []
    for name, config in configs.items():
        upstream = name if name not in ("context", "generation") else "tensorrt_llm"
        group = source.parent / "disaggregated_serving" if "disaggregated" in name else source
        template = group / upstream / "config.pbtxt"
        if template.is_file():
            out += differences(facts_of(config), replace(read_template(template), name=name))
    return out


def check_templates(diffs: list[str], release: TrtllmRelease, allow_drift: bool | None) -> None:
    """TrtllmDrift naming every difference between the image's templates and the record of
    `release`; with the override, a warning and the emission goes on."""
    if not diffs:
        return
    text = "\n  ".join(diffs)
    if not drift_allowed(allow_drift):
        raise TrtllmDrift(f"the image's TensorRT-LLM templates differ from the recorded interface of "
                          f"TensorRT-LLM {release.tensorrt_llm} ({release.backend_source} "
                          f"{release.backend_release}); clients and parameters would not match:\n  "
                          f"{text}\nWrite the repository for the image's release (emit-repo --trtllm-version; "
                          f"Python: TrtllmOptions.version), or "
                          f"{override_hint()}.")
    log.warning("going on although the image's templates differ from the record of TensorRT-LLM "
                "%s:\n  %s", release.tensorrt_llm, text)


def _header(name: str, config: Any, engine: EngineConfig, source: Path | None,
            release: TrtllmRelease, notes: list[str]) -> list[str]:
    built = engine.versions.get("tensorrt_llm")
    lines = [f"Written by `trtforge emit-repo`: TensorRT-LLM's `{name}` model for an engine built "
             f"with TensorRT-LLM {built},",
             f"following the templates of TensorRT-LLM {release.tensorrt_llm} "
             f"({release.backend_source}/tree/{_commit_of(release, name)}).",
             "Python model code: TensorRT-LLM's own model.py, "
             + (f"copied from {source}." if source else "not copied (see docs/tensorrt-llm.md).")]
    empty = [k for k, v in sorted(config.parameters.items()) if not v.string_value]
    if empty:
        lines.append("Empty on purpose, read as 'not set' (docs/tensorrt-llm.md says why): "
                     + ", ".join(empty))
    if notes:
        lines.append("Scheduling options TensorRT-LLM does not apply:")
        lines += [f"  {n}" for n in notes]
    return lines


def _commit_of(release: TrtllmRelease, name: str) -> str:
    """The commit the model's template was read at (the record's, per model where it differs)."""
    upstream = "tensorrt_llm" if name in ("context", "generation") else name
    return U.record(release, upstream).get("commit", release.backend_commit)


def _report(notes: list[str], missing: list[str], release: TrtllmRelease) -> None:
    if notes:
        log.warning("not carried over to TensorRT-LLM:\n  %s", "\n  ".join(notes))
    if missing:
        where = f"the image's {IMAGE_MODELS_DIR}" if release.image else f"TensorRT-LLM's {release.models_dir}"
        log.warning("TensorRT-LLM's python models are not in the repository yet; copy these from %s "
                    "(TensorRT-LLM %s), or rerun with --trtllm-models-dir:\n  %s", where,
                    release.tensorrt_llm, "\n  ".join(missing))
