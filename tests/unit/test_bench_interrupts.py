"""Random cancels and aborts in `pdserve bench`: the plan, the sender carrying it out against
a scripted client (what the server would stream), and how the summary counts them."""

from __future__ import annotations

import argparse
import asyncio
import math

import pytest

from pdserve.bench.cli import add_parser, check_interrupts
from pdserve.bench.interrupts import check_fractions, plan_interrupts, with_interrupts
from pdserve.bench.metrics import SLO, summarize
from pdserve.bench.report import format_table
from pdserve.bench.runner import grpc_send, run_jobs
from pdserve.bench.trace import RequestRecord, records_from_json, records_to_json
from pdserve.bench.workloads import ABORT, CANCEL, BenchRequest, Interrupt
from pdserve.client import GenerateChunk, PdserveError, Usage


def test_plan_interrupts_exact_counts_at_mid_stream_points():
    lens = [10 + i % 7 for i in range(200)]
    plan = plan_interrupts(lens, 0.1, 0.25, seed=4)
    cancels = [i for i, p in enumerate(plan) if p is not None and p.kind == CANCEL]
    aborts = [i for i, p in enumerate(plan) if p is not None and p.kind == ABORT]
    assert (len(cancels), len(aborts)) == (20, 50)  # round(200 * 0.1), round(200 * 0.25)
    for i in cancels + aborts:
        assert 1 <= plan[i].after_tokens <= lens[i] - 1  # strictly mid-stream
    assert plan == plan_interrupts(lens, 0.1, 0.25, seed=4)  # seeded
    assert plan != plan_interrupts(lens, 0.1, 0.25, seed=5)
    points = {plan[i].after_tokens for i in cancels + aborts}
    assert len(points) > 5  # spread over the stream, not one fixed point


def test_plan_interrupts_skips_turns_without_a_mid_stream():
    lens = [1, 2, 1, 1, 5, 1]  # only indexes 1 and 4 can be cut mid-stream
    plan = plan_interrupts(lens, 0.5, 0.5, seed=0)  # asks for 3 + 3
    assert [i for i, p in enumerate(plan) if p is not None] == [1, 4]
    assert plan[1] == Interrupt(plan[1].kind, 1)  # the only mid-stream point of 2 tokens
    assert {p.kind for p in plan if p is not None} == {CANCEL}  # cancels are served first
    assert plan_interrupts(lens, 0.0, 0.0, seed=0) == [None] * 6


@pytest.mark.parametrize("cancel,abort,match", [
    (-0.1, 0.0, "cancel_fraction"), (0.0, 1.5, "abort_fraction"),
    (math.nan, 0.0, "cancel_fraction"), (0.6, 0.5, "<= 1"),
])
def test_fractions_are_checked(cancel, abort, match):
    with pytest.raises(ValueError, match=match):
        check_fractions(cancel, abort)
    with pytest.raises(ValueError, match=match):
        plan_interrupts([10], cancel, abort, seed=0)


def test_interrupt_validation():
    with pytest.raises(ValueError, match="kind"):
        Interrupt("stop", 3)
    with pytest.raises(ValueError, match="mid-stream"):
        Interrupt(CANCEL, 0)


def test_with_interrupts_keeps_every_job_and_turn():
    jobs = [[BenchRequest([1, 2], 8, "s", 0), BenchRequest([3], 8, "s", 1)],
            [BenchRequest([4, 5], 8)], [BenchRequest([6], 8)]]
    out = with_interrupts(jobs, 0.5, 0.0, seed=1)  # 2 of the 4 turns
    assert [[(t.prompt_token_ids, t.session_id, t.turn) for t in j] for j in out] == \
        [[(t.prompt_token_ids, t.session_id, t.turn) for t in j] for j in jobs]
    assert sum(t.interrupt is not None for j in out for t in j) == 2
    assert all(t.interrupt is None for j in jobs for t in j)  # the input is left alone


# ---------------------------------------------------------------------------- the sender


class ScriptedClient:
    """Streams `tokens` one per chunk, then finish "length"; after an Abort it answers
    `found` for, the next chunk ends the stream with "abort" (as the router does)."""

    def __init__(self, tokens: int, found: bool = True, fail_at: int | None = None) -> None:
        self.tokens, self.found, self.fail_at = tokens, found, fail_at
        self.aborted: list[str] = []
        self.closed_after: int | None = None  # tokens sent when the stream was closed early

    def generate(self, prompt, *, sampling, session_id, request_id, timeout):
        async def stream():
            sent = 0
            try:
                while sent < self.tokens:
                    await asyncio.sleep(0)
                    if self.aborted and self.found:
                        yield GenerateChunk(request_id, "", (), finish_reason="abort",
                                            usage=Usage(len(prompt), sent, 0))
                        return
                    if sent == self.fail_at:
                        raise PdserveError(_unavailable(), "worker lost")
                    sent += 1
                    last = sent == self.tokens
                    yield GenerateChunk(request_id, "", (sent,),
                                        finish_reason="length" if last else None,
                                        usage=Usage(len(prompt), sent, 0) if last else None)
            finally:
                if sent < self.tokens:
                    self.closed_after = sent
        return stream()

    async def abort(self, request_id: str, timeout: float | None = None) -> bool:
        self.aborted.append(request_id)
        return self.found


