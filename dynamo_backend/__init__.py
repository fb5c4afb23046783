"""trtforge as an NVIDIA Dynamo backend: the same engine behind Dynamo's frontend and KV-aware router.

Dynamo (NVIDIA's orchestration layer for TensorRT-LLM, vLLM and SGLang fleets) runs an OpenAI
frontend that tokenizes, routes each request to a worker, and detokenizes; a worker is an engine
behind `dynamo.common.backend.LLMEngine`. This package is that worker for a trtforge engine
directory, a second front door beside the Triton repository (model_repo/), with the same
RuntimeConfig and the same LLMEngine:

    worker.py       TrtforgeEngine: start() registers the engine's limits, generate() takes token
                    ids and Dynamo's sampling/stop options and streams token ids, abort() cancels
    engine_loop.py  the engine's schedule → execute → update loop on its own thread, fed from
                    asyncio (one request's error fails that request only)
    requests.py     Dynamo's request dict → SamplingParams, every field checked
    publish.py      the prefix cache's KV events (serving/core/kv_events.py) and load snapshots
                    → Dynamo's KV event publisher, which feeds the KV-aware router
    model_card.py   the folder the frontend reads (config.json + the engine's tokenizer files)
    disagg.py       prefill/decode roles: our signed KV handle as Dynamo's disaggregated_params

`dynamo` is an optional dependency (`pip install trtforge[dynamo]`, then `pip install --no-deps
ai-dynamo`: docs/scale-out.md); nothing outside this package and `trtforge dynamo-worker`
imports it.
"""
