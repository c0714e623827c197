"""Scheduler + KV manager under random load, with the model isolated by a fake runner.

The fake runner keeps a token-level "KV cache" addressed exactly like the real one (block
table + slot), writes each step's tokens there, and derives the next token from the context
it reads back through the block table. Any block-table, prefix-cache, chunking or
preemption mistake therefore changes the output, which is compared against a run of each
request alone.
"""

from __future__ import annotations

import random

import numpy as np

from pdserve.engine.config import SchedulerConfig
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.kv_connector import KVArrival, KVConnector, KVConnectorEvents
from pdserve.engine.lora_request import LoRARequest
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.scheduler_output import RunnerOutput, SchedulerOutput

EOS = 7
VOCAB = 1000


def next_token(context: list[int]) -> int:
    return hash(tuple(context)) % VOCAB


def reference(prompt: list[int], max_tokens: int, max_model_len: int) -> list[int]:
    tokens, out = list(prompt), []
    while True:
        token = next_token(tokens)
        tokens.append(token)
        out.append(token)
        if token == EOS or len(out) >= max_tokens or len(tokens) >= max_model_len:
            return out


class FakeRunner:
    def __init__(self, num_blocks: int, block_size: int):
        self.cache = np.full(num_blocks * block_size, -1, np.int64)
        self.block_size = block_size

    def slots(self, block_ids: tuple[int, ...], positions: range) -> np.ndarray:
        pos = np.asarray(positions)
        blocks = np.asarray(block_ids)[pos // self.block_size]
        return blocks * self.block_size + pos % self.block_size

    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        sampled = {}
        for entry in plan.requests:
            assert entry.num_tokens >= 1, "a scheduled request must compute a token"
            end = entry.num_computed_tokens + entry.num_tokens
            self.cache[self.slots(entry.block_ids, range(entry.num_computed_tokens, end))] = (
                entry.token_ids
            )
            if entry.sampling_params is not None:
                context = self.cache[self.slots(entry.block_ids, range(end))].tolist()
                sampled[entry.request_id] = (next_token(context),)
        return RunnerOutput(sampled, {})


def run_random_load(seed: int, prefix_caching: bool, max_loras: int | None = None,
                    config: SchedulerConfig | None = None) -> None:
    """`max_loras`: requests run with one of four LoRA adapters (or none), at most that many
    adapters in a step. Each step is "timed" at about 1 ms + 0.1 ms a token, and the clock
    and arrivals advance 1 ms a step and a request, so a step budget or SRPT order applies."""
    rng, timing = random.Random(seed), random.Random(seed + 1000)
    block_size, num_blocks, max_model_len = 4, 40, 160
    kv = KVCacheManager(num_blocks, block_size, prefix_caching)
    config = config or SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=24)
    steps = 0
    scheduler = Scheduler(config, kv, max_model_len, max_loras=max_loras,
                          clock=lambda: steps * 1e-3)
    adapters = [None, *(LoRARequest(f"a{i}", i, f"/a{i}") for i in range(1, 5))]
    runner = FakeRunner(num_blocks, block_size)
    shared = [rng.randrange(8, VOCAB) for _ in range(40)]
    expected, outputs, aborted = {}, {}, set()
    pending = []
    for i in range(40):
        prompt = shared[: rng.randrange(0, 41)] + [
            rng.randrange(8, VOCAB) for _ in range(rng.randrange(1, 30))
        ]
        if pending and rng.random() < 0.2:  # an exact repeat: a full prefix-cache hit
            prompt = list(rng.choice(pending).prompt_token_ids)
        max_tokens = rng.randrange(1, 40)
        expected[str(i)] = reference(prompt, max_tokens, max_model_len)
        params = SamplingParams(max_tokens=max_tokens)
        lora = rng.choice(adapters) if max_loras else None
        pending.append(Request(str(i), tuple(prompt), params, (EOS,), arrival_time=i * 1e-3,
                               lora=lora))
    while pending or scheduler.has_unfinished_requests():
        for _ in range(rng.randrange(0, 3)):
            if pending:
                scheduler.add_request(pending.pop(0))
        if scheduler.requests and rng.random() < 0.03:
            victim = rng.choice(sorted(scheduler.requests))
            assert scheduler.finish_request(victim, RequestStatus.FINISHED_ABORTED)
            aborted.add(victim)
        plan = scheduler.schedule()
        assert plan.total_num_tokens <= config.max_num_batched_tokens
        assert len(plan.requests) <= config.max_num_seqs
        assert len({e.lora for e in plan.requests if e.lora}) <= (max_loras or 0)
        result = runner.execute(plan)
        scheduler.observe_step(plan.total_num_tokens,
                               (1e-3 + 1e-4 * plan.total_num_tokens) * timing.uniform(0.8, 1.2))
        for out in scheduler.update(plan, result):
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        steps += 1
        assert steps < 5000, "scheduler made no progress"
    assert scheduler.stats.num_preemptions > 0, "the pool was meant to be too small"
    for rid, tokens in expected.items():
        if rid not in aborted:
            assert outputs[rid] == tokens, rid
    assert kv.num_free_blocks == num_blocks
    assert all(kv.pool.block(i).ref_count == 0 for i in range(num_blocks))
    if prefix_caching:
        assert scheduler.stats.num_cached_tokens > 0