def _unavailable():
    import grpc

    return grpc.StatusCode.UNAVAILABLE


def _send(client: ScriptedClient, interrupt: Interrupt | None) -> RequestRecord:
    turn = BenchRequest([1, 2, 3], client.tokens, interrupt=interrupt)
    record, _ = asyncio.run(grpc_send(client)("r1", turn, [1, 2, 3], 0.0, 0.0, 10.0))
    return record


def test_cancel_stops_reading_and_closes_the_stream_at_its_point():
    client = ScriptedClient(tokens=10)
    record = _send(client, Interrupt(CANCEL, 4))
    assert (record.interrupted, record.error, record.num_output_tokens) == (CANCEL, None, 4)
    assert client.closed_after == 4 and client.aborted == []  # the RPC was cancelled there
    assert not record.ok


def test_abort_asks_the_router_and_reads_to_the_abort():
    client = ScriptedClient(tokens=10)
    record = _send(client, Interrupt(ABORT, 3))
    assert client.aborted == ["r1"]  # once, for this request
    assert (record.interrupted, record.error, record.num_output_tokens) == (ABORT, None, 3)
    assert client.closed_after is None or client.closed_after == 3


def test_abort_that_found_nothing_leaves_a_complete_answer():
    client = ScriptedClient(tokens=10, found=False)
    record = _send(client, Interrupt(ABORT, 3))
    assert client.aborted == ["r1"]
    assert (record.interrupted, record.num_output_tokens, record.ok) == ("", 10, True)


def test_error_before_the_point_is_a_failure_not_an_interrupt():
    client = ScriptedClient(tokens=10, fail_at=2)
    record = _send(client, Interrupt(CANCEL, 5))
    assert (record.error, record.interrupted, record.num_output_tokens) == ("UNAVAILABLE", "", 2)


def test_run_jobs_ends_a_conversation_at_an_interrupted_turn():
    client = ScriptedClient(tokens=6)
    jobs = [[BenchRequest([1], 6, "s", 0, Interrupt(CANCEL, 2)), BenchRequest([2], 6, "s", 1)],
            [BenchRequest([3], 6)]]
    records, _ = asyncio.run(run_jobs(grpc_send(client), jobs, [0.0, 0.0], progress=False))
    assert sorted((r.request_id, r.interrupted) for r in records) == [
        ("bench-0-0", CANCEL), ("bench-1-0", "")]


# ---------------------------------------------------------------------------- the counts


def test_summary_counts_interrupts_apart_from_successes_and_failures():
    ok = RequestRecord("ok", 0.0, 1.0, (0.5, 1.0), (1, 1), 10)
    cancelled = RequestRecord("c", 0.0, 9.0, (0.1,), (1,), 10, interrupted=CANCEL)
    aborted = RequestRecord("a", 0.0, 9.0, (0.1, 0.2), (1, 1), 10, interrupted=ABORT)
    failed = RequestRecord("f", 0.0, 2.0, (), (), 10, error="UNAVAILABLE")
    s = summarize([ok, cancelled, aborted, failed], 2.0, SLO(e2e_s=5.0))
    assert (s.num_requests, s.num_ok, s.num_errors) == (4, 1, 1)
    assert (s.num_cancelled, s.num_aborted) == (1, 1)
    assert s.errors_by_code == {"UNAVAILABLE": 1}
    assert s.total_output_tokens == 2 and s.e2e.p50 == 1.0  # only the ok request's
    assert s.slo_attainment == 0.5  # ok meets it, failed misses; the interrupted don't count
    lines = format_table(s).splitlines()
    assert [ln.split()[-1] for ln in lines if ln.startswith(("Cancelled", "Aborted"))] == \
        ["1", "1"]


def test_record_interrupted_round_trips_and_is_checked():
    r = RequestRecord("c", 0.0, 1.0, (0.5,), (1,), 3, interrupted=ABORT)
    assert records_from_json(records_to_json([r])) == [r]
    assert records_from_json([{k: v for k, v in records_to_json([r])[0].items()
                               if k != "interrupted"}])[0].interrupted == ""  # older files
    with pytest.raises(ValueError, match="interrupted"):
        RequestRecord("c", 0.0, 1.0, (), (), 3, interrupted="closed")


def test_cli_flags_and_backend_check():
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["bench", "--cancel-fraction", "0.2", "--abort-fraction", "0.1"])
    assert (args.cancel_fraction, args.abort_fraction) == (0.2, 0.1)
    check_interrupts(args)
    args.backend = "openai"
    with pytest.raises(ValueError, match="--backend grpc"):
        check_interrupts(args)
    args.backend, args.abort_fraction = "grpc", 0.9
    with pytest.raises(ValueError, match="<= 1"):
        check_interrupts(args)
