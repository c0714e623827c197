"""ResponseStream: hand-made decode-worker deltas in, GenerateResponse messages out.

The tokenizer is the tiny checkpoint's real one (SmolLM2's byte-level BPE); no worker runs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
from transformers import AutoTokenizer

from pdserve.engine.sampling_params import SamplingParams
from pdserve.proto import pdserve_pb2, worker_pb2
from pdserve.router.flight import Flight, Placement
from pdserve.router.mailbox import Mailbox
from pdserve.router.metrics import RouterMetrics
from pdserve.router.stream import ResponseStream, WorkerFailed
from pdserve.router.validation import ValidRequest
from pdserve.router.workers import Lost, WorkerLost

PROMPT = "<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n"
# Byte-level BPE splits the emoji over two tokens (" \xf0\x9f\x98" and "\x80").
TEXT = "Hello there! 😀 How are you, naïve café? 中文"
QUEUED_S = 0.25
CACHED_BY_PREFILL = 8


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    return AutoTokenizer.from_pretrained(str(tiny_llama_dir))


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> tuple[int, ...]:
    return tuple(tokenizer(PROMPT, add_special_tokens=False).input_ids)


@pytest.fixture(scope="module")
def out_ids(tokenizer) -> list[int]:
    ids = tokenizer(TEXT).input_ids
    assert "\ufffd" in tokenizer.decode(ids[3:4])  # the case under test: half a character
    return ids


@dataclass
class Run:
    messages: list[pdserve_pb2.GenerateResponse]
    flight: Flight
    metrics: RouterMetrics
    queue_left: int
    error: BaseException | None = None

    @property
    def token_ids(self) -> list[int]:
        return [t for m in self.messages for t in m.token_ids]

    @property
    def text(self) -> str:
        return "".join(m.text for m in self.messages)

    @property
    def last(self) -> pdserve_pb2.GenerateResponse:
        return self.messages[-1]


def make_req(prompt_ids: Sequence[int], **params) -> ValidRequest:
    params.setdefault("max_tokens", 64)
    return ValidRequest("req-1", tuple(prompt_ids), SamplingParams(**params), "")


def delta(token_ids: Sequence[int] = (), finish: str = "", **kwargs) -> worker_pb2.RequestDelta:
    return worker_pb2.RequestDelta(
        request_id="req-1", token_ids=list(token_ids), finish_reason=finish, **kwargs
    )


def prefill_response(first: int, **kwargs) -> worker_pb2.PrefillResponse:
    kwargs.setdefault("num_cached_tokens", CACHED_BY_PREFILL)
    return worker_pb2.PrefillResponse(first_token_id=first, **kwargs)


def run_stream(
    tokenizer,
    req: ValidRequest,
    items: Sequence[object],
    prefill: worker_pb2.PrefillResponse | None = None,
    coalesce: bool = False,
) -> Run:
    """Runs one ResponseStream over `items` to its end or its exception. Items arrive one at a
    time, each once the stream took the one before (a reader that keeps up), or with
    `coalesce` all before the stream looks (a reader that fell behind)."""
    metrics = RouterMetrics()
    flight = Flight(req.request_id, req.request_id)

    async def main() -> Run:
        mailbox, pending = Mailbox(), list(items)
        placement = Placement(decode=object(), mailbox=mailbox, prefill=prefill)
        stream = ResponseStream(req, tokenizer, placement, time.monotonic(), QUEUED_S, metrics)
        messages: list[pdserve_pb2.GenerateResponse] = []

        async def feed() -> None:
            while pending:
                mailbox.put(pending.pop(0))
                while len(mailbox) and not coalesce:
                    await asyncio.sleep(0)

        async def collect() -> None:
            async for message in stream.run(flight):
                messages.append(message)

        feeder = asyncio.create_task(feed())
        try:
            await asyncio.wait_for(collect(), 5)
        except (WorkerLost, WorkerFailed) as exc:
            return Run(messages, flight, metrics, len(mailbox) + len(pending), exc)
        finally:
            feeder.cancel()
        return Run(messages, flight, metrics, len(mailbox) + len(pending))

    return asyncio.run(main())


def split(ids: Sequence[int], sizes: Sequence[int]) -> list[list[int]]:
    """`ids` cut into consecutive chunks of `sizes` (the last takes the rest)."""
    chunks, start = [], 0
    for size in sizes:
        chunks.append(list(ids[start : start + size]))
        start += size
    chunks.append(list(ids[start:]))
    return chunks


def deltas_for(
    ids: Sequence[int], sizes: Sequence[int], finish: str = "length", **last
) -> list[worker_pb2.RequestDelta]:
    chunks = split(ids, sizes)
    return [delta(c) for c in chunks[:-1]] + [delta(chunks[-1], finish, **last)]


def sample(metrics: RouterMetrics, name: str) -> float:
    for line in metrics.render().decode().splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in the exposition")


def check_shape(run: Run, req: ValidRequest) -> None:
    """Every message names the request; only the last carries finish, usage and timings."""
    assert run.error is None
    assert all(m.request_id == req.request_id for m in run.messages)
    for m in run.messages[:-1]:
        assert not m.finish_reason and not m.HasField("usage") and not m.HasField("timings")
    assert run.last.finish_reason and run.last.HasField("usage") and run.last.HasField("timings")


# ---- (a) remote prefill, (b) local prefill ----


def test_remote_first_token_is_sent_before_any_delta(tokenizer, prompt_ids, out_ids) -> None:
    req = make_req(prompt_ids)
    prefill = prefill_response(out_ids[0])

    async def first_message() -> pdserve_pb2.GenerateResponse:
        mailbox = Mailbox()  # the decode worker has sent nothing yet
        placement = Placement(decode=object(), mailbox=mailbox, prefill=prefill)
        stream = ResponseStream(req, tokenizer, placement, time.monotonic(), 0.0, RouterMetrics())
        agen = stream.run(Flight(req.request_id))
        try:
            return await asyncio.wait_for(agen.__anext__(), 1.0)
        finally:
            await agen.aclose()

    first = asyncio.run(first_message())
    assert list(first.token_ids) == [out_ids[0]]
    assert first.text == "Hello"
    assert not first.finish_reason


def test_remote_drops_the_repeated_first_token(tokenizer, prompt_ids, out_ids) -> None:
    req = make_req(prompt_ids)
    # The decode worker's first delta repeats the prefill's token, then brings two more.
    run = run_stream(tokenizer, req, deltas_for(out_ids, [3, 1, 5]), prefill_response(out_ids[0]))
    check_shape(run, req)
    assert run.token_ids == out_ids
    assert list(run.messages[0].token_ids) == [out_ids[0]]
    assert list(run.messages[1].token_ids) == out_ids[1:3]


def test_remote_first_delta_with_only_the_repeat(tokenizer, prompt_ids, out_ids) -> None:
    req = make_req(prompt_ids)
    items = [delta(out_ids[:1]), *deltas_for(out_ids[1:], [2])]
    run = run_stream(tokenizer, req, items, prefill_response(out_ids[0]))
    check_shape(run, req)
    assert run.token_ids == out_ids


def test_remote_max_tokens_one(tokenizer, prompt_ids, out_ids) -> None:
    """The only token came from prefill; the decode worker's last delta repeats it."""
    req = make_req(prompt_ids, max_tokens=1)
    run = run_stream(tokenizer, req, [delta(out_ids[:1], "length")], prefill_response(out_ids[0]))
    check_shape(run, req)
    assert run.token_ids == out_ids[:1]
    assert run.text == "Hello"
    assert run.last.usage.completion_tokens == 1


