"""`trtforge export-onnx` and `trtforge verify-onnx`: the TensorRT path's ONNX half, on CPU.

    trtforge export-onnx ENGINE_DIR OUT_DIR [--dtype float32]   → OUT_DIR/rank0.onnx (+ export.json)
    trtforge verify-onnx OUT_DIR                                → ONNX Runtime vs the torch engine
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from trtforge.models.errors import BuildError

EXPORT_JSON = "export.json"
DTYPE_CHOICES = ("engine", "float32", "float16", "bfloat16")


def _load(engine_dir: str, dtype: str):
    import torch

    from trtforge.models.engine_dir import read_engine_config
    from trtforge.models.loader import load_network

    cfg = read_engine_config(engine_dir)
    model = load_network(engine_dir, cfg, device="cpu")
    if dtype != "engine":
        model = model.to(getattr(torch, dtype))
    return cfg, model


@click.command("export-onnx", context_settings={"show_default": True})
@click.argument("engine_dir", type=click.Path(exists=True, file_okay=False))
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--dtype", type=click.Choice(DTYPE_CHOICES), default="engine",
              help="Graph dtype; `engine` keeps the engine's. ONNX Runtime checks need float32.")
def export_onnx_cmd(engine_dir: str, out_dir: str, dtype: str) -> None:
    """Export a torch-backend ENGINE_DIR as ONNX with one trtforge::PagedAttention node per layer."""
    # Imported here: the paged_attention package imports torch, which `trtforge --help` must not.
    from trtforge.builder.tensorrt.onnx_export import check_graph, export_onnx
    from trtforge.plugins.paged_attention.names import OP_TYPE, QUALIFIED_NAME

    try:
        cfg, model = _load(engine_dir, dtype)
        out = Path(out_dir)
        path = export_onnx(model, out / "rank0.onnx", block_size=cfg.block_size)
        counts = check_graph(path, cfg.model.num_layers)
    except BuildError as exc:
        raise click.ClickException(str(exc)) from None
    (out / EXPORT_JSON).write_text(json.dumps({
        "engine_dir": str(Path(engine_dir).resolve()), "dtype": str(next(model.parameters()).dtype),
        "kv_block_size": cfg.block_size, "num_layers": cfg.model.num_layers}, indent=2))
    click.echo(f"wrote {path} ({sum(counts.values())} nodes, "
               f"{counts.get(QUALIFIED_NAME, 0)} {OP_TYPE})")


@click.command("verify-onnx", context_settings={"show_default": True})
@click.argument("out_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--engine-dir", type=click.Path(exists=True, file_okay=False), default=None,
              help="Torch engine to compare with (default: the one recorded by export-onnx).")
@click.option("--atol", type=float, default=1e-4, help="Absolute logits tolerance.")
@click.option("--rtol", type=float, default=1e-4, help="Tolerance relative to the largest |logit|.")
def verify_onnx_cmd(out_dir: str, engine_dir: str | None, atol: float, rtol: float) -> None:
    """Run OUT_DIR/rank0.onnx with ONNX Runtime on five steps (a prefill, a decode, a mixed step,
    a prompt's first chunk that samples no token, and the chunk that finishes it) and compare its
    logits and KV pools with the torch engine; exit 1 beyond tolerance."""
    from trtforge.builder.tensorrt.onnx_export import check_graph
    from trtforge.builder.tensorrt.onnx_verify import verify

    out = Path(out_dir)
    record_path = out / EXPORT_JSON
    if engine_dir is None:
        if not record_path.is_file():
            raise click.ClickException(f"{out} has no {EXPORT_JSON}: export it with `trtforge export-onnx "
                                       "ENGINE_DIR OUT_DIR`, or pass --engine-dir")
        engine_dir = json.loads(record_path.read_text())["engine_dir"]
    try:
        cfg, model = _load(engine_dir, "float32")
        check_graph(out / "rank0.onnx", cfg.model.num_layers)
        report = verify(model, out / "rank0.onnx", block_size=cfg.block_size, atol=atol, rtol=rtol)
    except (BuildError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(report.summary())
    if not report.ok:
        raise click.ClickException("the ONNX graph's results differ from the torch engine beyond tolerance")
