"""The launcher on its own: a bare tritonserver with the python backend, and `trtforge serve`.

Uses a trivial decoupled python model written here, so it needs no engine and starts in seconds.
The count of tests here is checked in conftest.EXPECTED_TESTS; keep it in step.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import urllib.request

import pytest

from tests.e2e.helpers import BIN
from trtforge.model_repo.launcher import TritonServer, find_tritonserver

pytestmark = pytest.mark.e2e

ECHO_CONFIG = """
name: "echo"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "IN" data_type: TYPE_STRING dims: [1] } ]
output [ { name: "OUT" data_type: TYPE_STRING dims: [1] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
"""

# Streams three pieces; the first says which interpreter and which trtforge the stub runs.
ECHO_MODEL = textwrap.dedent('''
    import sys
    import numpy as np
    import triton_python_backend_utils as pb_utils
    import trtforge.model_repo as pkg

    class TritonPythonModel:
        def execute(self, requests):
            for request in requests:
                sender = request.get_response_sender()
                text = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0].decode()
                for piece in (f"{sys.prefix}|{pkg.__file__}|", text, "!"):
                    out = pb_utils.Tensor("OUT", np.array([piece.encode()], dtype=object))
                    sender.send(pb_utils.InferenceResponse([out]))
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
''')


@pytest.fixture()
def echo_repo(tmp_path):
    (tmp_path / "repo" / "echo" / "1").mkdir(parents=True)
    (tmp_path / "repo" / "echo" / "config.pbtxt").write_text(ECHO_CONFIG)
    (tmp_path / "repo" / "echo" / "1" / "model.py").write_text(ECHO_MODEL)
    return tmp_path / "repo"


def _stream(http_url: str, text: str) -> list[str]:
    request = urllib.request.Request(f"http://{http_url}/v2/models/echo/generate_stream",
                                     data=json.dumps({"IN": text}).encode())
    with urllib.request.urlopen(request, timeout=30) as resp:
        return [json.loads(line[5:])["OUT"] for line in resp.read().decode().splitlines()
                if line.startswith("data:")]


def test_bare_server_runs_models_with_this_interpreter(echo_repo, tmp_path):
    install = find_tritonserver()
    assert install.binary.is_file()
    with TritonServer(echo_repo, log_file=tmp_path / "server.log") as server:
        first, echoed, bang = _stream(server.http_url, "héllo")
    prefix, package, _ = first.split("|")
    assert prefix == sys.prefix  # the venv, so trtforge and torch import inside models
    import trtforge.model_repo as pkg

    assert package == pkg.__file__
    assert (echoed, bang) == ("héllo", "!")


def test_serve_command_stays_in_foreground_and_stops_on_sigterm(echo_repo, tmp_path):
    cmd = [str(BIN / "trtforge"), "serve", str(echo_repo), "--http-port", "0", "--grpc-port", "0",
           "--metrics-port", "0", "--log-file", str(tmp_path / "server.log")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        ready = proc.stdout.readline()
        match = re.search(r"HTTP http://(\S+)", ready)
        assert match, ready + proc.stdout.read() if proc.poll() is not None else ready
        assert _stream(match.group(1), "x")[1:] == ["x", "!"]
        assert proc.poll() is None  # still serving
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, rest
    assert "Triton stopped (exit code 0)" in rest
