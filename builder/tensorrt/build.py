"""`build-engine --backend tensorrt`: ONNX with PagedAttention plugin nodes → TensorRT plan.

Steps (in the build's temporary directory, so a failure leaves nothing behind):
  1. check that TensorRT >= 10.6 and a CUDA GPU are here (before any work);
  2. load the converted weights, export `rank0.onnx` (onnx_export.py);
  3. register the `trtforge::PagedAttention` plugin, parse the ONNX (strongly typed),
     two optimization profiles over the token dimension, timing cache, build `rank0.engine`;
  4. record the TensorRT version in engine.json; drop `rank0.safetensors` (the ONNX holds the
     weights; docs/architecture.md lists rank0.engine + rank0.onnx for this backend).

Profiles: 0 = decode (1 … max_batch_size tokens), 1 = prefill/mixed (1 … max_num_tokens).
Both allow 1 … max_batch_size sequences, block tables up to ceil(max_seq_len / block_size)
columns and KV pools up to the number of blocks the build's KV budget buys. The executor runs a
step with profile 0 when it has at most max_batch_size tokens, else with profile 1. logits_indices
starts at length 1 in both: a step that samples no row asks for one and drops it
(serving/worker/trt_step.py), so plans built before that change still run such steps.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Any

from trtforge.builder.tensorrt.availability import find_tensorrt
from trtforge.config.fields import parse_bytes
from trtforge.models.errors import BuildError
from trtforge.models.kv_sizing import kv_bytes_per_token

log = logging.getLogger(__name__)

INSTALL_HINT = ("install it with `pip install trtforge[tensorrt]` on a machine with an NVIDIA GPU and driver, "
                "or use the NGC image (see docs/tensorrt.md)")
TIMING_CACHE_ENV = "TRTFORGE_TIMING_CACHE"


def require_tensorrt() -> Any:
    """The `tensorrt` module, or BuildError saying what is missing (TensorRT, its version, a GPU)."""
    trt, problem = find_tensorrt()
    if problem is not None:
        raise BuildError(f"--backend tensorrt: {problem}: {INSTALL_HINT}; or build with --backend torch.")
    return trt


def profile_shapes(cfg) -> list[dict[str, tuple[tuple[int, ...], ...]]]:
    """(min, opt, max) shape of every graph input, for the decode and the prefill profile."""
    m, b = cfg.model, cfg.build
    block = int(b["kv_block_size"])
    max_seqs, max_tokens = int(b["max_batch_size"]), int(b["max_num_tokens"])
    width = math.ceil(int(b["max_seq_len"]) / block)
    blocks = max(1, parse_bytes(b["kv_cache_memory"]) // (kv_bytes_per_token(m, cfg.dtype) * block))
    profiles = []
    for tokens in (max_seqs, max_tokens):
        def rng(lo: int, hi: int) -> tuple[int, int, int]:
            return lo, hi, hi  # opt = max: TensorRT tunes for a full step

        t, s, w, n = rng(1, tokens), rng(1, max_seqs), rng(1, width), rng(1, blocks)
        shapes = {"input_ids": (t,), "positions": (t,), "slot_mapping": (t,),
                  "block_tables": (s, w), "seq_lens": (s,),
                  "query_start_loc": (tuple(x + 1 for x in s),), "logits_indices": (s,)}
        for i in range(m.num_layers):
            shapes[f"kv_cache_{i}"] = ((2, 2, 2), n, (block,) * 3, (m.num_kv_heads,) * 3,
                                        (m.head_dim,) * 3)
        # Transpose per-dimension (min, opt, max) triples into three full shapes.
        profiles.append({name: tuple(zip(*dims)) for name, dims in shapes.items()})
    return profiles


def build_plan(trt: Any, onnx_path: Path, profiles: list[dict], timing_cache: Path | None) -> bytes:
    """Parse `onnx_path` and build a serialized plan with `profiles`; BuildError on failure."""
    from trtforge.plugins.paged_attention import tensorrt_plugin  # importing registers the plugin

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    flags = 0
    strongly_typed = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    # TensorRT 11.0 deprecated the flag (always strongly typed; it is kept and ignored), so the
    # getattr is only a guard against its eventual removal.
    if strongly_typed is not None:
        flags |= 1 << int(strongly_typed)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise BuildError(f"TensorRT could not parse {onnx_path.name}: {errors}")
    config = builder.create_builder_config()
    aliased_io = getattr(trt.PreviewFeature, "ALIASED_PLUGIN_IO_10_03", None)
    if aliased_io is not None:
        config.set_preview_feature(aliased_io, True)
    for index, shapes in enumerate(profiles):
        profile = builder.create_optimization_profile()
        for name, (lo, opt, hi) in shapes.items():
            profile.set_shape(name, lo, opt, hi)
        # IBuilderConfig.add_optimization_profile returns -1 (it does not raise) for a profile
        # it rejects, e.g. one that misses a dynamic input; fail here, not in the build.
        if config.add_optimization_profile(profile) < 0:
            raise BuildError(f"TensorRT rejected optimization profile {index} for {onnx_path.name} "
                             f"(inputs: {', '.join(shapes)})")
    cache_bytes = timing_cache.read_bytes() if timing_cache and timing_cache.is_file() else b""
    cache = config.create_timing_cache(cache_bytes)
    config.set_timing_cache(cache, ignore_mismatch=True)
    with tensorrt_plugin.building_engine():  # the plugin's timing runs see fake inputs
        plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise BuildError("TensorRT failed to build the engine (see the TensorRT log above). Common causes: "
                         "too little GPU memory for --max-num-tokens, or a TensorRT older than 10.6.")
    if timing_cache is not None:
        timing_cache.parent.mkdir(parents=True, exist_ok=True)
        timing_cache.write_bytes(memoryview(config.get_timing_cache().serialize()))
    return bytes(plan)


def build_tensorrt(engine_dir_tmp: str | Path, cfg: Any, timing_cache: str | Path | None = None) -> None:
    """`build_engine(on_tmp_dir=...)` hook: add rank0.onnx + rank0.engine to the temp engine dir.

    timing_cache: file reused across builds (default: $TRTFORGE_TIMING_CACHE if set).
    """
    trt = require_tensorrt()
    from trtforge.builder.tensorrt.onnx_export import check_graph, export_onnx
    from trtforge.models.loader import load_network

    tmp = Path(engine_dir_tmp)
    model = load_network(tmp, cfg, device="cpu")
    onnx_path = export_onnx(model, tmp / "rank0.onnx", block_size=int(cfg.build["kv_block_size"]))
    check_graph(onnx_path, cfg.model.num_layers)
    del model
    cache = timing_cache or os.environ.get(TIMING_CACHE_ENV)
    plan = build_plan(trt, onnx_path, profile_shapes(cfg), Path(cache) if cache else None)
    (tmp / "rank0.engine").write_bytes(plan)
    (tmp / "rank0.safetensors").unlink(missing_ok=True)
    cfg.versions["tensorrt"] = trt.__version__
    log.info("TensorRT %s engine written (%.1f MB)", trt.__version__, len(plan) / 1e6)