def test_random_load_with_prefix_caching():
    for seed in range(5):
        run_random_load(seed, prefix_caching=True)


def test_random_load_without_prefix_caching():
    for seed in range(5):
        run_random_load(seed, prefix_caching=False)


def test_random_load_with_lora_adapters_two_per_step():
    for seed in range(5):
        run_random_load(seed, prefix_caching=True, max_loras=2)


def test_prefix_cache_hits_only_under_the_same_adapter():
    kv = KVCacheManager(64, 4, True)
    scheduler = Scheduler(SchedulerConfig(), kv, 200, max_loras=2)
    runner = FakeRunner(64, 4)
    a, b = LoRARequest("a", 1, "/a"), LoRARequest("b", 2, "/b")
    prompt = tuple(range(10, 30))  # five full blocks

    def cached(rid: str, lora: LoRARequest | None) -> int:
        scheduler.add_request(Request(rid, prompt, SamplingParams(max_tokens=1), lora=lora))
        while scheduler.has_unfinished_requests():
            plan = scheduler.schedule()
            scheduler.update(plan, runner.execute(plan))
        return scheduler.stats.num_cached_tokens

    assert cached("first", a) == 0
    assert cached("other adapter", b) == 0 and cached("base", None) == 0
    assert cached("same adapter", a) == 16  # four blocks: the last token is recomputed
    assert cached("a new load of a", LoRARequest("a", 3, "/a")) == 16


def test_decodes_come_first_and_chunks_respect_budget():
    kv = KVCacheManager(64, 4, False)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=10), kv, 200)
    runner = FakeRunner(64, 4)
    scheduler.add_request(Request("short", (1, 2), SamplingParams(max_tokens=5)))
    plan = scheduler.schedule()
    scheduler.update(plan, runner.execute(plan))
    scheduler.add_request(Request("long", tuple(range(10, 40)), SamplingParams(max_tokens=5)))
    plan = scheduler.schedule()
    assert [(e.request_id, e.num_tokens) for e in plan.requests] == [("short", 1), ("long", 9)]
    assert plan.requests[1].sampling_params is None  # mid-prompt chunk samples nothing


class FakeConnector(KVConnector):
    """The scheduler side of a KV connector, in memory: the test says what has landed."""

    def __init__(self) -> None:
        self.reserved: dict[str, tuple[int, ...]] = {}
        self.events = KVConnectorEvents()
        self.finished: list[tuple[str, RequestStatus, bool]] = []  # (id, status, blocks held)
        self.kv: KVCacheManager | None = None

    def reserve(self, request, block_ids):
        self.reserved[request.request_id] = tuple(block_ids)
        return tuple(block_ids)

    def land(self, request_id: str, first_token: int) -> None:
        del self.reserved[request_id]
        self.events = KVConnectorEvents(ready=(KVArrival(request_id, first_token),))

    def fail(self, request_id: str, why: str) -> None:
        del self.reserved[request_id]
        self.events = KVConnectorEvents(failed=((request_id, why),))

    def poll(self):
        events, self.events = self.events, KVConnectorEvents()
        return events

    def request_finished(self, request):
        held = bool(self.kv.block_ids(request.request_id))
        self.finished.append((request.request_id, request.status, held))
        self.reserved.pop(request.request_id, None)

    def register_kv_caches(self, kv_caches): ...
    def start_save(self, plan): ...
    def save_kv_layer(self, layer): ...
    def wait_for_save(self):
        return {}
    def abort_save(self): ...
    def close(self): ...


def remote_scheduler(num_blocks: int) -> tuple[Scheduler, KVCacheManager, FakeConnector]:
    kv, connector = KVCacheManager(num_blocks, 4, True), FakeConnector()
    connector.kv = kv
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64)
    return Scheduler(config, kv, 64, connector), kv, connector


