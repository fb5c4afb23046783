"""A real tritonserver serving a disaggregated repository: `ensemble` (the router) → `context`
(prefill) → `generation` (decode), KV handed over through shared memory.

Oracles: the in-process co-located engine (what `trtforge generate` runs) and a co-located
model served by the same server (`colocated`). The count of tests here is checked in
conftest.EXPECTED_TESTS; keep it in step. The last test unloads the generation model.
"""

from __future__ import annotations

import queue
import shutil
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from google.protobuf import text_format

from tests.e2e.helpers import BIN, fail_alone, run_cli
from tests.e2e.test_triton_e2e import metrics, wait_for
from trtforge.model_repo import client
from trtforge.model_repo.launcher import TritonServer
from trtforge.model_repo.pbtxt import read_config

pytestmark = pytest.mark.e2e

PROMPTS = ["Hello world", "The quick brown fox", "Stop strings end a request;", "Café au lait"]
MAX_TOKENS = 12
HANDOFF_TIMEOUT_S = 4.0
PHASES = ("context", "generation")


@dataclass
class Served:
    server: TritonServer
    expected: dict[str, str]
    """Greedy text of each prompt from the in-process co-located engine."""
    max_seq_len: int
    root: Path


@pytest.fixture(scope="module")
def served(engine_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("disagg")
    repo = root / "repo"
    # Small prefill steps on the context model: a long prompt takes many iterations, so a test
    # can cancel it while it is being prefilled. 4 tokens a step: the warm tiny engine runs a
    # step in about a millisecond, and at 16 a 1,500-token prefill was over in ~0.1 s, before
    # a test polling the metrics could see it (or cancel it).
    run_cli("trtforge", "emit-repo", str(engine_dir), str(repo), "--disaggregated",
            "--context-max-num-tokens", "16", "--context-prefill-chunk-size", "4",
            "--context-handoff-timeout-s", str(HANDOFF_TIMEOUT_S),
            "--generation-max-batch-size", "32", "--context-kv-cache-memory", "8MiB")
    # The co-located model of the same engine, served beside it as `colocated`.
    run_cli("trtforge", "emit-repo", str(engine_dir), str(root / "colocated-repo"))
    config = read_config(root / "colocated-repo" / "ensemble" / "config.pbtxt")
    config.name = "colocated"
    shutil.copytree(root / "colocated-repo" / "ensemble", repo / "colocated")
    (repo / "colocated" / "config.pbtxt").write_text(text_format.MessageToString(config))
    server = TritonServer(repo, log_file=root / "tritonserver.log",
                          extra_args=["--model-control-mode=explicit", "--load-model=*"])
    server.start()
    try:
        from trtforge.config.sampling import SamplingParams
        from trtforge.serving.engine import LLMEngine

        engine = LLMEngine.from_engine_dir(engine_dir)
        outs = engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS))
        server.wait_ready(timeout_s=300)
        yield Served(server, {p: o.text for p, o in zip(PROMPTS, outs)},
                     engine.scheduler_config.max_seq_len, root)
    finally:
        server.stop()


def _idle(served: Served) -> bool:
    """No KV block held on either phase model, nor in the handoff area."""
    m = {phase: metrics(served, phase) for phase in PHASES}
    return all(m[p]["trtforge_kv_blocks_used"] == 0 and m[p]["trtforge_requests_running"] == 0
               for p in PHASES) and m["context"]["trtforge_kv_handoff_blocks_held"] == 0


