"""Bad fields for every worker RPC (tests/faults/test_worker_plane.py): each case makes one
call that must be answered INVALID_ARGUMENT naming the field. A case may first make a valid
reservation of its own, under request_id "bad" (or "bad-other"); the test aborts those."""

from __future__ import annotations

import time

from pdserve.proto import worker_pb2
from tests.faults.worker_plane import AUTH, PROMPT, Plane, reserve, sampling, source_of

SOMEWHERE = worker_pb2.Endpoint(host="127.0.0.1", port=9, rank=0)  # a pull source never asked


def _reserve_case(**fields):
    def call(plane: Plane):
        base = {"request_id": "bad", "prompt_token_ids": PROMPT, "sampling": sampling(),
                "sources": [source_of(plane.prefill)], "deadline": time.time() + 30}
        given = {name: make(plane) for name, make in fields.items()}
        return plane.d.Reserve(worker_pb2.ReserveRequest(**(base | given)), metadata=AUTH,
                               timeout=30)
    return call


def _submit_case(**fields):
    def call(plane: Plane):
        base = {"request_id": "bad", "prompt_token_ids": PROMPT, "sampling": sampling()}
        given = {name: make(plane) for name, make in fields.items()}
        return plane.d.Submit(worker_pb2.SubmitRequest(**(base | given)), metadata=AUTH,
                              timeout=30)
    return call


def _start_case(make):
    def call(plane: Plane):
        assert reserve(plane, "bad").granted
        return plane.d.Start(make(plane), metadata=AUTH, timeout=30)
    return call


def _prefill_case(make):
    def call(plane: Plane):
        granted = reserve(plane, "bad")
        assert granted.granted
        return plane.p.Prefill(make(plane, granted.descriptor), metadata=AUTH, timeout=30)
    return call


def _other_source(plane: Plane, _descriptor: bytes) -> worker_pb2.PrefillRequest:
    other = worker_pb2.Endpoint(host="127.0.0.1", port=plane.prefill.port + 1, rank=0)
    granted = plane.d.Reserve(worker_pb2.ReserveRequest(
        request_id="bad-other", prompt_token_ids=PROMPT, sampling=sampling(), sources=[other],
        deadline=time.time() + 30), metadata=AUTH, timeout=30)
    return worker_pb2.PrefillRequest(request_id="bad-other", prompt_token_ids=PROMPT,
                                     sampling=sampling(), descriptor=granted.descriptor)


def _prefill_request(**fields):
    def make(plane: Plane, descriptor: bytes) -> worker_pb2.PrefillRequest:
        base = {"request_id": "bad", "prompt_token_ids": PROMPT, "sampling": sampling(),
                "descriptor": descriptor}
        return worker_pb2.PrefillRequest(**(base | fields))
    return make