def test_local_prefill_skips_nothing(tokenizer, prompt_ids, out_ids) -> None:
    req = make_req(prompt_ids)
    run = run_stream(tokenizer, req, deltas_for(out_ids, [1, 3, 4]))
    check_shape(run, req)
    assert run.token_ids == out_ids
    assert list(run.messages[0].token_ids) == out_ids[:1]


@pytest.mark.parametrize("logprobs", [None, 1])
def test_local_first_delta_merged_by_the_worker_still_sends_its_first_token_alone(
        tokenizer, prompt_ids, out_ids, logprobs) -> None:
    """A worker whose reader fell behind merges its first steps: the first token (the TTFT)
    still goes out alone, with its logprob, then the rest of that delta."""
    req = make_req(prompt_ids, logprobs=logprobs)
    lps = [pdserve_pb2.TokenLogprob(token_id=t, logprob=-0.5) for t in out_ids]
    first = delta(out_ids[:3], logprobs=lps[:3] if logprobs else [])
    rest = delta(out_ids[3:], "length", logprobs=lps[3:] if logprobs else [])
    run = run_stream(tokenizer, req, [first, rest])
    check_shape(run, req)
    assert run.token_ids == out_ids
    assert list(run.messages[0].token_ids) == out_ids[:1]
    assert list(run.messages[1].token_ids) == out_ids[1:3]
    assert [lp.token_id for m in run.messages for lp in m.logprobs] == (
        out_ids if logprobs else [])