def test_every_protocol_gives_the_colocated_text(served, engine_dir):
    url, http = served.server.grpc_url, served.server.http_url
    generated = {}
    for prompt in PROMPTS:
        pieces = list(client.stream_grpc(url, prompt, MAX_TOKENS))
        assert "".join(pieces) == served.expected[prompt] and len(pieces) > 1
        events = list(client.stream_http(http, prompt, MAX_TOKENS))
        assert "".join(e.get("text_output", "") for e in events) == served.expected[prompt]
        answer = client.generate_http(http, prompt, MAX_TOKENS)
        assert answer["text_output"] == prompt + served.expected[prompt]  # TRT-LLM default
        assert answer["num_output_tokens"] == MAX_TOKENS
        colocated = client.generate_http(http, prompt, MAX_TOKENS, model="colocated")
        # Prefix-cache hits depend on each engine's history (the context model has seen this
        # prompt twice already): the one output that may differ, and at most the whole blocks.
        cached = answer.pop("num_cached_tokens")
        assert 0 <= colocated.pop("num_cached_tokens") < answer["num_input_tokens"]
        assert 0 < cached < answer["num_input_tokens"] or answer["num_input_tokens"] <= 8
        assert answer == {**colocated, "model_name": "ensemble"}
        generated[prompt] = answer["text_output"]
    # `trtforge generate` on the same engine says the same.
    import subprocess

    out = subprocess.run([str(BIN / "trtforge"), "generate", str(engine_dir), "--prompt", PROMPTS[1],
                          "--max-tokens", str(MAX_TOKENS)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert served.expected[PROMPTS[1]] in out.stdout
    m = metrics(served, "context")
    assert m["trtforge_kv_handoffs_total"] >= 3 * len(PROMPTS)
    assert m["trtforge_kv_handoff_bytes_total"] > 0
    assert metrics(served, "generation")["trtforge_kv_handoffs_total"] >= 3 * len(PROMPTS)
    assert wait_for(lambda: _idle(served))


def test_32_concurrent_streams_and_seeded_sampling_match_colocated(served):
    url = served.server.grpc_url
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(32)]
    sampled = dict(temperature=0.9, top_p=0.95, seed=4321, return_log_probs=True)

    def run(args) -> str:
        prompt, model, options = args
        return "".join(client.stream_grpc(url, prompt, MAX_TOKENS, model=model, **options))

    jobs = [(p, "ensemble", {}) for p in prompts] + [(p, m, sampled) for p in PROMPTS
                                                     for m in ("ensemble", "colocated")]
    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(run, jobs))
    assert answers[:32] == [served.expected[p] for p in prompts]
    seeded = answers[32:]
    assert seeded[0::2] == seeded[1::2]  # disaggregated == co-located, prompt by prompt
    assert seeded[0::2] != [served.expected[p] for p in PROMPTS]  # it did sample
    with_logprobs = client.generate_http(served.server.http_url, PROMPTS[0], MAX_TOKENS, **sampled)
    reference = client.generate_http(served.server.http_url, PROMPTS[0], MAX_TOKENS,
                                     model="colocated", **sampled)
    assert with_logprobs["output_log_probs"] == pytest.approx(reference["output_log_probs"], abs=1e-4)
    assert wait_for(lambda: _idle(served))


def _start_stream(url: str, prompt: str, max_tokens: int):
    import tritonclient.grpc as grpcclient

    responses: queue.Queue = queue.Queue()
    grpc = grpcclient.InferenceServerClient(url)
    grpc.start_stream(callback=lambda result, error: responses.put((result, error)))
    grpc.async_stream_infer("ensemble", client.grpc_inputs(prompt, max_tokens, stream=True),
                            request_id=uuid.uuid4().hex, enable_empty_final_response=True)
    return grpc, responses


def test_cancel_during_prefill_and_during_decode_leaves_no_block(served):
    url = served.server.grpc_url
    before = metrics(served, "context")
    # During prefill: ~1,500 prompt tokens at 4 per context iteration (~0.7 s in-process; at 16,
    # ~0.2 s, which polling the metrics missed). Admission is seen on a counter (a gauge polled
    # can miss a short state); the prefill is still running then. A fresh first word: a prompt
    # the prefix cache holds would be prefilled in one step.
    grpc, responses = _start_stream(url, f"{uuid.uuid4().hex[:8]} " + "the " * 1500, 8)
    tokens = "trtforge_prompt_tokens_total"
    assert wait_for(lambda: metrics(served, "context")[tokens] > before[tokens], 10)
    assert wait_for(lambda: metrics(served, "context")["trtforge_kv_blocks_used"] > 0, 5), \
        metrics(served, "context")
    assert responses.empty(), responses.queue  # no token yet: still in prefill
    grpc.stop_stream(cancel_requests=True)
    grpc.close()
    assert wait_for(lambda: _idle(served)), {p: metrics(served, p) for p in PHASES}
    after = metrics(served, "context")
    assert after["trtforge_kv_handoffs_total"] == before["trtforge_kv_handoffs_total"], after  # never handed over
    assert after["trtforge_prompt_tokens_total"] > before["trtforge_prompt_tokens_total"]
    # During decode: a long answer, cancelled after a few tokens.
    gen_before = metrics(served, "generation")["trtforge_generation_tokens_total"]
    max_tokens = served.max_seq_len - 16
    stream = client.stream_grpc(url, "Hello world", max_tokens)
    next(stream), next(stream), next(stream)
    assert metrics(served, "generation")["trtforge_kv_blocks_used"] > 0
    stream.close()
    assert wait_for(lambda: _idle(served)), {p: metrics(served, p) for p in PHASES}
    time.sleep(0.5)  # an un-cancelled request would keep generating
    assert metrics(served, "generation")["trtforge_generation_tokens_total"] - gen_before < max_tokens / 2


