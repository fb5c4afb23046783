"""Before `trtforge serve` starts Triton on a repository with TensorRT-LLM models: can it work here?

Checked, each with a message that says what to do instead of a model that fails to load:
  * the tritonserver's backend directory has `tensorrtllm` (the NGC trtllm image has it; the
    nvidia-pytriton wheel and the plain images do not);
  * each engine was built by the TensorRT-LLM installed here (engines are not portable);
  * TensorRT-LLM's python models (model.py) are in the repository;
  * a disaggregated repository (MPI participants) is started the way upstream documents, with
    its launch script, not as one plain tritonserver.
"""

from __future__ import annotations

import json
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from trtforge.builder.trtllm.versions import TARGET, version_mismatch
from trtforge.model_repo.pbtxt import read_config
from trtforge.model_repo.trtllm.files import MODEL_FILES
from trtforge.models.engine_dir import ENGINE_JSON, read_engine_config
from trtforge.models.errors import EngineLoadError


def installed_tensorrt_llm() -> str | None:
    """TensorRT-LLM's version from its package metadata (importing it takes seconds and a GPU)."""
    try:
        return version("tensorrt_llm")
    except PackageNotFoundError:
        return None


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
        return
    if not (Path(backend_dir) / "tensorrtllm").is_dir():
        raise RuntimeError(
            f"{repo} has TensorRT-LLM models ({', '.join(llm)}) for Triton's `tensorrtllm` "
            f"backend, and the tritonserver found here has none ({backend_dir}/tensorrtllm does "
            f"not exist). Serve it inside {TARGET.image}: see docs/tensorrt-llm.md.")
    if any(c.parameters["participant_ids"].string_value for c in llm.values()
           if "participant_ids" in c.parameters):
        raise RuntimeError(
            f"{repo} is a disaggregated repository ({', '.join(llm)} are MPI participants); "
            "start it in the image the way upstream documents: python3 "
            "/app/scripts/launch_triton_server.py --world_size 3 --tensorrt_llm_model_name "
            f"{','.join(llm)} --multi-model --disable-spawn-processes --model_repo {repo}")
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
