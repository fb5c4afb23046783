"""`build-engine`: HF checkpoint → engine directory, written atomically.

The build happens in a temporary directory beside the target and is renamed into place at the
end, so a failed build leaves nothing behind and a reader never sees a half-written engine.
"""

from __future__ import annotations

import dataclasses
import os
import resource
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from trtforge.builder import checkpoint as ckpt_mod, prequantized
from trtforge.builder.architectures import spec_for
from trtforge.builder.build_config import BuildConfig
from trtforge.builder.convert import convert
from trtforge.builder.convert_sharded import convert_sharded
from trtforge.builder.hf_config import model_config_from_hf
from trtforge.builder.report import BuildReport, make_report
from trtforge.config.scheduler import SchedulerConfig
from trtforge.models.dtypes import DTYPE_BYTES, torch_dtype
from trtforge.models.engine_dir import EngineConfig, trtforge_version, write_engine_json
from trtforge.models.errors import BuildError
from trtforge.models.model_config import ModelConfig
from trtforge.models.tensor_parallel import check_tensor_parallel, mapping


def default_scheduling(build: BuildConfig) -> dict[str, Any]:
    """Scheduler defaults recorded in engine.json; the runtime validates and may override them.
    The iteration budgets are the build's limits (as in TensorRT-LLM, an engine runs at what it
    was built for unless told less); the prefill limits are SchedulerConfig's, capped by them."""
    return {"max_num_tokens": build.max_num_tokens, "max_batch_size": build.max_batch_size,
            "prefill_chunk_size": min(SchedulerConfig.prefill_chunk_size, build.max_num_tokens),
            "prefill_max_seqs": min(SchedulerConfig.prefill_max_seqs, build.max_batch_size)}


def resolve_dtype(requested: str, model: ModelConfig) -> str:
    if requested != "auto":
        return requested
    stored = model.torch_dtype
    return stored if stored in DTYPE_BYTES else "float32"


