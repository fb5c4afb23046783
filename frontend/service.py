"""The OpenAI-compatible API as `trtforge serve --openai-port` runs it beside tritonserver."""

from __future__ import annotations

from trtforge.frontend.served_model import ServedModel, load_served_model
from trtforge.model_repo.launcher import free_port


class OpenAIFrontend:
    """Off unless a port is given; `prepare()` before Triton starts (a repository it cannot serve
    fails first), `start()` once Triton is ready, `stop()` before Triton stops."""

    def __init__(self, repo: str, host: str, port: int | None, name: str | None) -> None:
        self.repo, self.host, self.port, self.name = repo, host, port, name
        self.served: ServedModel | None = None
        self.server = None

    def prepare(self) -> None:
        if self.port is not None:
            self.served = load_served_model(self.repo, self.name)

    def start(self, triton_grpc_url: str) -> str | None:
        """Start serving; returns the line to print (None when off)."""
        if self.served is None:
            return None
        from trtforge.frontend.server import OpenAIServer, create_app  # fastapi only when used

        port = self.port or free_port()
        self.server = OpenAIServer(create_app(self.served, triton_grpc_url), self.host,
                                   port).start()
        name = self.served.name
        return (f"OpenAI-compatible API: http://127.0.0.1:{port}/v1  model {name!r}\n"
                f"  try: curl http://127.0.0.1:{port}/v1/completions -H 'Content-Type: "
                f"application/json' -d '{{\"model\": \"{name}\", \"prompt\": \"Hello\", "
                f"\"max_tokens\": 16}}'")

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