BAD_FIELDS = {  # case -> (the call, what the error must name)
    "reserve-token-outside-vocab": (_reserve_case(prompt_token_ids=lambda p: [1, p.vocab]),
                                    "prompt_token_ids"),
    "reserve-negative-token": (_reserve_case(prompt_token_ids=lambda p: [3, -1]),
                               "prompt_token_ids"),
    "reserve-empty-prompt": (_reserve_case(prompt_token_ids=lambda p: []), "prompt_token_ids"),
    "reserve-prompt-over-context": (_reserve_case(prompt_token_ids=lambda p: [5] * 512),
                                    "max_model_len"),
    "reserve-empty-request-id": (_reserve_case(request_id=lambda p: ""), "request_id"),
    "reserve-long-request-id": (_reserve_case(request_id=lambda p: "r" * 257), "request_id"),
    "reserve-control-char-id": (_reserve_case(request_id=lambda p: "a\nb"), "request_id"),
    "reserve-negative-temperature": (_reserve_case(
        sampling=lambda p: sampling(temperature=-1.0)), "temperature"),
    "reserve-nan-top-p": (_reserve_case(sampling=lambda p: sampling(top_p=float("nan"))),
                          "top_p"),
    "reserve-no-sources": (_reserve_case(sources=lambda p: []), "sources"),
    "reserve-bad-source-port": (_reserve_case(sources=lambda p: [worker_pb2.Endpoint(
        host="127.0.0.1", port=0, rank=0)]), "port"),
    "reserve-nan-deadline": (_reserve_case(deadline=lambda p: float("nan")), "deadline"),
    "submit-token-outside-vocab": (_submit_case(prompt_token_ids=lambda p: [p.vocab + 7]),
                                   "prompt_token_ids"),
    "submit-prompt-over-context": (_submit_case(prompt_token_ids=lambda p: [5] * 600),
                                   "max_model_len"),
    "submit-too-many-logprobs": (_submit_case(sampling=lambda p: sampling(logprobs=99)),
                                 "logprobs"),
    "submit-pull-partial-block": (_submit_case(
        pull_sources=lambda p: [SOMEWHERE], num_pull_tokens=lambda p: 20,
        pull_deadline=lambda p: time.time() + 30), "num_pull_tokens"),
    "submit-pull-whole-prompt": (_submit_case(
        pull_sources=lambda p: [SOMEWHERE], num_pull_tokens=lambda p: 48,
        pull_deadline=lambda p: time.time() + 30), "num_pull_tokens"),
    "submit-pull-no-source": (_submit_case(
        num_pull_tokens=lambda p: 16, pull_deadline=lambda p: time.time() + 30), "pull_sources"),
    "submit-pull-nan-deadline": (_submit_case(
        pull_sources=lambda p: [SOMEWHERE], num_pull_tokens=lambda p: 16,
        pull_deadline=lambda p: float("nan")), "deadline"),
    "push-prefix-junk-descriptor": (lambda p: p.d.PushPrefix(worker_pb2.PushPrefixRequest(
        request_id="bad", prompt_token_ids=PROMPT[:16], descriptor=b"{"), metadata=AUTH,
        timeout=30), "descriptor"),
    "push-prefix-other-request": (lambda p: p.d.PushPrefix(worker_pb2.PushPrefixRequest(
        request_id="bad-other", prompt_token_ids=PROMPT,
        descriptor=reserve(p, "bad").descriptor), metadata=AUTH, timeout=30), "descriptor"),
    "start-token-outside-vocab": (_start_case(lambda p: worker_pb2.StartRequest(
        request_id="bad", first_token_id=p.vocab)), "first_token_id"),
    "start-negative-token": (_start_case(lambda p: worker_pb2.StartRequest(
        request_id="bad", first_token_id=-2)), "first_token_id"),
    "start-logprob-outside-vocab": (_start_case(lambda p: worker_pb2.StartRequest(
        request_id="bad", first_token_id=1,
        logprob={"token_id": p.vocab + 1, "logprob": -0.5})), "logprob"),
    "abort-long-request-id": (lambda p: p.d.Abort(worker_pb2.WorkerAbortRequest(
        request_id="r" * 300), metadata=AUTH, timeout=30), "request_id"),
    "prefill-token-outside-vocab": (_prefill_case(_prefill_request(
        prompt_token_ids=[1] * 39 + [10**6])), "prompt_token_ids"),
    "prefill-empty-request-id": (_prefill_case(_prefill_request(request_id="")), "request_id"),
    "prefill-descriptor-of-another-request": (_prefill_case(_prefill_request(
        request_id="someone-else")), "request"),
    "prefill-descriptor-naming-another-source": (_prefill_case(_other_source), "sources"),
    "prefill-bad-top-k": (_prefill_case(_prefill_request(sampling=sampling(top_k=-5))),
                          "top_k"),
    "prefill-malformed-descriptor": (_prefill_case(_prefill_request(descriptor=b"{\"v\":")),
                                     "descriptor"),
}