def test_bad_requests_fail_alone_with_clear_errors(served):
    url, http = served.server.grpc_url, served.server.http_url
    bad = [
        (lambda: "".join(client.stream_grpc(url, "hello " * served.max_seq_len, 4)), "too long"),
        (lambda: "".join(client.stream_grpc(url, "hi", 0)), "max_tokens=0"),
        (lambda: "".join(client.stream_grpc(url, "hi", 4, beam_width=2)), "beam_width=2"),
        (lambda: "".join(client.stream_grpc(url, "hi", 10**6)),
         rf"max_tokens=1000000 exceeds max_seq_len={served.max_seq_len}"),
        (lambda: client.generate_http(http, "hi", 4, temperature=-1.0), "temperature"),
    ]
    good = [lambda p=p: "".join(client.stream_grpc(url, p, MAX_TOKENS)) for p in PROMPTS]
    fail_alone(bad, good, [served.expected[p] for p in PROMPTS])
    assert wait_for(lambda: _idle(served))


def test_phase_configs_parse_back_and_a_foreign_parameter_fails_the_load(served):
    repo = Path(served.server.repo)
    for phase in PHASES:
        config = read_config(repo / phase / "config.pbtxt")
        assert config.parameters["phase"].string_value == phase
    context = read_config(repo / "context" / "config.pbtxt")
    generation = read_config(repo / "generation" / "config.pbtxt")
    assert "prefill_chunk_size" in context.parameters and "max_batch_size" not in context.parameters
    assert "max_batch_size" in generation.parameters and "prefill_chunk_size" not in generation.parameters
    # A decode parameter copied into a context model is refused at load, by name.
    context.name = "bad_context"
    context.parameters["max_batch_size"].string_value = "8"
    shutil.copytree(repo / "context", repo / "bad_context")
    (repo / "bad_context" / "config.pbtxt").write_text(text_format.MessageToString(context))
    request = urllib.request.Request(
        f"http://{served.server.http_url}/v2/repository/models/bad_context/load", data=b"{}",
        method="POST")
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=120)
    message = info.value.read().decode()
    assert "'max_batch_size' belongs to the generation model" in message