# ---- (c) text ----


@pytest.mark.parametrize("sizes", [[1] * 20, [3, 1, 5], [4], [2, 2, 2, 2, 2, 2, 2]])
@pytest.mark.parametrize("remote", [False, True])
def test_text_equals_decode_of_all_tokens(
    tokenizer, prompt_ids, out_ids, sizes, remote: bool
) -> None:
    """The detokenizer's promise: deltas + flush == decode(output) for byte-level BPE."""
    req = make_req(prompt_ids)
    items = deltas_for(out_ids, sizes)
    run = run_stream(tokenizer, req, items, prefill_response(out_ids[0]) if remote else None)
    check_shape(run, req)
    assert run.text == tokenizer.decode(out_ids) == TEXT
    assert "\ufffd" not in run.text


def test_text_with_unmet_stop_strings_is_flushed_whole(tokenizer, prompt_ids, out_ids) -> None:
    """Characters held back for a possible stop string come out in the last message."""
    req = make_req(prompt_ids, stop=("zzzzz", "never"))
    run = run_stream(tokenizer, req, deltas_for(out_ids, [2, 2, 2]))
    assert run.text == TEXT
    assert run.last.finish_reason == "length" and run.last.stop_reason == ""


def test_eos_is_not_text(tokenizer, prompt_ids, out_ids) -> None:
    eos = tokenizer.eos_token_id
    req = make_req(prompt_ids)
    items = [delta(out_ids[:5]), delta([*out_ids[5:], eos], "stop", stop_reason=str(eos))]
    run = run_stream(tokenizer, req, items)
    check_shape(run, req)
    assert run.token_ids == [*out_ids, eos]
    assert run.text == tokenizer.decode([*out_ids, eos], skip_special_tokens=True) == TEXT
    assert (run.last.finish_reason, run.last.stop_reason) == ("stop", str(eos))
    assert run.flight.done


# ---- (d) stop strings ----


@pytest.mark.parametrize("remote", [False, True])
def test_stop_string_across_two_deltas(tokenizer, prompt_ids, remote: bool) -> None:
    ids = tokenizer("The cat sat on the mat and then it slept.").input_ids
    # [The, cat, sat] [on, the, mat] [and, then, ...]: "sat on" spans the first two deltas.
    req = make_req(prompt_ids, stop=("sat on",))
    items = deltas_for(ids, [3, 3])
    run = run_stream(tokenizer, req, items, prefill_response(ids[0]) if remote else None)
    assert run.error is None
    assert run.text == "The cat "
    assert (run.last.finish_reason, run.last.stop_reason) == ("stop", "sat on")
    assert run.token_ids[:4] == ids[:4]  # through " on"; the rest of that delta may follow
    assert run.last.usage.completion_tokens == len(run.token_ids)
    assert run.flight.done is False  # the worker still runs it: the router must abort it
    assert run.queue_left == 1  # nothing read past the stop


def test_stop_string_in_the_prefill_token(tokenizer, prompt_ids, out_ids) -> None:
    req = make_req(prompt_ids, stop=("ell",))
    run = run_stream(tokenizer, req, [delta(out_ids[:3])], prefill_response(out_ids[0]))
    assert len(run.messages) == 1
    assert (run.last.text, run.last.finish_reason, run.last.stop_reason) == ("H", "stop", "ell")
    assert list(run.last.token_ids) == out_ids[:1]
    assert run.flight.done is False
    assert run.queue_left == 1


def test_stop_string_beats_the_worker_finish_reason(tokenizer, prompt_ids, out_ids) -> None:
    """A stop string wins over the worker's finish reason for what the client sees."""
    req = make_req(prompt_ids, stop=("café",))
    run = run_stream(tokenizer, req, deltas_for(out_ids, [4]))
    assert run.text == "Hello there! 😀 How are you, naïve "
    assert (run.last.finish_reason, run.last.stop_reason) == ("stop", "café")


# ---- (e) usage and timings ----


