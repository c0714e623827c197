"""Drive a running pdserve with a workload and record every request's stream.

A job is one conversation: a list of turns sent one after the other (a plain request is a
one-turn job). Turn t's prompt is the conversation so far — every earlier prompt and answer —
followed by the turn's new tokens, sent with the job's session id, so later turns find their
prefix cached. Jobs start at their send times (open loop: Poisson, fixed rate, or all at once)
and at most `concurrency` run at a time (closed loop when every send time is 0).

A `Send` carries one turn to the server and records its stream: `grpc_send(client)` for
pdserve's own API, `OpenAIBackend.send` (bench/openai_backend.py) for any OpenAI server.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from pdserve.bench.trace import RequestRecord
from pdserve.bench.workloads import ABORT, CANCEL, BenchRequest, Interrupt, turn_prompt
from pdserve.client import AsyncClient, GenerateChunk, PdserveError
from pdserve.engine.sampling_params import SamplingParams

Job = Sequence[BenchRequest]
# (request_id, turn, prompt, t0, temperature, timeout_s) -> (record, output token ids)
Send = Callable[[str, BenchRequest, list[int], float, float, float],
                Awaitable[tuple[RequestRecord, list[int]]]]
ABORT_TIMEOUT_S = 10.0  # the router answers Abort at once; a slow answer is not the point


async def run_jobs(
    send: Send,
    jobs: Sequence[Job],
    send_times: Sequence[float],
    concurrency: int | None = None,
    temperature: float = 0.0,
    timeout_s: float = 600.0,
    progress: bool = True,
) -> tuple[list[RequestRecord], float]:
    """Every turn's record (in completion order) and the run's duration in seconds."""
    if len(send_times) != len(jobs):
        raise ValueError(f"send_times: {len(send_times)} times for {len(jobs)} jobs")
    limit = asyncio.Semaphore(concurrency or len(jobs) or 1)
    records: list[RequestRecord] = []
    bar = _progress_bar(sum(len(j) for j in jobs), progress)
    start = time.perf_counter()

    async def job(i: int, turns: Job) -> None:
        await asyncio.sleep(max(0.0, start + send_times[i] - time.perf_counter()))
        async with limit:
            history: list[int] = []
            for turn in turns:
                prompt = turn_prompt(history, turn)
                record, output = await send(f"bench-{i}-{turn.turn}", turn, prompt, start,
                                            temperature, timeout_s)
                records.append(record)
                bar.update(1)
                if not record.ok:
                    return  # a conversation can't go on without its (whole) answer
                history = prompt + output

    await asyncio.gather(*(job(i, turns) for i, turns in enumerate(jobs)))
    bar.close()
    return records, time.perf_counter() - start


def grpc_send(client: AsyncClient) -> Send:
    """Send turns over pdserve's gRPC API (token ids and per-step chunks, exactly); a turn
    with an `interrupt` is cancelled, or aborted through the router, at its point."""

    async def send(request_id: str, turn: BenchRequest, prompt: list[int], t0: float,
                   temperature: float, timeout_s: float) -> tuple[RequestRecord, list[int]]:
        params = SamplingParams(temperature=temperature, max_tokens=turn.output_len,
                                ignore_eos=True, seed=None)
        seen = _Seen(t0)
        sent = time.perf_counter() - t0
        stream = client.generate(prompt, sampling=params, session_id=turn.session_id,
                                 request_id=request_id, timeout=timeout_s)
        try:
            async with contextlib.aclosing(stream):
                await _read(client, request_id, stream, turn.interrupt, seen)
        except PdserveError as exc:
            seen.error, seen.interrupted = exc.code.name, ""
        record = RequestRecord(
            request_id=request_id, start=sent, end=time.perf_counter() - t0,
            chunk_times=tuple(seen.times), chunk_tokens=tuple(seen.counts),
            num_prompt_tokens=len(prompt), error=seen.error, cached_tokens=seen.cached,
            session_id=turn.session_id, interrupted=seen.interrupted,
        )
        return record, seen.output

    return send


@dataclass
class _Seen:
    """What one stream brought so far."""

    t0: float
    times: list[float] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    cached: int = 0
    error: str | None = None
    interrupted: str = ""

    def add(self, chunk: GenerateChunk) -> None:
        if chunk.token_ids:
            self.times.append(time.perf_counter() - self.t0)
            self.counts.append(len(chunk.token_ids))
            self.output.extend(chunk.token_ids)
        if chunk.usage is not None:
            self.cached = chunk.usage.cached_tokens


async def _read(client: AsyncClient, request_id: str, stream: AsyncIterator[GenerateChunk],
                cut: Interrupt | None, seen: _Seen) -> None:
    """Read the stream into `seen`, carrying out `cut` once its point is reached: a cancel
    stops reading (closing the stream cancels the RPC); an abort asks the router and reads
    on. Only a stream that then ends with "abort" counts as aborted: an abort that raced
    the last token leaves a complete answer."""
    async for chunk in stream:
        seen.add(chunk)
        if cut is not None and len(seen.output) >= cut.after_tokens and not chunk.finish_reason:
            if cut.kind == CANCEL:
                seen.interrupted = CANCEL
                return
            cut = None
            with contextlib.suppress(PdserveError):  # not delivered: the request runs on
                await client.abort(request_id, timeout=ABORT_TIMEOUT_S)
        if chunk.finish_reason == "abort":
            seen.interrupted = ABORT


def _progress_bar(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, disable=not enabled, unit="req", leave=False, smoothing=0.1,
                mininterval=0.5)