def _call_phase(url: str, model: str, prompt: str, max_tokens: int, handle: bytes | None = None,
                **options) -> tuple[str, bytes | None]:
    """An attacker's direct call to a phase model (as the router calls it): (text, the handle it
    answered with); RuntimeError with the server's message on an error."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    from trtforge.model_repo.phases import CONTEXT_PHASE_PARAMS, REQUEST_TYPE

    kind = "context_only" if model == "context" else "generation_only"
    arrays = client.request_arrays(prompt, max_tokens, stream=True, exclude_input_in_output=True, **options)
    arrays[REQUEST_TYPE] = np.array([[kind.encode()]], dtype=object)
    if handle is not None:
        arrays[CONTEXT_PHASE_PARAMS] = np.array([[handle]], dtype=object)
    responses: queue.Queue = queue.Queue()
    grpc = grpcclient.InferenceServerClient(url)
    grpc.start_stream(callback=lambda result, error: responses.put((result, error)))
    text, handed = "", None
    try:
        grpc.async_stream_infer(model, client.infer_inputs(arrays), request_id=uuid.uuid4().hex,
                                enable_empty_final_response=True)
        while True:
            result, error = responses.get(timeout=120)
            if error is not None:
                raise RuntimeError(str(error))
            out = result.as_numpy("text_output")
            if out is not None and out.size:
                text += b"".join(out.reshape(-1)).decode()
            params = result.as_numpy(CONTEXT_PHASE_PARAMS)
            if params is not None and params.size and params.reshape(-1)[0]:
                handed = params.reshape(-1)[0]
            if result.get_response().parameters["triton_final_response"].bool_param:
                return text, handed
    finally:
        grpc.stop_stream()
        grpc.close()


def test_forged_context_phase_params_fail_alone_and_leave_nothing_held(served):
    """Issue 23, as an attacker who reaches the server: the phase models are client-facing, so a
    client can call `context` itself, keep the handle, and send `generation` forged, altered,
    replayed or oversized ones, and hostile sampling values. Each fails alone with a clear error
    while good streams through `ensemble` finish with exactly their text, and no block is held."""
    import json

    url = served.server.grpc_url
    first, raw = _call_phase(url, "context", PROMPTS[1], MAX_TOKENS)
    assert raw is not None and first  # the attacker's own prompt: its first token and handle
    handle = json.loads(raw)

    def forged(**changes) -> bytes:
        return json.dumps({**handle, **changes}).encode()

    vocab = 10 ** 6
    attacks = [
        (forged(first_token=handle["first_token"] + 1), "not authenticated"),
        (forged(slot=4095, nonce=1, blocks=[0, 1, 2, 3]), "not authenticated"),
        (forged(prompt_token_ids=[vocab] * len(handle["prompt_token_ids"])), "not authenticated"),
        (forged(location="tcp://203.0.113.9:7000"), "not authenticated"),
        (forged(generator_state="zz"), "not authenticated"),
        (forged(mac=""), "not authenticated"),
        (forged(evil=1), "unknown field"),
        (forged(slot="4095"), "malformed"),
        (b"{not json", "malformed"),
        (b" " * (8 << 20) + b"{}", "at most"),
    ]
    bad = [(lambda h=h: _call_phase(url, "generation", PROMPTS[1], MAX_TOKENS, handle=h), why)
           for h, why in attacks]
    # Hostile sampling values through the front door, in the same batches.
    bad += [(lambda: "".join(client.stream_grpc(url, "hi", 4, end_id=vocab, min_tokens=2)), "end_id"),
            (lambda: "".join(client.stream_grpc(url, "hi", 4, top_k=-5)), "top_k"),
            (lambda: "".join(client.stream_grpc(url, "hi", 4, repetition_penalty=float("nan"))),
             "repetition_penalty")]
    good = [lambda p=p: "".join(client.stream_grpc(url, p, MAX_TOKENS)) for p in PROMPTS]
    fail_alone(bad, good, [served.expected[p] for p in PROMPTS])
    # The handle is the attacker's own request: taken once it continues that request (and gives
    # the co-located text), a replay is refused.
    text, _ = _call_phase(url, "generation", PROMPTS[1], MAX_TOKENS, handle=raw)
    assert text == served.expected[PROMPTS[1]][len(first):]
    with pytest.raises(RuntimeError, match="already used"):
        _call_phase(url, "generation", PROMPTS[1], MAX_TOKENS, handle=raw)
    assert "".join(client.stream_grpc(url, PROMPTS[2], MAX_TOKENS)) == served.expected[PROMPTS[2]]
    assert wait_for(lambda: _idle(served)), {p: metrics(served, p) for p in PHASES}


def test_handoff_nobody_takes_is_freed_after_its_deadline(served):
    """Last: the generation model goes away between the phases."""
    http = served.server.http_url
    expired = metrics(served, "context")["trtforge_kv_handoffs_expired_total"]
    request = urllib.request.Request(f"http://{http}/v2/repository/models/generation/unload",
                                     data=b"{}", method="POST")
    urllib.request.urlopen(request, timeout=60).read()
    assert wait_for(lambda: not _ready(http, "generation"), 30)
    with pytest.raises(RuntimeError, match="generation"):
        "".join(client.stream_grpc(served.server.grpc_url, PROMPTS[0], MAX_TOKENS))
    assert metrics(served, "context")["trtforge_kv_handoff_blocks_held"] > 0  # waiting for a taker
    assert wait_for(lambda: metrics(served, "context")["trtforge_kv_handoffs_expired_total"]
                    == expired + 1, HANDOFF_TIMEOUT_S + 10)
    assert metrics(served, "context")["trtforge_kv_handoff_blocks_held"] == 0
    assert metrics(served, "context")["trtforge_kv_blocks_used"] == 0


def _ready(http: str, model: str) -> bool:
    try:
        return urllib.request.urlopen(f"http://{http}/v2/models/{model}/ready", timeout=5).status == 200
    except urllib.error.URLError:
        return False
