"""Scheduler: continuous batching with chunked prefill under a token budget.

Each step it gives every running request its next tokens (a decode is one token, a prefill
a chunk), then admits waiting requests while the token budget, `max_num_seqs` and the KV pool
allow. When the pool runs dry it preempts the newest running request by recompute: its
blocks are freed and it waits at the front of the queue, keeping its generated tokens.
The scheduler owns the queues; the KV manager owns the blocks. No torch.

With `step_target_s` the token budget is also sized in time by the scheduler's step-time
model (engine.step_budget), which the engine feeds through `observe_step` after each step;
with `scheduling_policy="srpt"` waiting requests are admitted shortest remaining prefill
first, aged by waiting time (preempted ones still first). Running requests keep their order.

With a KV connector (engine.kv_connector) a request's prompt KV may come from elsewhere:
`reserve_remote` holds its blocks and leaves it with the connector, in no queue, until a
`poll` at the top of `schedule` says it is ready (it then runs from its first token) or
that its transfer failed (it ends with an error). Outputs made there leave with the step's.
A pull (`RemotePrefill.num_tokens`: a prompt prefix another decode worker holds) reserves the
prefix's blocks alone; landed, the request joins the queue with that prefix computed (and
cached here), and its rest is prefilled here; failed or expired, it joins the queue from
scratch: the prefix is recomputed, never lost.

With KV tiers (engine.kv_tiers) a waiting request's prefix continues below the device: blocks
in host memory are loaded into its fresh blocks in its first step (each layer's before that
layer runs); a request whose prefix is being read back from disk keeps its place in the queue
until it has landed. The plan carries the tiers' copies to the runner, and its result says
which landed.

`Scheduler.stats` (`SchedulerStats`): what the scheduler has done, as cumulative counters.

Why one file: the queues, admission (with its prefix hits from every tier), preemption and the
plan are one state machine over the same queues and blocks; split, each part would reach into
the others' state, which the scheduler alone owns.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.engine.config import SchedulerConfig
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.kv_connector import KVArrival, KVConnector, RemotePrefill
from pdserve.engine.kv_tiers import TierHit
from pdserve.engine.lora_request import LoRARequest
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.scheduler_output import (
    EngineCoreOutput,
    KVSaveResult,
    RunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
    TokenLogprobs,
)
from pdserve.engine.step_budget import StepTimeModel, srpt_order, token_budget, tokens_per_s

logger = logging.getLogger(__name__)


@dataclass
class SchedulerStats:
    num_computed_tokens: int = 0  # tokens run through the model, all steps
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # Of those, tokens copied back from the KV tiers (engine.kv_tiers), and the prefill time
    # they would have cost at the step-time model's marginal rate when they were loaded.
    num_tier_tokens: int = 0
    tier_saved_s: float = 0.0
    # Prompt tokens pulled from another decode worker's prefix cache instead of computed, and
    # those whose pull failed or expired (computed here after all).
    num_pulled_tokens: int = 0
    num_failed_pull_tokens: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    # Speculative decoding: one verification = one sequence's drafts checked in one step.
    num_spec_verifications: int = 0
    num_draft_tokens: int = 0  # drafts verified
    num_accepted_tokens: int = 0  # drafts accepted (each verification also emits one more)


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, kv_cache: KVCacheManager, max_model_len: int,
        connector: KVConnector | None = None, max_loras: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`max_loras`: the most LoRA adapters one step may run (the runner's slots).
        `clock`: the time base of requests' `arrival_time` (tests pass their own)."""
        self.config = config
        self.step_time = StepTimeModel()  # fed by observe_step; sizes steps, rates prompts
        self._clock = clock
        self.max_loras = max_loras
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        self.connector = connector
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # waiting, running, and reserved for remote KV
        self.stats = SchedulerStats()
        self._finished_ids: list[str] = []
        self._outputs: list[EngineCoreOutput] = []  # made in schedule(), handed out by update()
        self._inflight: SchedulerOutput | None = None  # scheduled, not yet updated

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in flight")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_runnable_requests(self) -> bool:
        """Whether a step would compute anything (reserved requests only wait for KV)."""
        return bool(self.running or self.waiting)

    def num_prefill_tokens(self) -> int:
        """Prompt tokens queued here and not computed yet: the waiting requests' and those of
        running ones part-way through their prefill (KV coming from elsewhere is not).
        Safe from another thread (a racy snapshot): the deque is copied in one step."""
        return sum(max(r.num_prompt_tokens - r.num_computed_tokens, 0)
                   for queue in (tuple(self.waiting), self.running) for r in queue)

    @property
    def num_remote(self) -> int:
        """Requests holding blocks while their prompt KV arrives from elsewhere."""
        return len(self.requests) - len(self.running) - len(self.waiting)

    def finish_request(self, request_id: str, status: RequestStatus) -> bool:
        """End a request from outside (abort, stop string); False if it is not in flight."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        if request in self.running:
            self.running.remove(request)
        elif request.status is not RequestStatus.WAITING_FOR_REMOTE_KV:
            self.waiting.remove(request)
        self._finish(request, status)
        return True

    def reserve_remote(self, request: Request) -> object | None:
        """Decode side: hold blocks for a prompt whose KV another worker computes; returns
        the connector's descriptor of the transfer.

        Admission is memory reservation: None (nothing held) when the pool or
        `max_num_seqs` cannot take the request now. Leading prompt blocks already in the
        prefix cache are shared, not reserved anew, and those in the host tier are loaded
        (before any step could run the request): `num_cached_tokens` tells the connector they
        need no KV from elsewhere. A prefix on disk is not waited for (nor read) here.

        A pull reserves the pulled prefix's blocks alone. When this worker holds that whole
        prefix already, nothing is pulled: the request is queued for a local prefill and None
        is returned (it is then in `requests`).
        """
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in flight")
        if self.connector is None:
            raise ValueError("this engine has no KV connector: it cannot take remote KV")
        if len(self.running) + self.num_remote >= self.config.max_num_seqs:
            return None
        remote = request.kv_transfer
        pulled = remote.num_tokens if isinstance(remote, RemotePrefill) else None
        num_remote = pulled or request.num_prompt_tokens  # tokens whose KV comes from elsewhere
        # a prefill computes the prompt's last token at least; a pulled prefix may be all hits
        limit = num_remote + 1 if pulled else num_remote
        hits = self.kv_cache.find_cached_prefix(request, limit)
        below = self.kv_cache.find_tier_hit(request, hits, limit, wait=False)
        num_hit = (len(hits) + len(below.host_slots)) * self.kv_cache.block_size
        if pulled is not None and num_hit >= pulled:  # held here already: nothing to pull
            request.kv_transfer = None
            self.add_request(request)
            return None
        if not self.kv_cache.allocate(request, num_remote - num_hit, hits, below.host_slots):
            return None
        request.num_cached_tokens = num_hit
        block_ids = self.kv_cache.block_ids(request.request_id)
        try:
            descriptor = self.connector.reserve(request, block_ids)
        except BaseException:
            self.kv_cache.forget(request)
            raise
        if pulled is None:  # a pull's own hits count once it is queued (_queue_pulled)
            self.stats.num_cached_tokens += num_hit
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.requests[request.request_id] = request
        return descriptor

    def abort_step(self, reason: str) -> list[EngineCoreOutput]:
        """The last schedule() never reached update() (its forward raised): end each of its
        requests with an error. Returns their outputs, and any made by that schedule()."""
        plan, self._inflight = self._inflight, None
        outputs, self._outputs = self._outputs, []
        for entry in plan.requests if plan is not None else ():
            request = self.requests.get(entry.request_id)
            if request is not None:
                self.running.remove(request)
                outputs.append(self._end(request, RequestStatus.FINISHED_ERROR, reason))
        return outputs

    def schedule(self) -> SchedulerOutput:
        self._apply_connector_events()
        scheduled: list[tuple[Request, int]] = []
        adapters: set[LoRARequest] = set()  # of the step's requests: at most max_loras
        budget, preempted = self._schedule_running(scheduled, adapters, self.step_token_budget())
        if not preempted:
            self._admit_waiting(scheduled, adapters, budget)
        self._inflight = self._plan(scheduled)
        return self._inflight

    def step_token_budget(self) -> int:
        """Tokens the next step may compute: `max_num_batched_tokens`, or with `step_target_s`
        (once the step-time model can predict) what should last about that long, but never
        less than the running decodes need plus a block of prefill progress."""
        cap, target = self.config.max_num_batched_tokens, self.config.step_target_s
        if target is None:
            return cap
        decodes = sum(1 + len(r.spec_token_ids) for r in self.running
                      if r.num_tokens - r.num_computed_tokens == 1)
        floor = decodes + self.kv_cache.block_size
        return token_budget(self.step_time.fit(), target, floor, cap, decodes)

    def observe_step(self, num_tokens: int, seconds: float, num_decodes: int = 0) -> None:
        """The engine ran a step of `num_tokens` tokens, `num_decodes` of them one-token
        decodes, in `seconds` (wall time of the runner's execute, a prefill worker's KV pushes
        included): it teaches the step-time model. Steps that computed nothing are ignored."""
        self.step_time.observe(num_tokens, seconds, num_decodes)

    def _schedule_running(
        self, scheduled: list[tuple[Request, int]], adapters: set[LoRARequest], budget: int,
    ) -> tuple[int, bool]:
        """Give running requests their next tokens, decodes first (a prompt's chunk takes
        what the step's budget has left: under a time-sized budget it would otherwise hold
        every decode behind it until it is done), then in order, preempting the last when
        the pool runs dry. Returns the budget left and whether anyone was preempted."""
        self.running.sort(key=lambda r: r.num_tokens - r.num_computed_tokens > 1)  # stable
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if not self._adapter_fits(request, adapters):  # it waits for a slot, blocks kept
                i += 1
                continue
            num_left = request.num_tokens - request.num_computed_tokens
            num_new = min(num_left + len(request.spec_token_ids), budget)
            while not self.kv_cache.allocate(request, num_new):
                if num_new > num_left:  # drafts go before anyone is preempted
                    request.spec_token_ids.clear()
                    num_new = num_left
                    continue
                preempted = True
                victim = self.running.pop()
                self._preempt(victim)
                if victim is request:
                    break
            else:
                scheduled.append((request, num_new))
                budget -= num_new
                i += 1
        return budget, preempted

    def _admit_waiting(
        self, scheduled: list[tuple[Request, int]], adapters: set[LoRARequest], budget: int,
    ) -> None:
        """Admit waiting requests, in the policy's order, while budget, seqs and pool allow."""
        if self.config.scheduling_policy == "srpt":
            rate = tokens_per_s(self.step_time.fit())
            self.waiting = deque(srpt_order(self.waiting, self._clock(), rate))
        held: list[Request] = []  # a grammar compiling or no adapter slot: they keep their place
        while self.waiting and budget > 0:
            if len(self.running) >= self.config.max_num_seqs:
                break
            request = self.waiting[0]
            if (request.grammar is not None and not request.grammar.ready
                    or not self._adapter_fits(request, adapters)):
                held.append(self.waiting.popleft())
                continue
            if request.grammar is not None and request.grammar.error is not None:
                self.waiting.popleft()
                self._outputs.append(self._end(request, RequestStatus.FINISHED_ERROR,
                                               request.grammar.error))
                continue
            if request.num_computed_tokens:  # a pulled prefix: its blocks are held already
                hits, below, num_hit = [], TierHit(), request.num_computed_tokens
            else:
                hits = self.kv_cache.find_cached_prefix(request)
                below = self.kv_cache.find_tier_hit(request, hits)
                num_hit = (len(hits) + len(below.host_slots)) * self.kv_cache.block_size
            if below.promoting:  # its prefix is on its way up from disk
                held.append(self.waiting.popleft())
                continue
            num_new = min(request.num_tokens - num_hit, budget)
            if not self.kv_cache.allocate(request, num_new, hits, below.host_slots):
                break
            self.waiting.popleft()
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
                self.stats.num_cached_tokens += num_hit
            if below.host_slots:
                num_loaded = len(below.host_slots) * self.kv_cache.block_size
                self.stats.num_tier_tokens += num_loaded
                self.stats.tier_saved_s += num_loaded / tokens_per_s(self.step_time.fit())
            request.num_computed_tokens = num_hit
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append((request, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(held))

    def _adapter_fits(self, request: Request, adapters: set[LoRARequest]) -> bool:
        """Whether the step may run `request`'s LoRA adapter (then counted in `adapters`)."""
        if request.lora is None or request.lora in adapters:
            return True
        if self.max_loras is not None and len(adapters) >= self.max_loras:
            return False
        adapters.add(request.lora)
        return True

    def update(self, plan: SchedulerOutput, result: RunnerOutput) -> list[EngineCoreOutput]:
        """Advance every scheduled request by what ran; append sampled tokens; finish."""
        self._inflight = None
        if self.kv_cache.tiers is not None:
            self.kv_cache.tiers.apply(result.kv_tiers)
        outputs, self._outputs = self._outputs, []
        self.stats.num_steps += bool(plan.requests)
        for entry in plan.requests:
            request = self.requests.get(rid := entry.request_id)
            if request is None:  # finished from outside while the step ran
                continue
            token_ids = result.sampled_token_ids.get(rid, ())
            num_accepted = len(token_ids) - 1 if entry.num_spec_tokens else 0
            request.num_computed_tokens += entry.num_tokens - entry.num_spec_tokens
            self.stats.num_computed_tokens += entry.num_tokens
            request.add_prompt_logprobs(entry.prompt_logprobs, result.prompt_logprobs.get(rid))
            if entry.num_spec_tokens:
                self.stats.num_spec_verifications += 1
                self.stats.num_draft_tokens += entry.num_spec_tokens
                self.stats.num_accepted_tokens += num_accepted
            self.kv_cache.cache_computed_blocks(request)
            save = result.kv_saves.get(rid)
            if save is not None and save.error is not None:  # its KV never reached decode
                self.running.remove(request)
                outputs.append(self._end(request, RequestStatus.FINISHED_ERROR, save.error))
                continue
            if token_ids:
                logprobs = result.logprobs.get(rid, ())
                outputs.append(self._append_tokens(request, token_ids, logprobs, save))
            if num_accepted and not request.status.finished:
                # The accepted drafts' KV is kept; rejected drafts' slots are rolled back
                # (written over next step), and no block hash ever covers them.
                request.num_computed_tokens += num_accepted
                self.kv_cache.cache_computed_blocks(request)
        return outputs

    def _apply_connector_events(self) -> None:
        """Admit reserved requests whose KV has landed; end those whose transfer failed."""
        if self.connector is None:
            return
        events = self.connector.poll()
        for request_id, why in events.failed:
            if (request := self.requests.get(request_id)) is None:
                continue
            if isinstance(request.kv_transfer, RemotePrefill) and request.kv_transfer.is_pull:
                self._queue_pulled(request, why)
            else:
                self._outputs.append(self._end(request, RequestStatus.FINISHED_ERROR, why))
        for arrival in events.ready:
            if arrival.request_id not in self.requests:
                continue
            if arrival.first_token is None:
                self._queue_pulled(self.requests[arrival.request_id])
            else:
                self._outputs.append(self._admit_remote(arrival))

    def _queue_pulled(self, request: Request, failure: str | None = None) -> None:
        """A pull ended: queue the request (first: it was admitted before those behind) for a
        local prefill after its pulled prefix, now cached here too; after a failure, from
        scratch, its blocks freed (whatever of the prefix landed is not trusted)."""
        assert request.status is RequestStatus.WAITING_FOR_REMOTE_KV, request.status
        num_pulled, num_own = request.kv_transfer.num_tokens, request.num_cached_tokens
        request.kv_transfer, request.status = None, RequestStatus.WAITING
        if failure is None:
            request.num_computed_tokens = request.num_cached_tokens = num_pulled
            self.kv_cache.cache_computed_blocks(request)
            self.stats.num_cached_tokens += num_own
            self.stats.num_pulled_tokens += num_pulled - num_own
        else:
            logger.warning("request %s: pulling %d prompt tokens failed (%s); computing them "
                           "here", request.request_id, num_pulled - num_own, failure)
            self.kv_cache.free(request)
            request.num_cached_tokens = -1  # admission counts this worker's own hits anew
            self.stats.num_failed_pull_tokens += num_pulled - num_own
        self.waiting.appendleft(request)

    def _admit_remote(self, arrival: KVArrival) -> EngineCoreOutput:
        """The prompt's KV has landed: run the request from its first token on."""
        request = self.requests[arrival.request_id]
        assert request.status is RequestStatus.WAITING_FOR_REMOTE_KV, request.status
        if request.grammar is not None and request.grammar.error is not None:
            return self._end(request, RequestStatus.FINISHED_ERROR, request.grammar.error)
        request.num_computed_tokens = request.num_prompt_tokens
        request.num_cached_tokens = max(request.num_cached_tokens, 0)
        request.status = RequestStatus.RUNNING
        self.kv_cache.cache_computed_blocks(request)
        self.running.append(request)
        logprobs = (arrival.logprobs,) if arrival.logprobs else ()
        return self._append_tokens(request, (arrival.first_token,), logprobs)

    def _append_tokens(
        self, request: Request, token_ids: tuple[int, ...], logprobs: tuple[TokenLogprobs, ...],
        kv_save: KVSaveResult | None = None,
    ) -> EngineCoreOutput:
        """Append sampled tokens to a running request (up to the first that ends it)."""
        num, status = request.append_output(token_ids, self.max_model_len)
        out = EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=token_ids[:num], new_logprobs=logprobs[:num],
            finish_reason=status.finish_reason if status else None,
            stop_reason=request.stop_reason if status else None,
            num_cached_tokens=request.num_cached_tokens, kv_save=kv_save,
            prompt_logprobs=request.first_output_prompt_logprobs(num),
        )
        if status is not None:
            self.running.remove(request)
            self._finish(request, status)
        return out

    def _end(self, request: Request, status: RequestStatus, error: str) -> EngineCoreOutput:
        """Finish a request that is in no queue any more; its last output says why."""
        logger.info("request %s ended: %s (%s)", request.request_id, status.value, error)
        self._finish(request, status)
        return EngineCoreOutput(request.request_id, (), finish_reason=status.finish_reason,
                                num_cached_tokens=request.num_cached_tokens, error=error)

    def _plan(self, scheduled: list[tuple[Request, int]]) -> SchedulerOutput:
        entries = []
        for request, num_new in scheduled:
            start = request.num_computed_tokens
            num_spec = max(start + num_new - request.num_tokens, 0)
            samples = start + num_new >= request.num_tokens
            completes_prompt = start < request.num_prompt_tokens <= start + num_new
            token_ids = request.token_slice(start, start + num_new - num_spec)
            token_ids += request.spec_token_ids[:num_spec]
            request.spec_token_ids.clear()
            entries.append(
                ScheduledRequest(
                    request_id=request.request_id,
                    token_ids=tuple(token_ids),
                    num_computed_tokens=start,
                    block_ids=tuple(self.kv_cache.block_ids(request.request_id)),
                    sampling_params=request.sampling_params if samples else None,
                    num_output_tokens=request.num_sampled_tokens,
                    kv_transfer=request.kv_transfer if completes_prompt else None,
                    num_spec_tokens=num_spec,
                    prompt_logprobs=request.prompt_logprobs_task(start, num_new - num_spec),
                    request=request if samples and request.sampling_params.processes_logits
                    else None,
                    lora=request.lora,
                )
            )
        # decode-shaped first, then by LoRA adapter (one run of tokens per adapter: a grouped
        # kernel reads each adapter's weights once), order otherwise kept
        entries.sort(key=lambda e: (e.num_tokens != 1, e.lora.lora_int_id if e.lora else 0))
        finished, self._finished_ids = tuple(self._finished_ids), []
        return SchedulerOutput(requests=tuple(entries), finished_request_ids=finished,
                               kv_tiers=self.kv_cache.take_tier_ops())

    def _preempt(self, request: Request) -> None:
        logger.debug("preempting %s at %d tokens", request.request_id, request.num_tokens)
        self.kv_cache.free(request)
        request.spec_token_ids.clear()
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self.stats.num_preemptions += 1
        self.waiting.appendleft(request)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        if self.connector is not None:  # before the blocks are freed: nothing writes them after
            self.connector.request_finished(request)
        self.kv_cache.forget(request)
        del self.requests[request.request_id]
        self._finished_ids.append(request.request_id)