def test_remote_prefill_reservation_admission_and_refusal():
    """Decode side: blocks reserved up front, KV written by someone else, then admitted."""
    scheduler, kv, connector = remote_scheduler(8)
    runner = FakeRunner(8, 4)
    prompt = [11, 12, 13, 14, 15, 16]
    request = Request("remote", tuple(prompt), SamplingParams(max_tokens=5), (EOS,))
    blocks = scheduler.reserve_remote(request)
    assert len(blocks) == 2 and kv.num_free_blocks == 6
    assert connector.reserved == {"remote": blocks}
    runner.cache[runner.slots(tuple(blocks), range(len(prompt)))] = prompt  # "the transfer"
    plan = scheduler.schedule()
    assert plan.requests == ()  # not runnable until the connector says it landed
    assert scheduler.update(plan, runner.execute(plan)) == []
    connector.land("remote", next_token(prompt))
    outputs = []
    while scheduler.has_unfinished_requests():
        plan = scheduler.schedule()
        outputs += scheduler.update(plan, runner.execute(plan))
    tokens = [t for out in outputs for t in out.new_token_ids]
    assert tokens == reference(prompt, 5, 64)
    too_big = Request("big", tuple(range(40)), SamplingParams(), (EOS,))
    assert scheduler.reserve_remote(too_big) is None  # 10 blocks > 8: refused, nothing held
    assert kv.num_free_blocks == 8 and "big" not in scheduler.requests
    again = Request("again", tuple(prompt), SamplingParams(), (EOS,))
    assert scheduler.reserve_remote(again) is not None
    assert scheduler.finish_request("again", RequestStatus.FINISHED_ABORTED)
    assert kv.num_free_blocks == 8
    # the connector let go of the aborted transfer while its blocks were still held
    assert connector.finished[-1] == ("again", RequestStatus.FINISHED_ABORTED, True)
    assert connector.reserved == {}


def test_remote_transfer_failure_ends_the_request_with_its_reason():
    scheduler, kv, connector = remote_scheduler(8)
    for rid in ("a", "b"):
        scheduler.reserve_remote(Request(rid, (1, 2, 3, 4, 5), SamplingParams(), (EOS,)))
    assert scheduler.reserve_remote(Request("c", (1,), SamplingParams(), (EOS,))) is None
    connector.fail("a", "[DEADLINE] too late")
    plan = scheduler.schedule()
    (out,) = scheduler.update(plan, FakeRunner(8, 4).execute(plan))
    assert (out.request_id, out.finish_reason, out.error) == ("a", "error", "[DEADLINE] too late")
    assert out.new_token_ids == () and "a" not in scheduler.requests
    assert kv.num_free_blocks == 6 and scheduler.num_remote == 1  # b still holds its 2
    assert scheduler.reserve_remote(Request("c", (1,), SamplingParams(), (EOS,))) is not None


def test_a_landed_remote_request_decodes_every_step_beside_a_long_local_prompt():
    """Decodes are scheduled before the prompt chunks of running requests: a remote request
    admitted behind a local prompt part-way through its prefill gets its token each step
    (the chunk takes what is left), not only once the prompt is done."""
    kv, connector = KVCacheManager(64, 4, True), FakeConnector()
    connector.kv = kv
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16), kv, 128,
                          connector)
    runner = FakeRunner(64, 4)
    local = Request("local", tuple(range(20, 100)), SamplingParams(max_tokens=2), (EOS,))
    scheduler.add_request(local)
    plan = scheduler.schedule()  # 16 of its 80 prompt tokens
    scheduler.update(plan, runner.execute(plan))
    prompt = [11, 12, 13, 14, 15, 16]
    remote = Request("remote", tuple(prompt), SamplingParams(max_tokens=6), (EOS,))
    blocks = scheduler.reserve_remote(remote)
    runner.cache[runner.slots(tuple(blocks), range(len(prompt)))] = prompt
    connector.land("remote", next_token(prompt))
    tokens, chunks = [], []
    for _ in range(4):  # 64 prompt tokens left: four steps of it
        plan = scheduler.schedule()
        sizes = {e.request_id: e.num_tokens for e in plan.requests}
        assert sizes.get("remote") == 1, sizes  # every step, the prompt still prefilling
        chunks.append(sizes.get("local"))
        for out in scheduler.update(plan, runner.execute(plan)):
            if out.request_id == "remote":
                tokens += out.new_token_ids
    assert chunks == [15, 15, 15, 15]  # the budget less the decode
    assert tokens == reference(prompt, 6, 128)[:5]  # the landed first token, then four
