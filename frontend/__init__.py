"""An OpenAI-compatible HTTP API in front of a trtforge Triton repository.

`trtforge serve REPO --openai-port PORT` starts it beside tritonserver. It forwards every request
to the repository's `ensemble` model over Triton's gRPC streaming API, so it works with any
repository `trtforge emit-repo` writes (TensorRT-LLM's for a `--backend trtllm` engine too):

* schemas.py, responses.py   typed request/response models (the OpenAPI schema comes from them);
  tool_schemas.py            tools, tool_choice, and the grammar that enforces a required/named call;
  tokenize_schemas.py        /tokenize and /detokenize bodies
* errors.py                  OpenAI error objects and the status each failure gets
* guard.py                   before the API: request ids, the API key, the body cap, a net for bugs
* served_model.py            what is served: name, engine dir, tokenizer (chat template), limits
* triton_bridge.py           one Triton request per API request, cancellable
* generation.py              API request -> ensemble inputs; usage and finish reason from outputs
* trtllm_interface.py        a `--backend trtllm` repository: its TensorRT-LLM release's interface
  trtllm_requests.py         API request -> that release's inputs (400 for what it lacks); stop cut
* streaming.py               SSE framing; a client that leaves cancels its Triton request
* samples.py                 the `n` choices of a request: n engine requests sharing the prompt's KV
* endpoints.py               /v1/completions (and what chat shares), /tokenize, /detokenize
* chat.py                    /v1/chat/completions: chat template, tools, tool calls in the answer
* tool_prompt.py             tools and a tool-call history as the chat template reads them
* tool_parsers.py            tool calls in the output per model family (--tool-call-parser)
* tool_stream.py             successive parses -> streamed tool_calls deltas
* partial_json.py            reading JSON that is still being generated
* server.py                  the FastAPI app and its uvicorn thread
* service.py                 what `trtforge serve --openai-port` runs beside tritonserver
"""
