"""PrefixPulls: a session turn's prefix pulled from the decode worker that still caches it.

A session's turn may land on another decode worker than its last one's (that one full,
draining or excluded). When the last one is up and single-rank (its load names a `kv_source`),
the chosen worker may pull the prefix it caches — all of the session's history but its last
token, in whole blocks — instead of having it recomputed: `policy.pull_tokens` takes the pull
when, at the measured seconds per pulled block (this object's moving average, owned here), it
beats recomputing those tokens at the fastest prefill worker's measured rate; until both are
measured a pull is tried. The chosen worker reserves the blocks (`Submit` with pull fields),
then `run` has the holder push them (`PushPrefix`). A pull never fails the request: whatever
goes wrong, the puller computes the prefix itself (told at once, or at the pull's deadline:
twice the measured pull time plus PULL_SLACK_S, within the KV transfer deadline).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass

from pdserve.proto import worker_pb2
from pdserve.router.config import RouterConfig
from pdserve.router.decode_client import DecodeClient
from pdserve.router.metrics import RouterMetrics
from pdserve.router.policy import PullCosts, pull_tokens, shared_prefix_len
from pdserve.router.store import Session
from pdserve.router.validation import InvalidArgument, ValidRequest
from pdserve.router.workers import PrefillClient, ReservationLost, WorkerLost
from pdserve.wire import lora_to_proto

logger = logging.getLogger(__name__)

PULL_EMA = 0.2  # weight of the latest pull in the measured pull cost
# A pull not landed after twice its measured cost and this is given up (computed instead);
# until a pull was measured, the KV transfer deadline bounds it.
PULL_SLACK_S = 1.0


@dataclass(frozen=True)
class Pull:
    """A prefix the chosen decode worker pulls from the one that holds it."""

    holder: DecodeClient
    source: worker_pb2.Endpoint  # the holder's KV identity (its load's kv_source)
    num_tokens: int
    deadline: float  # time.time()
    prefill_s_per_token: float | None  # what recomputing them would cost, as measured
    predicted_s: float = 0.0  # how long it takes, at the pulls' measured cost (0: unmeasured)


class PrefixPulls:
    """Reads the router's worker tables; owns the measured cost of a pull."""

    def __init__(self, config: RouterConfig, metrics: RouterMetrics,
                 prefill: Mapping[str, PrefillClient],
                 decode: Mapping[str, DecodeClient]) -> None:
        self.config, self.metrics = config, metrics
        self.prefill, self.decode = prefill, decode
        self.pull_s_per_block: float | None = None  # moving average of the pulls measured

    def choose(self, req: ValidRequest, session: Session, decode: DecodeClient,
               deadline: float) -> Pull | None:
        """Whether `decode` should pull the prefix the session's last decode worker caches
        (all of its history but the last token), and how much of it; `deadline`
        (time.monotonic()) is the request's KV transfer deadline."""
        holder = self.decode.get(session.decode_worker)
        if (holder is None or holder is decode or not holder.up or holder.load is None
                or not holder.load.HasField("kv_source") or req.params.prompt_logprobs
                is not None):
            return None
        prompt = req.prompt_token_ids
        held = min(shared_prefix_len(session.token_ids, prompt), len(session.token_ids) - 1)
        rate = self.prefill_s_per_token(decode)
        num_tokens = pull_tokens(len(prompt), held, self.config.block_size,
                                 PullCosts(self.pull_s_per_block, rate))
        if not num_tokens:
            return None
        wait_s, predicted = deadline - time.monotonic(), 0.0
        if self.pull_s_per_block is not None:
            predicted = self.pull_s_per_block * num_tokens / self.config.block_size
            wait_s = min(wait_s, 2 * predicted + PULL_SLACK_S)
        return Pull(holder, holder.load.kv_source, num_tokens, time.time() + max(wait_s, 0.0),
                    rate, predicted)

    def prefill_s_per_token(self, decode: DecodeClient) -> float | None:
        """What recomputing a prompt token costs, as measured: on the fastest prefill worker
        (where a prompt goes by default), or colocated, on `decode` itself."""
        rates = [c.load.prefill_s_per_token for c in self.prefill.values()
                 if c.in_rotation and c.load is not None and c.load.prefill_s_per_token > 0]
        if not rates and decode.load is not None and decode.load.prefill_s_per_token > 0:
            rates = [decode.load.prefill_s_per_token]
        return min(rates) if rates else None

    async def run(self, req: ValidRequest, rid: str, pull: Pull, descriptor: bytes) -> None:
        """Have the holder push the prefix the puller reserved (`descriptor`; empty: it held
        that prefix already). Never fails the request: a pull that fails is computed by the
        puller (told at once by the holder, or at the pull's deadline)."""
        if not descriptor:
            self.metrics.count_pull("held")
            return
        started = time.monotonic()
        try:
            reply = await pull.holder.push_prefix(worker_pb2.PushPrefixRequest(
                request_id=rid, prompt_token_ids=req.prompt_token_ids[:pull.num_tokens],
                lora=lora_to_proto(req.lora), descriptor=descriptor),
                timeout=max(pull.deadline - time.time(), 0.001))
        except ReservationLost as exc:
            logger.info("%s: %s no longer holds the prefix: %s", req.request_id,
                        pull.holder.worker_id, exc)
            self.metrics.count_pull("missed")
            return
        except (WorkerLost, InvalidArgument) as exc:
            logger.warning("%s: pulling its prefix from %s failed: %s", req.request_id,
                           pull.holder.worker_id, exc)
            self.metrics.count_pull("failed")
            return
        seconds = time.monotonic() - started
        per_block = seconds / (pull.num_tokens // self.config.block_size)
        self.pull_s_per_block = per_block if self.pull_s_per_block is None else (
            PULL_EMA * per_block + (1 - PULL_EMA) * self.pull_s_per_block)
        self.metrics.count_pull("pulled", reply.transfer_bytes,
                                pull.num_tokens * (pull.prefill_s_per_token or 0.0) - seconds)