def test_length_finish_remote_usage_and_timings(tokenizer, prompt_ids, out_ids) -> None:
    req = make_req(prompt_ids)
    items = deltas_for(out_ids, [4, 4], num_cached_tokens=3)  # the decode side's count: unused
    run = run_stream(tokenizer, req, items, prefill_response(out_ids[0]))
    check_shape(run, req)
    last = run.last
    assert last.finish_reason == "length" and last.stop_reason == ""
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.cached_tokens) == (
        len(prompt_ids),
        len(out_ids),
        CACHED_BY_PREFILL,
    )
    assert last.timings.queue_s == QUEUED_S
    assert 0 <= last.timings.ttft_s <= last.timings.e2e_s
    assert run.flight.done is True


def test_length_finish_local_usage_from_the_delta(tokenizer, prompt_ids, out_ids) -> None:
    req = make_req(prompt_ids)
    run = run_stream(tokenizer, req, deltas_for(out_ids, [4, 4], num_cached_tokens=5))
    check_shape(run, req)
    usage = run.last.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) == (
        len(prompt_ids),
        len(out_ids),
        5,
    )
    assert 0 <= run.last.timings.ttft_s <= run.last.timings.e2e_s
    assert run.flight.done is True


def test_worker_abort_passes_through(tokenizer, prompt_ids, out_ids) -> None:
    req = make_req(prompt_ids)
    run = run_stream(tokenizer, req, [delta(out_ids[:4]), delta((), "abort")])
    check_shape(run, req)
    assert run.last.finish_reason == "abort"
    assert run.last.usage.completion_tokens == 4
    assert run.text == tokenizer.decode(out_ids[:4])
    assert run.flight.done is True


# ---- (f) failures ----


def test_lost_worker_raises_worker_lost(tokenizer, prompt_ids, out_ids) -> None:
    req = make_req(prompt_ids)
    run = run_stream(tokenizer, req, [delta(out_ids[:2]), Lost("stream broke")])
    assert isinstance(run.error, WorkerLost)
    assert "stream broke" in str(run.error)
    assert run.token_ids == out_ids[:2]
    assert run.flight.done is False  # the router releases it


def test_error_delta_raises_worker_failed(tokenizer, prompt_ids, out_ids) -> None:
    req = make_req(prompt_ids)
    items = [delta(out_ids[:2]), delta((), "error", error="kv transfer timed out")]
    run = run_stream(tokenizer, req, items, prefill_response(out_ids[0]))
    assert isinstance(run.error, WorkerFailed)
    assert "kv transfer timed out" in str(run.error)
    assert run.flight.done is True  # the worker has freed it already


def test_error_delta_without_text_still_fails(tokenizer, prompt_ids) -> None:
    run = run_stream(tokenizer, make_req(prompt_ids), [delta((), "error")])
    assert isinstance(run.error, WorkerFailed)
    assert run.messages == []


# ---- (g) logprobs ----


def _lp(token_id: int) -> pdserve_pb2.TokenLogprob:
    return pdserve_pb2.TokenLogprob(
        token_id=token_id,
        logprob=-(token_id % 7) / 8,
        top=[pdserve_pb2.TopLogprob(token_id=0, logprob=-9.0)],
    )


def _deltas_with_logprobs(ids: Sequence[int], sizes: Sequence[int]):
    chunks = split(ids, sizes)
    return [
        delta(c, "length" if i == len(chunks) - 1 else "", logprobs=[_lp(t) for t in c])
        for i, c in enumerate(chunks)
    ]


@pytest.mark.parametrize("remote", [False, True])
def test_logprobs_pass_through_when_asked(tokenizer, prompt_ids, out_ids, remote: bool) -> None:
    req = make_req(prompt_ids, logprobs=0)
    expected = [_lp(t) for t in out_ids]
    prefill = None
    if remote:  # the prefill worker's logprob is sent; the decode worker's repeat is dropped
        expected[0] = pdserve_pb2.TokenLogprob(token_id=out_ids[0], logprob=-0.5)
        prefill = prefill_response(out_ids[0], logprob=expected[0])
    run = run_stream(tokenizer, req, _deltas_with_logprobs(out_ids, [3, 5]), prefill)
    for m in run.messages:
        assert [lp.token_id for lp in m.logprobs] == list(m.token_ids)
    assert [lp for m in run.messages for lp in m.logprobs] == expected


