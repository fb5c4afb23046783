"""`trtforge`: the one command line. Sub-commands:

    build            = build-engine (HF checkpoint → engine directory)
    demo-checkpoint  random-weight checkpoint with a real tokenizer (quickstart, tests, benchmarks)
    generate         run prompts through an engine with in-flight batching
    tp-worker        ranks > 0 of a tensor-parallel engine on another host (docs/scale-out.md)
    emit-repo/serve/client    Triton model repository, real tritonserver, tritonclient
    export-onnx/verify-onnx   the TensorRT path's ONNX graph, checked with ONNX Runtime on CPU
    bench            offline and serving benchmarks
"""

from __future__ import annotations

import sys

import click

from trtforge.cli.build import build_engine
from trtforge.cli.generate import generate
from trtforge.models.errors import BuildError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="trtforge")
def main() -> None:
    """trtforge: Hugging Face checkpoint → paged-KV engine → Triton Inference Server."""


main.add_command(build_engine, "build")
main.add_command(generate)


@main.command("demo-checkpoint")
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--arch", type=click.Choice(["qwen2", "llama", "gpt2", "qwen3", "mistral", "phi3", "gemma2", "gemma3"]),
              default="qwen2", show_default=True)
@click.option("--size", type=click.Choice(["tiny", "0.5b"]), default="tiny", show_default=True,
              help="tiny: 2 layers, hidden 64. 0.5b: Qwen2.5-0.5B's shapes (≈2 GB in float32).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--train-seconds", type=float, default=0.0, show_default=True,
              help="tiny only: fit the random weights to the bundled English text for this long, so "
                   "the demo continues a prompt with its phrases (0: random weights saying random words).")
def demo_checkpoint(directory: str, arch: str, size: str, seed: int, train_seconds: float) -> None:
    """Write a RANDOM-WEIGHT checkpoint (real tokenizer, trained locally) for demos and benchmarks."""
    from trtforge.builder.demo_checkpoint import write_demo_checkpoint

    try:
        out = write_demo_checkpoint(directory, arch=arch, size=size, seed=seed, train_seconds=train_seconds)
    except BuildError as exc:
        raise click.ClickException(str(exc)) from None
    trained = f", then trained {train_seconds:g} s on the demo text" if train_seconds > 0 else ""
    click.echo(f"random-weight {arch} ({size}) checkpoint{trained} written to {out}")


@main.command("tp-worker")
@click.argument("engine_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--device", default="cpu", show_default=True, help="cpu (gloo) or cuda (NCCL; GPU = LOCAL_RANK).")
def tp_worker(engine_dir: str, device: str) -> None:
    """Run ranks > 0 of a tensor-parallel engine on this host (docs/scale-out.md): with RANK/WORLD_SIZE,
    or NNODES/NODE_RANK, and MASTER_ADDR/MASTER_PORT of rank 0's host, which runs `trtforge generate`,
    `trtforge bench offline` or the Triton model on the same engine."""
    from trtforge.serving.worker.tp_worker import main as worker_main

    sys.exit(worker_main([engine_dir, "--device", device]))


def _add_optional_commands() -> None:
    """Sub-commands living next to what they drive: ONNX/TensorRT (builder), benchmarks (here), and
    the Triton side (model_repo, a later stage: reached only from this entry point, lazily)."""
    from trtforge.cli.bench import bench
    from trtforge.cli.dynamo import dynamo_worker_command
    from trtforge.cli.onnx import export_onnx_cmd, verify_onnx_cmd
    from trtforge.cli.triton import client_command, emit_repo_command, serve_command

    for cmd in (emit_repo_command, serve_command, client_command, export_onnx_cmd, verify_onnx_cmd, bench,
                dynamo_worker_command):
        main.add_command(cmd)


_add_optional_commands()

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
