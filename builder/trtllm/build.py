"""`build-engine --backend trtllm`: the Hugging Face checkpoint → a TensorRT-LLM engine.

Steps (in the build's temporary directory, so that a failure leaves nothing behind):
  1. before any work, check that `tensorrt_llm` imports and a CUDA GPU is here
     (`require_tensorrt_llm`), else say which image has both;
  2. trtforge's usual build checks the checkpoint, limits and KV budget and copies the tokenizer;
  3. `build_with_tensorrt_llm` — the one place that calls TensorRT-LLM — builds through its LLM
     API (`LLM(model=CHECKPOINT, build_config=BuildConfig(...))`, then `llm.save(dir)`), with the
     options `trtllm_build_options` maps from ours; the engine directory gets TensorRT-LLM's
     `config.json` + `rank0.engine`;
  4. our converted `rank0.safetensors` is dropped (the engine holds the weights) and engine.json
     records backend trtllm with the TensorRT-LLM and TensorRT versions; every file is checksummed.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable

from trtforge.builder.build_config import BuildConfig
from trtforge.builder.trtllm.options import TrtllmBuildOptions, check_block_size, trtllm_build_options
from trtforge.builder.trtllm.versions import ALLOW_DRIFT_ENV, TARGET, TrtllmDrift, TrtllmRelease, release_for
from trtforge.models.errors import BuildError

log = logging.getLogger(__name__)

INSTALL_HINT = (f"run build-engine inside NVIDIA's Triton TensorRT-LLM image, which has "
                f"TensorRT-LLM {TARGET.tensorrt_llm}, TensorRT and the `tensorrtllm` Triton "
                f"backend: `docker run --gpus all -it -v $PWD:/work {TARGET.image}`, then "
                "`pip install --no-deps /work` and run the same command there "
                "(docs/tensorrt-llm.md)")


def require_tensorrt_llm() -> Any:
    """The `tensorrt_llm` module, or BuildError saying what is missing and where to get it."""
    try:
        import tensorrt_llm
    except ImportError as exc:
        raise BuildError(f"--backend trtllm builds with TensorRT-LLM, which cannot be imported here "
                         f"({exc}): {INSTALL_HINT}.") from None
    import torch

    if not torch.cuda.is_available():
        raise BuildError("--backend trtllm builds on an NVIDIA GPU, and torch sees no CUDA device "
                         f"here; {INSTALL_HINT}.")
    check_installed_version(getattr(tensorrt_llm, "__version__", None))
    return tensorrt_llm


def check_installed_version(installed: str | None, allow_drift: bool | None = None) -> TrtllmRelease:
    """The recorded release of the installed TensorRT-LLM; BuildError when none is recorded (an
    engine it builds would get a repository written for another release), unless overridden."""
    try:
        release = release_for(installed or "(unknown)", allow_drift, what="the installed TensorRT-LLM")
    except TrtllmDrift as exc:
        raise BuildError(f"--backend trtllm: {exc}") from None
    if release.tensorrt_llm != installed:
        log.warning("TensorRT-LLM %s is installed, which trtforge has no record of; going on as %s "
                    "asks, with the interface of %s", installed, ALLOW_DRIFT_ENV, release.tensorrt_llm)
    return release


def trtllm_hook(checkpoint: str, build: BuildConfig) -> Callable[[Path, Any], None]:
    """`build_engine(on_tmp_dir=...)` hook building `checkpoint` with TensorRT-LLM.

    Call it before the build starts: it checks for TensorRT-LLM, a GPU and the options that
    TensorRT-LLM refuses at once, before trtforge converts anything."""
    require_tensorrt_llm()
    check_block_size(build.kv_block_size)

    def hook(tmp: Path, cfg: Any) -> None:
        from trtforge.builder import checkpoint as ckpt_mod
        from trtforge.models.kv_sizing import kv_num_blocks

        built = BuildConfig(**cfg.build)  # validated: max_seq_len filled
        blocks = kv_num_blocks(cfg.model, cfg.dtype, built.kv_block_size, built.kv_cache_bytes)
        options = trtllm_build_options(built, cfg.dtype, blocks * built.kv_block_size)
        versions = build_with_tensorrt_llm(ckpt_mod.resolve(checkpoint), Path(tmp), options)
        (Path(tmp) / "rank0.safetensors").unlink(missing_ok=True)
        cfg.versions.update(versions)

    return hook


def build_with_tensorrt_llm(checkpoint_dir: Path, out_dir: Path,
                            options: TrtllmBuildOptions) -> dict[str, str]:
    """Build and save a TensorRT-LLM engine for `checkpoint_dir` into `out_dir`; returns the
    TensorRT-LLM and TensorRT versions. The only code in trtforge that calls TensorRT-LLM."""
    trtllm = require_tensorrt_llm()
    import tensorrt
    from tensorrt_llm.builder import BuildConfig as TrtllmBuildConfig
    from tensorrt_llm.llmapi import KvCacheConfig

    build_config = TrtllmBuildConfig(**options.build_config_kwargs())
    for name, value in options.plugin.items():
        if not hasattr(build_config.plugin_config, name):  # a renamed option must not be skipped
            raise BuildError(f"TensorRT-LLM {trtllm.__version__} has no plugin option {name!r}; "
                             f"trtforge maps its options for TensorRT-LLM {TARGET.tensorrt_llm}.")
        setattr(build_config.plugin_config, name, value)
    kv_cache = KvCacheConfig(max_tokens=options.kv_cache_max_tokens)
    try:
        llm = _llm_class(trtllm)(model=str(checkpoint_dir), dtype=options.dtype,
                                 build_config=build_config, kv_cache_config=kv_cache)
    except Exception as exc:  # TensorRT-LLM raises many kinds; keep its message
        raise BuildError(f"TensorRT-LLM {trtllm.__version__} could not build {checkpoint_dir}: "
                         f"{type(exc).__name__}: {exc}") from exc
    try:
        llm.save(str(out_dir))
    finally:
        getattr(llm, "shutdown", getattr(llm, "_shutdown", lambda: None))()
    if not (out_dir / "rank0.engine").is_file():
        raise BuildError(f"TensorRT-LLM saved no rank0.engine into {out_dir}.")
    return {"tensorrt_llm": trtllm.__version__, "tensorrt": tensorrt.__version__}


def _llm_class(trtllm: Any) -> Any:
    """The LLM API class that builds TensorRT engines: `tensorrt_llm.LLM` up to 0.x; from 1.0 on
    `tensorrt_llm.LLM` is the PyTorch flow and the engine builder moved to `_tensorrt_engine`."""
    try:
        from tensorrt_llm._tensorrt_engine import LLM
    except ImportError:
        return trtllm.LLM
    return LLM