def build_engine(checkpoint: str, output: str | Path, build: BuildConfig, force: bool = False,
                 scheduling: dict[str, Any] | None = None, progress: bool = True,
                 on_tmp_dir: Any = None) -> tuple[Path, EngineConfig]:
    """Build; returns (engine dir, its config). `on_tmp_dir(tmp, cfg)` lets a backend add files."""
    start = time.perf_counter()
    output = Path(output)
    if output.exists() and not force:
        raise BuildError(f"{output} already exists; pass --force to replace it.")
    src = ckpt_mod.resolve(checkpoint)
    hf = ckpt_mod.load_hf_config(src)
    model = model_config_from_hf(hf)
    model.eos_token_ids = _eos_ids(src, model.eos_token_ids)
    build.validate(model.max_position_embeddings, model.sliding_window, model.rope_max_seq_len)
    if model.attn_logit_softcapping and build.backend == "tensorrt":
        raise BuildError(f"--backend tensorrt cannot build {model.architecture}: it soft-caps its attention "
                         f"scores (attn_logit_softcapping {model.attn_logit_softcapping}), which the TensorRT "
                         f"PagedAttention plugin does not take. Build with --backend torch.")
    if model.num_experts and build.backend != "torch":
        raise BuildError(f"--backend {build.backend} cannot build {model.architecture}: it is a Mixture-of-Experts "
                         f"model ({model.num_experts} experts, top-{model.num_experts_per_tok}), and trtforge's MoE "
                         f"block (routing, experts grouped per token) runs in its torch runtime only: the ONNX "
                         f"export / TensorRT plan and the TensorRT-LLM hand-off do not take it. Build with "
                         f"--backend torch.")
    ckpt_mod.check_tokenizer(src)
    dtype = resolve_dtype(build.dtype, model)
    source = prequantized.detect(hf)  # a pre-quantized checkpoint (GPTQ, AWQ, compressed-tensors), or None
    quant = _quantization(build, model) if source is None else _prequantized(build, model, source)
    check_tensor_parallel(model, build.tp_size)
    spec = spec_for([model.architecture])
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.building-", dir=output.parent))
    try:
        with ckpt_mod.TensorReader(src, allow_pickle=build.allow_pickle) as reader:
            if build.tp_size > 1:
                sizes = convert_sharded(model, spec, reader, hf, torch_dtype(dtype), tmp, build.tp_size,
                                        progress=progress)
            else:
                sizes = convert(model, spec, reader, hf, torch_dtype(dtype), tmp / "rank0.safetensors",
                                progress=progress, quant=quant, prequant=source)
        for f in ckpt_mod.tokenizer_files(src):
            shutil.copy2(f, tmp / f.name)
        report = make_report(model, build, dtype, sizes["parameters"], sizes["weight_bytes"],
                             quant and quant["scheme"], sizes["weight_bytes_unquantized"],
                             source.record() if source else None)
        if report.kv_num_blocks * build.kv_block_size < build.max_seq_len:
            raise BuildError(
                f"--kv-cache-memory {build.kv_cache_memory} holds {report.kv_tokens} tokens, fewer than one "
                f"sequence of --max-seq-len {build.max_seq_len} ({report.kv_bytes_per_token} bytes/token): raise "
                f"--kv-cache-memory to at least {report.kv_bytes_per_token * build.max_seq_len} bytes or lower "
                f"--max-seq-len.")
        cfg = EngineConfig(model=model, build=build.to_dict(), dtype=dtype, backend=build.backend, quantization=quant,
                           scheduling={**default_scheduling(build), **(scheduling or {})},
                           versions={"trtforge": trtforge_version(), "torch": torch.__version__,
                                     "transformers": _transformers_version(), "tensorrt": None},
                           tp_size=build.tp_size,
                           tensor_parallel=mapping(model, build.tp_size) if build.tp_size > 1 else None,
                           speculative_config=_speculative_default(build))
        if on_tmp_dir is not None:
            on_tmp_dir(tmp, cfg)
        _finish_report(report, start)
        cfg.report = report.to_dict()
        write_engine_json(tmp, cfg)
        _set_default_mode(tmp)
        if output.exists():
            shutil.rmtree(output)
        tmp.rename(output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return output, cfg


def _speculative_default(build: BuildConfig) -> dict[str, Any] | None:
    """engine.json's `speculative_config`: the engine's default speculation (None: none)."""
    spec = build.speculative()
    return None if spec is None else dataclasses.asdict(spec)


def _quantization(build: BuildConfig, model: ModelConfig) -> dict[str, Any] | None:
    """engine.json's `quantization` record, after checking the layers' shapes allow it; None: not quantized."""
    if build.quantization == "none":
        return None
    from trtforge.models.quantized_layers import QUANTIZED_LAYERS, quantized_in_features

    build.check_quantization_shapes(quantized_in_features(model), model.hidden_size)
    head = build.lm_head_quantization if build.quantize_lm_head else None
    return {"scheme": build.quantization, "group_size": build.group_size if build.quantization == "int4_wo" else None,
            "layers": [p for p in QUANTIZED_LAYERS if p in quantized_in_features(model)], "scales_dtype": "float32",
            "lm_head": head, "lm_head_group_size": build.group_size if head == "int4_wo" else None,
            "method": "symmetric round-to-nearest, weight-only"}


def _prequantized(build: BuildConfig, model: ModelConfig, source: prequantized.SourceQuantization) -> dict[str, Any]:
    """engine.json's `quantization` record of a pre-quantized checkpoint, after refusing what conflicts with
    it: its decoder linears keep the checkpoint's codes (int4_wo / int8_wo, zero points and act-order
    where it has them); the LM head and embeddings stay as the checkpoint has them (float)."""
    from trtforge.models.quantized_layers import QUANTIZED_LAYERS, quantized_in_features

    what = f"a pre-quantized {source.format} checkpoint ({source.bits}-bit, {'' if source.sym else 'a'}symmetric)"
    if build.quantization != "none":
        raise BuildError(f"--quantization {build.quantization} conflicts with {what}: trtforge builds it from the "
                         f"checkpoint's own codes (as {source.scheme}) and does not re-quantize. Drop --quantization.")
    if build.backend != "torch":
        raise BuildError(f"--backend {build.backend} cannot build {what}: only the torch backend runs quantized "
                         f"weights. Build with --backend torch.")
    if build.tp_size > 1:
        raise BuildError(f"--tp-size {build.tp_size} cannot build {what}: sharded engines hold unquantized weights.")
    if model.num_experts or model.family == "gpt2":
        raise BuildError(f"{model.architecture}: {what} is not supported for this family yet (pre-quantized "
                         f"checkpoints are read for the dense Llama-style families: Llama, Mistral, Qwen2, Qwen3).")
    layers = quantized_in_features(model)
    if source.bits == 4:
        for layer, k in layers.items():
            if k % source.group_size or source.group_size % 2:
                raise BuildError(f"{source.format} group_size {source.group_size} does not split {layer}'s "
                                 f"{k} inputs into whole groups of an even size.")
    return {"scheme": source.scheme, "group_size": source.group_size if source.bits == 4 else None,
            "layers": [p for p in QUANTIZED_LAYERS if p in layers], "scales_dtype": "float32",
            "lm_head": None, "lm_head_group_size": None, "zero_points": not source.sym, "act_order": source.desc_act,
            "method": f"pre-quantized {source.format}: the checkpoint's codes, scales"
                      f"{'' if source.sym else ' and zero points'} as they are (no re-quantization)",
            "source_quantization": source.record()}


def _eos_ids(src: Path, from_config: list[int]) -> list[int]:
    """config.json's EOS ids plus generation_config.json's (Qwen2.5-Instruct lists <|im_end|> only
    there), which is what transformers' generate() stops on."""
    if not (src / "generation_config.json").is_file():
        return from_config
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(str(src)).eos_token_id
    except Exception:  # noqa: BLE001 - a malformed generation config only loses the extra stop ids
        return from_config
    extra = eos if isinstance(eos, list) else ([] if eos is None else [eos])
    return list(dict.fromkeys([*from_config, *(int(e) for e in extra)]))


def _set_default_mode(directory: Path) -> None:
    """mkdtemp creates 0700; give the engine the permissions a plain mkdir would have."""
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)


def _finish_report(report: BuildReport, start: float) -> None:
    report.build_seconds = round(time.perf_counter() - start, 2)
    report.peak_rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _transformers_version() -> str:
    import transformers

    return transformers.__version__
