"""Write the LLM-API repository (llmapi.py) for a Hugging Face checkpoint: nothing is built.

The checkpoint is read for its shape only (the KV budget in tokens, the longest sequence);
trtforge's build options (BuildConfig: limits, dtype, --kv-cache-memory) and scheduling options
(SchedulerConfig) become LLM API arguments in model.yaml, the rest is reported as for the
inflight_batcher_llm repository. The release is picked and checked as emit.py does (explicit >
installed > the default), and the image's llmapi template is compared with the record.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

from trtforge.builder import checkpoint as ckpt_mod
from trtforge.builder.build import default_scheduling, resolve_dtype
from trtforge.builder.build_config import BuildConfig
from trtforge.builder.hf_config import model_config_from_hf
from trtforge.builder.trtllm.versions import installed_tensorrt_llm, release_for
from trtforge.config.scheduler import SchedulerConfig
from trtforge.model_repo.pbtxt import config_text, write_model
from trtforge.model_repo.trtllm import llmapi, upstream as U
from trtforge.model_repo.trtllm.emit import check_templates, find_models_dir
from trtforge.model_repo.trtllm.files import LAYOUTS, model_files
from trtforge.model_repo.trtllm.mapping import not_carried_over
from trtforge.model_repo.trtllm.templates import differences, facts_of, read_template
from trtforge.model_repo.trtllm.values import TrtllmOptions
from trtforge.models.kv_sizing import kv_num_blocks

log = logging.getLogger(__name__)
LLMAPI_OPTIONS = TrtllmOptions(repo="llmapi")


def emit_llmapi_repo(checkpoint: str | os.PathLike, repo_dir: str | os.PathLike, *,
                     build: BuildConfig | None = None, trtllm: TrtllmOptions = LLMAPI_OPTIONS,
                     **scheduler_overrides: Any) -> Path:
    """Write REPO/tensorrt_llm (config.pbtxt, 1/model.yaml, TensorRT-LLM's model.py files when
    found) serving `checkpoint` with TensorRT-LLM's PyTorch backend; returns the repository."""
    allow_drift = trtllm.allow_drift
    release = release_for(trtllm.version or installed_tensorrt_llm(), allow_drift)
    src = ckpt_mod.resolve(str(checkpoint))
    model = model_config_from_hf(ckpt_mod.load_hf_config(src))
    build = (build or BuildConfig(backend="trtllm")).validate(model.max_position_embeddings,
                                                              model.sliding_window)
    dtype = resolve_dtype(build.dtype, model)
    scheduling = SchedulerConfig.for_engine(build.to_dict(), default_scheduling(build), None,
                                            scheduler_overrides)
    kv_tokens = kv_num_blocks(model, dtype, build.kv_block_size, build.kv_cache_bytes) * build.kv_block_size
    config = llmapi.llmapi_config(release)
    source = find_models_dir(trtllm.models_dir)
    template = source / llmapi.TEMPLATE if source is not None else None
    if template is not None and template.is_file():
        check_templates(differences(facts_of(config), read_template(template)), release, allow_drift)
    args = llmapi.llm_arguments(llmapi.model_source(checkpoint), build, dtype, kv_tokens, scheduling, release)
    # max_num_tokens / max_batch_size are run-time LLM arguments here: nothing built to differ from.
    notes = not_carried_over(scheduling, {"max_num_tokens": scheduling.max_num_tokens,
                                          "max_batch_size": scheduling.max_batch_size})
    repo = Path(repo_dir)
    repo.mkdir(parents=True, exist_ok=True)
    for name in set(LAYOUTS[False]) | set(LAYOUTS[True]):  # another layout's models must go
        if name != llmapi.MODEL:
            shutil.rmtree(repo / name, ignore_errors=True)
    files, missing = model_files(llmapi.MODEL, source, llmapi.FILES)
    commit = U.record(release, llmapi.MODEL, "llmapi").get("commit", release.backend_commit)
    header = [f"Written by `trtforge emit-repo`: TensorRT-LLM's LLM-API model (all_models/llmapi) of "
              f"TensorRT-LLM {release.tensorrt_llm} ({release.backend_source}/tree/{commit}).",
              "Batching and decoupling: triton_config in 1/model.yaml, as upstream's template says."]
    write_model(repo, llmapi.MODEL, config_text(config, header), files)
    (repo / llmapi.MODEL / "1" / "model.yaml").write_text(llmapi.model_yaml_text(
        args, [*header[:1], "LLM(...) arguments from trtforge's build and scheduling options."]
        + [f"Not carried over: {n}" for n in notes]))
    if notes:
        log.warning("not carried over to TensorRT-LLM's LLM API:\n  %s", "\n  ".join(notes))
    if missing:
        log.warning("TensorRT-LLM's LLM-API model files are not in the repository yet; copy these from "
                    "all_models/llmapi of TensorRT-LLM %s, or rerun with --trtllm-models-dir:\n  %s",
                    release.tensorrt_llm, "\n  ".join(missing))
    return repo
