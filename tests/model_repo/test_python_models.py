"""What the python-backend models share (python_models/base.py), with a stand-in for pb_utils (the
real one exists only inside Triton's stub; the e2e tests run the models in a real tritonserver)."""

from __future__ import annotations

import threading
import time

import numpy as np

from trtforge.model_repo.python_models.base import Answer, DecoupledModel, input_arrays


class FakePbUtils:
    TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1

    class Tensor:
        def __init__(self, name: str, array: np.ndarray) -> None:
            self._name, self._array = name, array

        def name(self) -> str:
            return self._name

        def as_numpy(self) -> np.ndarray:
            return self._array

    class InferenceResponse:
        def __init__(self, output_tensors=(), error=None) -> None:
            self.output_tensors, self.error = list(output_tensors), error

    class TritonError:
        INTERNAL, INVALID_ARG, UNAVAILABLE = "INTERNAL", "INVALID_ARG", "UNAVAILABLE"

        def __init__(self, message: str, code: str) -> None:
            self.message, self.code = message, code


class Sender:
    def __init__(self, gone: bool = False) -> None:
        self.sent: list = []
        self.gone = gone

    def send(self, response=None, flags: int = 0) -> None:
        if self.gone:
            raise RuntimeError("the client has gone away")
        self.sent.append((response, flags))


def _arrays(answer: Answer) -> dict[str, np.ndarray]:
    return {t.name(): t.as_numpy() for t in answer.tensors(FakePbUtils)}


def test_an_answer_reads_back_from_its_tensors():
    for answer in (Answer("héllo", cum_logprob=-1.75, logprobs=[-0.5, -1.25],
                          num_input_tokens=3, num_output_tokens=2),
                   Answer("x", context_phase_params=b'{"handle": 1}'), Answer(""),
                   Answer("end", num_input_tokens=3, num_output_tokens=2, finish_reason="stop",
                          stop_reason="\n\nUser:", num_cached_tokens=8, logprobs=[-0.5, -0.25],
                          top_logprobs=[[(7, -0.5), (3, -1.5)], [(9, -0.25), (7, -2.0)]]),
                   Answer("", finish_reason="length", stop_token_id=2, top_logprobs=[])):
        arrays = _arrays(answer)
        assert Answer.of_arrays(arrays) == answer
        assert arrays["text_output"].shape == (1, 1)
    full = _arrays(Answer("a", cum_logprob=0.0, logprobs=[-1.0], num_input_tokens=1, num_output_tokens=1))
    assert full["output_log_probs"].shape == (1, 1, 1) and full["output_log_probs"].dtype == np.float32
    assert full["num_output_tokens"].dtype == np.int32
    assert set(_arrays(Answer("a"))) == {"text_output"}  # None leaves a tensor out
    tops = _arrays(Answer("a", top_logprobs=[[(7, -0.5), (3, -1.5)]] * 3))
    assert tops["top_logprobs_ids"].shape == tops["top_logprobs"].shape == (1, 3, 2)
    assert (tops["top_logprobs_ids"].dtype, tops["top_logprobs"].dtype) == (np.int32, np.float32)
    ending = _arrays(Answer("a", finish_reason="stop", stop_token_id=2, num_cached_tokens=0))
    assert ending["finish_reason"].shape == (1, 1) and ending["stop_token_id"].dtype == np.int32


def test_input_arrays_are_copies_of_the_named_inputs():
    prompt = np.array([[b"hi"]], dtype=object)

    class Request:
        def inputs(self):
            return [FakePbUtils.Tensor("text_input", prompt), FakePbUtils.Tensor("other", prompt)]

    arrays = input_arrays(Request(), frozenset({"text_input"}))
    assert list(arrays) == ["text_input"] and arrays["text_input"] is not prompt


class Model(DecoupledModel):
    watch_s = 0.01

    def __init__(self) -> None:
        self.gone: list = []
        self.watched = threading.Event()
        self.start_responses(FakePbUtils, "test-responses")

    def client_gone(self, gone) -> None:
        self.gone.append(gone)

    def watch(self) -> None:
        self.watched.set()


def test_responses_go_out_in_order_and_a_gone_client_is_reported():
    model = Model()
    here, left = Sender(), Sender(gone=True)
    model.send(here, "first")
    model.send(left, "lost", gone="req-1")
    model.send(left, "lost too")  # nothing to report
    model.send_error(here, "bad request: no", "INVALID_ARG")
    assert model.watched.wait(5)  # between sends, every watch_s
    model.stop_responses(timeout_s=5)  # sends what is queued first
    assert [r for r, _ in here.sent][0] == "first"
    error, flags = here.sent[1]
    assert (error.error.message, error.error.code, flags) == ("bad request: no", "INVALID_ARG", 1)
    assert model.gone == ["req-1"]


def test_after_drain_requests_are_refused_as_unavailable():
    model = Model()
    with model._lock:
        assert not model.refuse_if_unloading(Sender())
    busy = [True]
    threading.Timer(0.1, lambda: busy.pop()).start()
    start = time.monotonic()
    model.drain(5.0, lambda: bool(busy))
    assert time.monotonic() - start < 4  # returned once no longer busy
    sender = Sender()
    with model._lock:
        assert model.refuse_if_unloading(sender)
    model.stop_responses(timeout_s=5)
    response, flags = sender.sent[0]
    assert response.error.code == "UNAVAILABLE" and "being unloaded" in response.error.message
