"""What the multi-host cases send and how they judge it: greedy Generates over gRPC, each
recorded as its client saw it (`Outcome`), checked against the offline engine's greedy tokens
(`Greedy`), and one line of numbers per case (`report`, collected into docs/benchmarks.md)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from pdserve.engine.sampling_params import SamplingParams
from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc

CLEAN_ERRORS = ("UNAVAILABLE", "RESOURCE_EXHAUSTED")  # what a client retries on
REQUEST_TIMEOUT_S = 90.0


class Greedy:
    """The offline engine's greedy tokens for prompts (the undisturbed output), each computed
    once."""

    def __init__(self, model_dir: str) -> None:
        self.model_dir, self._llm, self._seen = model_dir, None, {}

    def __call__(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[list[int]]:
        if self._llm is None:
            from pdserve.llm import LLM

            self._llm = LLM(self.model_dir, max_model_len=512, num_kv_blocks=256,
                            num_threads=1)
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        missing = [list(p) for p in prompts if (tuple(p), max_tokens) not in self._seen]
        for prompt, out in zip(missing, self._llm.generate(missing, params) if missing
                               else ()):
            self._seen[(tuple(prompt), max_tokens)] = list(out.token_ids)
        return [self._seen[(tuple(p), max_tokens)] for p in prompts]


@dataclass
class Outcome:
    """One greedy Generate as its client saw it."""

    status: str = ""  # the finish reason ("length"), or the gRPC status it ended with
    tokens: list[int] = field(default_factory=list)
    sent: float = 0.0  # time.monotonic() of the call, of each message, of its end
    arrivals: list[float] = field(default_factory=list)
    ended: float = 0.0

    @property
    def ttft_s(self) -> float | None:
        return self.arrivals[0] - self.sent if self.arrivals else None

    def stall(self, since: float) -> float:
        """The longest wait for a message after `since` (to its end, if it never came)."""
        times = [since, *(a for a in self.arrivals if a > since)]
        if self.status != "length":
            times.append(self.ended)
        return max(b - a for a, b in zip(times, times[1:])) if len(times) > 1 else 0.0


async def generate(channel: grpc.aio.Channel, request_id: str, prompt: Sequence[int],
                   max_tokens: int, started: asyncio.Event | None = None,
                   out: Outcome | None = None, session_id: str = "") -> Outcome:
    """One greedy Generate; `out` (returned) fills in as the messages come."""
    sampling = pdserve_pb2.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    request = pdserve_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=list(prompt),
                                          sampling=sampling, session_id=session_id)
    out = out if out is not None else Outcome()
    out.sent = time.monotonic()
    try:
        async for message in pdserve_pb2_grpc.InferenceStub(channel).Generate(
                request, timeout=REQUEST_TIMEOUT_S):
            out.arrivals.append(time.monotonic())
            out.tokens.extend(message.token_ids)
            out.status = message.finish_reason or out.status
            if started is not None:
                started.set()
    except grpc.aio.AioRpcError as exc:
        out.status = exc.code().name
    finally:
        out.ended = time.monotonic()
        if started is not None:
            started.set()
    return out


def check_outcomes(outcomes: Sequence[Outcome], expected: Sequence[list[int]],
                   errors: bool = False) -> None:
    """Each request has the undisturbed greedy tokens, or (`errors`) ended with a clean error
    status after a prefix of them."""
    for i, (out, want) in enumerate(zip(outcomes, expected, strict=True)):
        if out.status == "length":
            assert out.tokens == want, f"request {i}: tokens differ from the undisturbed run"
        else:
            assert errors and out.status in CLEAN_ERRORS, f"request {i} ended {out.status}"
            assert out.tokens == want[:len(out.tokens)], f"request {i}: wrong tokens"


def random_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 4000) for _ in range(length)] for _ in range(n)]



def report(case: str, **numbers: float) -> None:
    print(f"hosts: {case}: " + ", ".join(f"{k} {v:.2f}" for k, v in numbers.items()))
