"""Before `trtforge serve` starts Triton on a repository with TensorRT-LLM models: can it work here?

Checked, each with a message that says what to do instead of a model that fails to load:
  * the tritonserver's backend directory has `tensorrtllm` (the NGC trtllm image has it; the
    nvidia-pytriton wheel and the plain images do not);
  * each engine was built by the TensorRT-LLM installed here (engines are not portable);
  * TensorRT-LLM's python models (model.py) are in the repository;
  * a disaggregated repository (MPI participants) is started the way upstream documents, with
    its launch script and the release's KV-transfer environment (launch.py), not as one plain
    tritonserver;
  * an LLM-API repository (llmapi.py) has TensorRT-LLM installed and its model.py files.
"""

from __future__ import annotations

import json
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from trtforge.builder.trtllm.versions import RELEASES, TARGET, installed_tensorrt_llm, version_mismatch
from trtforge.model_repo.pbtxt import read_config
from trtforge.model_repo.trtllm import llmapi
from trtforge.model_repo.trtllm.files import MODEL_FILES
from trtforge.model_repo.trtllm.launch import launch_note
from trtforge.models.engine_dir import ENGINE_JSON, read_engine_config
from trtforge.models.errors import EngineLoadError


def _configs(repo: Path) -> dict[str, mc.ModelConfig]:
    out = {}
    for path in sorted(repo.glob("*/config.pbtxt")):
        try:
            out[path.parent.name] = read_config(path)
        except text_format.ParseError:
            continue  # Triton reports a broken config itself, with its own message
    return out


def engine_version(engine_dir: Path) -> str | None:
    """The TensorRT-LLM version an engine directory was built with (engine.json, else
    TensorRT-LLM's own config.json); EngineLoadError for an engine.json that does not read."""
    if (engine_dir / ENGINE_JSON).is_file():
        built = read_engine_config(engine_dir, verify_checksums=False).versions.get("tensorrt_llm")
        if built:
            return str(built)
    config = engine_dir / "config.json"
    if config.is_file():
        value = json.loads(config.read_text())
        if isinstance(value, dict) and value.get("version"):
            return str(value["version"])
    return None


def check_trtllm_repo(repo: Path, backend_dir: Path, installed: str | None = None) -> None:
    """Raise RuntimeError (FileNotFoundError for missing files) when `repo` cannot be served by
    the tritonserver whose backends are in `backend_dir`; return quietly for other repositories."""
    configs = _configs(Path(repo))
    llm = {name: c for name, c in configs.items() if c.backend == "tensorrtllm"}
    if not llm:
        _check_llmapi_repo(Path(repo), configs, installed)
        return
    if not (Path(backend_dir) / "tensorrtllm").is_dir():
        raise RuntimeError(
            f"{repo} has TensorRT-LLM models ({', '.join(llm)}) for Triton's `tensorrtllm` "
            f"backend, and the tritonserver found here has none ({backend_dir}/tensorrtllm does "
            f"not exist). Serve it inside {TARGET.image}: see docs/tensorrt-llm.md.")
    if any(c.parameters["participant_ids"].string_value for c in llm.values()
           if "participant_ids" in c.parameters):
        release = _repo_release(llm)
        raise RuntimeError(f"{repo} is a disaggregated repository ({', '.join(llm)} are MPI "
                           f"participants); {launch_note(Path(repo), release, list(llm))}")
    installed = installed if installed is not None else installed_tensorrt_llm()
    for name, config in llm.items():
        engine = Path(config.parameters["gpt_model_path"].string_value)
        try:
            built = engine_version(engine)
        except EngineLoadError as exc:
            raise RuntimeError(f"{name}: {exc}") from None
        problem = version_mismatch(built, installed, engine=f"the engine {engine}")
        if problem:
            raise RuntimeError(f"{name}: {problem}.")
    missing = [f"{name}/1/{dest}" for name in configs for dest in MODEL_FILES.get(name, {})
               if not (Path(repo) / name / "1" / dest).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{repo} lacks TensorRT-LLM's python model files {missing}; rerun `trtforge emit-repo` "
            "in the image (it copies them from /app/all_models) or copy them from there.")


def _repo_release(llm: dict[str, mc.ModelConfig]):
    """The release of the engines a repository serves (the default when none records one)."""
    for config in llm.values():
        try:
            built = engine_version(Path(config.parameters["gpt_model_path"].string_value))
        except EngineLoadError:
            continue
        if built in RELEASES:
            return RELEASES[built]
    return TARGET


def _check_llmapi_repo(repo: Path, configs: dict[str, mc.ModelConfig], installed: str | None) -> None:
    """An LLM-API repository: its python model imports tensorrt_llm, so it must be installed,
    and TensorRT-LLM's model.py files must be there."""
    config = configs.get(llmapi.MODEL)
    if config is None or config.backend != "python" or not (repo / llmapi.MODEL / "1" / "model.yaml").is_file():
        return
    installed = installed if installed is not None else installed_tensorrt_llm()
    if installed is None:
        raise RuntimeError(f"{repo} is a TensorRT-LLM LLM-API repository, whose python model imports "
                           "tensorrt_llm, which is not installed here; serve it in an image with "
                           "TensorRT-LLM (docs/tensorrt-llm.md)")
    missing = [f"{llmapi.MODEL}/1/{dest}" for dest in llmapi.FILES
               if not (repo / llmapi.MODEL / "1" / dest).is_file()]
    if missing:
        raise FileNotFoundError(f"{repo} lacks TensorRT-LLM's python model files {missing}; rerun "
                                "`emit-repo` in the image or copy them from all_models/llmapi.")