@pytest.mark.parametrize("remote", [False, True])
def test_logprobs_dropped_when_not_asked(tokenizer, prompt_ids, out_ids, remote: bool) -> None:
    req = make_req(prompt_ids)
    assert req.params.logprobs is None
    prefill = prefill_response(out_ids[0], logprob=_lp(out_ids[0])) if remote else None
    run = run_stream(tokenizer, req, _deltas_with_logprobs(out_ids, [3, 5]), prefill)
    assert run.token_ids == out_ids
    assert all(len(m.logprobs) == 0 for m in run.messages)


# ---- (h) metrics ----


@pytest.mark.parametrize(
    ("sizes", "remote"),
    [
        ([1] * 20, False),
        ([3, 1, 5], False),
        ([3, 1, 5], True),
        ([1, 1, 6], True),
    ],
)
def test_metrics_count_one_ttft_and_a_gap_per_later_token(
    tokenizer, prompt_ids, out_ids, sizes, remote: bool
) -> None:
    req = make_req(prompt_ids)
    run = run_stream(
        tokenizer, req, deltas_for(out_ids, sizes), prefill_response(out_ids[0]) if remote else None
    )
    assert run.token_ids == out_ids
    m = run.metrics
    assert sample(m, "pdserve_time_to_first_token_seconds_count") == 1
    assert sample(m, "pdserve_inter_token_latency_seconds_count") == len(out_ids) - 1
    assert sample(m, "pdserve_e2e_request_latency_seconds_count") == 1
    assert sample(m, "pdserve_generation_tokens_total") == len(out_ids)
    assert sample(m, "pdserve_prompt_tokens_total") == len(prompt_ids)
    cached = CACHED_BY_PREFILL if remote else 0
    assert sample(m, "pdserve_prefix_cache_hit_tokens_total") == cached


def test_stop_string_local_keeps_the_workers_cached_count(tokenizer, prompt_ids) -> None:
    ids = tokenizer("The cat sat on the mat and then it slept.").input_ids
    req = make_req(prompt_ids, stop=("sat on",))
    items = [delta(c, num_cached_tokens=5) for c in split(ids, [3, 3])]
    run = run_stream(tokenizer, req, items)
    assert run.last.finish_reason == "stop"
    assert run.last.usage.cached_tokens == 5


# ---- coalescing: a reader that fell behind gets the backlog as one message ----


@pytest.mark.parametrize("remote", [False, True])
@pytest.mark.parametrize("stop", [(), ("you, na",)])
def test_a_backlog_goes_out_as_one_message_with_the_same_tokens_and_text(
        tokenizer, prompt_ids, out_ids, remote: bool, stop: tuple[str, ...]) -> None:
    """Every delta waiting when the stream looks merges into one message: nothing reordered,
    dropped or repeated, the text still equals the decode of the token ids (and is cut at the
    same stop string), and the first token still goes out alone, first (remote or not)."""
    req = make_req(prompt_ids, stop=stop)
    prefill = prefill_response(out_ids[0]) if remote else None
    items = deltas_for(out_ids, [1, 2, 1, 3, 2])
    steady = run_stream(tokenizer, req, items, prefill)
    backlog = run_stream(tokenizer, req, items, prefill, coalesce=True)
    check_shape(backlog, req)
    assert backlog.token_ids == steady.token_ids
    assert backlog.text == steady.text
    assert (backlog.last.finish_reason, backlog.last.stop_reason) == \
        (steady.last.finish_reason, steady.last.stop_reason)
    assert len(backlog.messages) == 2 < len(steady.messages)
    assert list(backlog.messages[0].token_ids) == [out_ids[0]]
    if not stop:
        assert backlog.text == tokenizer.decode(out_ids, skip_special_tokens=True)


def test_tokens_before_a_lost_worker_in_a_backlog_still_reach_the_client(
        tokenizer, prompt_ids, out_ids) -> None:
    req = make_req(prompt_ids)
    items = [delta(out_ids[:2]), delta(out_ids[2:4]), Lost("decode worker gone")]
    run = run_stream(tokenizer, req, items, coalesce=True)
    assert isinstance(run.error, WorkerLost)
    assert run.token_ids == out_ids[:4]
    # the first token alone (the TTFT), then all the backlog held
    assert [list(m.token_ids) for m in run.messages] == [out_ids[:1], out_ids[1:4]]
