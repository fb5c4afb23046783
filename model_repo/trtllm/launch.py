"""How upstream starts a disaggregated trtllm repository: MPI, an orchestrator, and the KV-transfer
environment of the release (builder/trtllm/versions.py `kv_transfer_env`).

`context` and `generation` are MPI participants of one executor world with an orchestrator as
rank 0 (upstream's all_models/disaggregated_serving/README.md): the release's launch script starts
tritonserver under mpirun and hands its own environment to the ranks it starts on this host. The
KV cache moves from the context to the generation executor through the executor's cache
transceiver, whose transport the environment selects; without it TensorRT-LLM 0.19's executors
have no transport to hand the KV over with.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from trtforge.builder.trtllm.versions import TrtllmRelease


def launch_command(repo: Path, release: TrtllmRelease, llm_models: list[str]) -> str:
    """The shell command that serves the disaggregated repository `repo` in the release's image
    (world size: one rank per tensorrt_llm model, each tp*pp = 1 here, plus the orchestrator)."""
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(release.kv_transfer_env.items()))
    args = ["python3", release.launch_script, "--world_size", str(len(llm_models) + 1),
            "--tensorrt_llm_model_name", ",".join(llm_models), "--multi-model",
            "--disable-spawn-processes", "--model_repo", str(repo)]
    return (f"{env} " if env else "") + " ".join(shlex.quote(a) for a in args)


def launch_note(repo: Path, release: TrtllmRelease, llm_models: list[str]) -> str:
    """What `emit-repo` and `trtforge serve` print for a disaggregated repository."""
    env = ", ".join(f"{k}={v}" for k, v in sorted(release.kv_transfer_env.items())) or "none"
    return (f"start it the way upstream documents, in the image with TensorRT-LLM "
            f"{release.tensorrt_llm}:\n  {launch_command(repo, release, llm_models)}\n"
            f"(KV-transfer environment: {env}; source: {release.kv_transfer_why})")
