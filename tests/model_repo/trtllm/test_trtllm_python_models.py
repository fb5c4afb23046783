"""TensorRT-LLM's own preprocessing/postprocessing models, loaded by a real tritonserver with the
configs trtforge writes: the parameters are read the way their model.py reads them, and the
tokenizer in the engine directory (next to TensorRT-LLM's config.json) encodes and decodes.

Their model.py is TensorRT-LLM's and not part of trtforge: the test runs where one is found
($TRTFORGE_TRTLLM_MODELS_DIR, e.g. a tensorrtllm_backend v0.19.0 checkout's
all_models/inflight_batcher_llm, or the NGC image's /app/all_models/inflight_batcher_llm) and is
skipped elsewhere, saying so. Both models run on CPU; tensorrt_llm itself needs the image.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.model_repo.engines import engine_json
from trtforge.builder.trtllm.versions import TARGET

MODELS_DIR = next((Path(p) for p in (os.environ.get("TRTFORGE_TRTLLM_MODELS_DIR"),
                                     "/app/all_models/inflight_batcher_llm")
                   if p and Path(p, "preprocessing", "1", "model.py").is_file()), None)

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(
    MODELS_DIR is None, reason="no TensorRT-LLM all_models/inflight_batcher_llm here: set "
    "TRTFORGE_TRTLLM_MODELS_DIR to one from tensorrtllm_backend "
    f"{TARGET.backend_release}, or run in {TARGET.image}")]


@pytest.fixture(scope="module")
def served(tmp_path_factory, trtllm_engine_json):
    from trtforge.builder.checkpoint import tokenizer_files
    from trtforge.builder.demo_checkpoint import write_demo_checkpoint
    from trtforge.model_repo.emit import emit_repo
    from trtforge.model_repo.launcher import TritonServer
    from trtforge.models.tokenizer import load_tokenizer

    root = tmp_path_factory.mktemp("trtllm_python_models")
    ckpt = write_demo_checkpoint(root / "ckpt", arch="llama", seed=1)
    engine = root / "engine"
    engine.mkdir()
    for f in tokenizer_files(ckpt):
        shutil.copy2(f, engine / f.name)
    (engine / "engine.json").write_text(trtllm_engine_json)
    # What TensorRT-LLM writes beside the tokenizer: its engine config, not a Hugging Face one.
    (engine / "config.json").write_text(json.dumps({
        "version": TARGET.tensorrt_llm, "pretrained_config": {"architecture": "LlamaForCausalLM"},
        "build_config": {"max_batch_size": 8}}))
    repo = emit_repo(engine, root / "repo", trtllm_models_dir=MODELS_DIR)
    disagg = emit_repo(engine, root / "disagg", trtllm_models_dir=MODELS_DIR, disaggregated=True)
    served_repo = root / "served"
    # tensorrt_llm (and the ensemble composed with it) needs the GPU image; the rest runs here.
    for name in ("preprocessing", "postprocessing", "tensorrt_llm_bls"):
        shutil.copytree(repo / name, served_repo / name)
    shutil.copytree(disagg / "disaggregated_serving_bls", served_repo / "disaggregated_serving_bls")
    with TritonServer(served_repo, log_file=root / "triton.log") as server:
        yield server, load_tokenizer(engine)


@pytest.fixture(scope="module")
def trtllm_engine_json():
    """engine.json of a --backend trtllm engine (as in conftest.trtllm_engine)."""
    return engine_json(
        backend="trtllm", dtype="float16",
        build={"backend": "trtllm", "dtype": "float16", "max_batch_size": 8,
               "max_num_tokens": 256, "max_seq_len": 128, "kv_block_size": 16,
               "kv_cache_memory": "4MiB", "allow_pickle": False},
        scheduling={}, report={"kv_bytes_per_token": 4096},
        versions={"tensorrt_llm": TARGET.tensorrt_llm})


def _infer(url: str, model: str, inputs: dict[str, np.ndarray], outputs: list[str]) -> dict:
    import tritonclient.http as http
    from tritonclient.utils import np_to_triton_dtype

    tensors = []
    for name, value in inputs.items():
        t = http.InferInput(name, list(value.shape), np_to_triton_dtype(value.dtype))
        t.set_data_from_numpy(value)
        tensors.append(t)
    result = http.InferenceServerClient(url).infer(model, tensors)
    return {name: result.as_numpy(name) for name in outputs}


@pytest.mark.parametrize("model", ["tensorrt_llm_bls", "disaggregated_serving_bls"])
def test_the_bls_models_load_with_our_parameters(served, model):
    import tritonclient.http as http

    assert http.InferenceServerClient(served[0].http_url).is_model_ready(model)


def test_preprocessing_tokenizes_like_trtforge(served):
    server, tokenizer = served
    out = _infer(server.http_url, "preprocessing",
                 {"QUERY": np.array([["Hello world"]], dtype=object),
                  "REQUEST_OUTPUT_LEN": np.array([[4]], dtype=np.int32)},
                 ["INPUT_ID", "REQUEST_INPUT_LEN", "OUT_END_ID"])
    expected = tokenizer.encode("Hello world", add_special_tokens=False)
    assert out["INPUT_ID"].tolist() == [expected]
    assert out["REQUEST_INPUT_LEN"].tolist() == [[len(expected)]]


def test_postprocessing_detokenizes(served):
    server, tokenizer = served
    ids = tokenizer.encode("Hello world", add_special_tokens=False)
    out = _infer(server.http_url, "postprocessing",
                 {"TOKENS_BATCH": np.array([[ids]], dtype=np.int32),
                  "SEQUENCE_LENGTH": np.array([[len(ids)]], dtype=np.int32)}, ["OUTPUT"])
    assert out["OUTPUT"].reshape(-1)[0].decode() == tokenizer.decode(ids, skip_special_tokens=True)


def test_the_real_templates_match_the_record_and_catch_the_other_release(tmp_path):
    """Against the templates of the checkout (or image) itself: the recorded release's configs
    pass the comparison unchanged, and 1.2's are refused with the renamed inputs named."""
    from tests.model_repo.trtllm.conftest import write_engine
    from trtforge.builder.trtllm.versions import TrtllmDrift
    from trtforge.model_repo.emit import emit_repo
    from trtforge.model_repo.trtllm.values import TrtllmOptions

    emit_repo(write_engine(tmp_path / "e19", TARGET.tensorrt_llm), tmp_path / "r19",
              trtllm_models_dir=MODELS_DIR, disaggregated=True)
    with pytest.raises(TrtllmDrift, match="ensemble: input 'random_seed' is in the template, not in ours"):
        emit_repo(write_engine(tmp_path / "e12", "1.2.0rc8"), tmp_path / "r12", trtllm_models_dir=MODELS_DIR)
    if (MODELS_DIR / ".." / "llmapi" / "tensorrt_llm" / "config.pbtxt").is_file():
        from trtforge.builder.demo_checkpoint import write_demo_checkpoint

        ckpt = write_demo_checkpoint(tmp_path / "ckpt", arch="llama", seed=1)
        repo = emit_repo(ckpt, tmp_path / "llmapi", trtllm_models_dir=TrtllmOptions(MODELS_DIR, repo="llmapi",
                                                                                       version=TARGET.tensorrt_llm))
        assert (repo / "tensorrt_llm" / "1" / "model.py").is_file()
