"""The OpenAI-compatible API as `trtforge serve --openai-port` runs it beside tritonserver."""

from __future__ import annotations

import ipaddress
import logging
import sys

from trtforge.frontend.guard import API_KEY_ENV, Limits
from trtforge.frontend.served_model import ServedModel, load_served_model
from trtforge.model_repo.launcher import free_port

DEFAULT_HOST = "127.0.0.1"
"""Loopback: the API is reachable from this machine only unless `--openai-host` opens it."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        return False


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _local_host(host: str) -> str:
    """Where a client on this machine reaches a server listening on `host`."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)


def _log_to_stderr() -> None:
    """The front end's log lines (5xx details with their request ids), when nothing set up
    logging: timestamped, on stderr beside tritonserver's output."""
    logger = logging.getLogger("trtforge.frontend")
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s trtforge-openai %(levelname)s %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def check_limits(served: ServedModel, limits: Limits) -> None:
    """ValueError for options the served repository cannot honour (before Triton starts)."""
    if served.trtllm is not None and limits.api_key_cache_salt:
        raise ValueError(f"--api-key-cache-salt gives each API key its own prefix-cache salt, but "
                         f"{served.trtllm.label} has no cache_salt input (every request would be refused); "
                         "serve this repository without it.")


class OpenAIFrontend:
    """Off unless a port is given; `prepare()` before Triton starts (a repository it cannot serve
    fails first), `start()` once Triton is ready, `stop()` before Triton stops."""

    def __init__(self, repo: str, host: str, port: int | None, name: str | None,
                 limits: Limits | None = None, engine_dir: str | None = None,
                 tool_call_parser: str | None = None) -> None:
        self.repo, self.host, self.port, self.name = repo, host, port, name
        self.tool_call_parser = tool_call_parser
        """How tool calls are read from the output (tool_parsers.TOOL_CALL_PARSERS); None: by the
        chat template."""
        self.engine_dir = engine_dir
        """The engine directory to read the tokenizer from instead of the repository's (a router
        alone on its host)."""
        self.limits = limits or Limits()
        self.served: ServedModel | None = None
        self.server = None

    def prepare(self) -> None:
        if self.port is not None:
            self.served = load_served_model(self.repo, self.name, self.engine_dir, self.tool_call_parser)
            check_limits(self.served, self.limits)

    def start(self, triton_grpc_url: str) -> str | None:
        """Start serving; returns the lines to print (None when off)."""
        if self.served is None:
            return None
        from trtforge.frontend.server import OpenAIServer, create_app  # fastapi only when used

        _log_to_stderr()
        self.server = OpenAIServer(create_app(self.served, triton_grpc_url, self.limits), self.host,
                                   self.port or free_port()).start()
        return self.banner()

    def banner(self) -> str:
        """Where it listens (as bound), whether it needs a key, and a curl line to try."""
        host, port = self.server.addresses()[0] if self.server else (self.host, self.port)
        name = self.served.name if self.served else self.name
        keyed = bool(self.limits.keys())
        # The first line's shape is read by scripts (bench_openai.sh, quickstart.sh, the e2e tests).
        lines = [f"OpenAI-compatible API: http://{_url_host(host)}:{port}/v1  model {name!r}"]
        where = ("this machine only (loopback)" if is_loopback(host) else
                 f"{'all interfaces' if host in ('0.0.0.0', '::') else host}: other machines too")
        lines.append(f"  listening on {where}; "
                     + ("API key required" if keyed else "no API key")
                     + ("; each key its own prefix cache" if self.limits.api_key_cache_salt else ""))
        if not keyed and not is_loopback(host):
            lines.append(f"  WARNING: without --api-key anyone who can reach port {port} can use "
                         "the model")
        auth = f" -H \"Authorization: Bearer ${API_KEY_ENV}\"" if keyed else ""
        lines.append(f"  try: curl http://{_url_host(_local_host(host))}:{port}/v1/completions{auth} "
                     f"-H 'Content-Type: application/json' -d '{{\"model\": \"{name}\", "
                     f"\"prompt\": \"Hello\", \"max_tokens\": 16}}'")
        return "\n".join(lines)

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
