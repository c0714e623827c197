"""Decode side, issue 18 "skip what decode holds": a remote reservation shares the leading
prompt blocks its prefix cache already holds (ref-counted) and reserves fresh blocks only for
the rest; `num_cached_tokens` tells the connector which blocks need no KV from elsewhere.

The fake runner (tests.unit.test_scheduler) derives each token from the context it reads back
through the block table, so KV the "transfer" did not write (the shared blocks) must really
be in the cache for the output to match a run of the prompt alone.
"""

from __future__ import annotations

from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sampling_params import SamplingParams
from tests.unit.test_scheduler import (
    EOS,
    FakeRunner,
    next_token,
    reference,
    remote_scheduler,
)

BLOCK = 4
NUM_BLOCKS = 12
MAX_LEN = 64


def land_and_run(scheduler, connector, runner, rid: str, skip_blocks: int):
    """"Transfer" the reserved request's prompt KV from block `skip_blocks` on (what a
    prefill worker pushes), admit it, run it to its end: (its outputs, its last block table)."""
    request = scheduler.requests[rid]
    prompt = list(request.prompt_token_ids)
    blocks = connector.reserved[rid]
    positions = range(skip_blocks * BLOCK, len(prompt))
    runner.cache[runner.slots(blocks, positions)] = prompt[positions.start:]
    connector.land(rid, next_token(prompt))
    outputs, table = [], blocks
    while rid in scheduler.requests:
        plan = scheduler.schedule()
        table = next((e.block_ids for e in plan.requests if e.request_id == rid), table)
        outputs += [o for o in scheduler.update(plan, runner.execute(plan)) if o.request_id == rid]
    return outputs, table


def turn(rid: str, prompt: list[int], max_tokens: int = 5) -> Request:
    return Request(rid, tuple(prompt), SamplingParams(max_tokens=max_tokens), (EOS,))


def tokens(outputs) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]


def first_turn(scheduler, connector, runner) -> tuple[list[int], tuple[int, ...]]:
    """Turn 1 of a session, remote KV for its whole prompt: (prompt + output, its blocks)."""
    prompt = [11, 12, 13, 14, 15, 16]
    one = turn("t1", prompt)
    assert scheduler.reserve_remote(one) is not None
    assert one.num_cached_tokens == 0  # nothing cached yet: every block is pushed
    outputs, table = land_and_run(scheduler, connector, runner, "t1", 0)
    assert tokens(outputs) == reference(prompt, 5, MAX_LEN)
    return prompt + tokens(outputs), table


def test_turn_two_shares_the_cached_blocks_and_needs_only_the_rest():
    scheduler, kv, connector = remote_scheduler(NUM_BLOCKS)
    runner = FakeRunner(NUM_BLOCKS, BLOCK)
    history, t1_blocks = first_turn(scheduler, connector, runner)
    assert kv.num_free_blocks == NUM_BLOCKS  # turn 1 done: its blocks are cached, free
    # turn 1 computed all of its tokens but the last output: its full blocks are cached
    num_cached = (len(history) - 1) // BLOCK
    prompt = history + [21, 22, 23, 24, 25, 26, 27, 28, 29]
    num_blocks = -(-len(prompt) // BLOCK)
    two = turn("t2", prompt)
    assert scheduler.reserve_remote(two) is not None
    reserved = connector.reserved["t2"]
    assert two.num_cached_tokens == num_cached * BLOCK and num_cached >= 2
    assert len(reserved) == num_blocks
    assert reserved[:num_cached] == t1_blocks[:num_cached]  # shared, not copied
    assert kv.num_free_blocks == NUM_BLOCKS - num_blocks
    assert scheduler.stats.num_cached_tokens == num_cached * BLOCK
    # only the missing blocks arrive; the output is that of the prompt alone
    outputs, _ = land_and_run(scheduler, connector, runner, "t2", num_cached)
    assert tokens(outputs) == reference(prompt, 5, MAX_LEN)
    assert {o.num_cached_tokens for o in outputs} == {num_cached * BLOCK}
    assert kv.num_free_blocks == NUM_BLOCKS


def test_a_block_shared_by_two_reservations_stays_until_both_let_go():
    scheduler, kv, connector = remote_scheduler(NUM_BLOCKS)
    history, t1_blocks = first_turn(scheduler, connector, FakeRunner(NUM_BLOCKS, BLOCK))
    head = history[:2 * BLOCK]
    a, b = turn("a", head + [31, 32, 33]), turn("b", head + [41, 42, 43, 44, 45])
    assert scheduler.reserve_remote(a) is not None and scheduler.reserve_remote(b) is not None
    shared = connector.reserved["a"][:2]
    assert shared == connector.reserved["b"][:2] == t1_blocks[:2]
    assert a.num_cached_tokens == b.num_cached_tokens == 2 * BLOCK
    assert [kv.pool.block(i).ref_count for i in shared] == [2, 2]
    assert kv.num_free_blocks == NUM_BLOCKS - 2 - 1 - 2  # shared 2, a's 1, b's 2 private
    assert scheduler.finish_request("a", RequestStatus.FINISHED_ABORTED)
    assert [kv.pool.block(i).ref_count for i in shared] == [1, 1]  # b still holds them
    assert kv.num_free_blocks == NUM_BLOCKS - 2 - 2
    # held by b, so a reservation needing every free block can't take them from under it
    big = turn("big", list(range(100, 100 + (NUM_BLOCKS - 4) * BLOCK)))
    assert scheduler.reserve_remote(big) is not None
    assert not set(connector.reserved["big"]) & set(shared)
    assert scheduler.finish_request("big", RequestStatus.FINISHED_ABORTED)
    assert scheduler.finish_request("b", RequestStatus.FINISHED_ABORTED)
    assert [kv.pool.block(i).ref_count for i in shared] == [0, 0]
    assert kv.num_free_blocks == kv.pool.num_blocks == NUM_BLOCKS  # every block back


def test_at_least_the_last_prompt_block_is_reserved_to_receive():
    scheduler, kv, connector = remote_scheduler(NUM_BLOCKS)
    history, t1_blocks = first_turn(scheduler, connector, FakeRunner(NUM_BLOCKS, BLOCK))
    whole = turn("whole", history[:2 * BLOCK])  # both of its blocks are cached
    assert scheduler.reserve_remote(whole) is not None
    # the last token's block is always computed remotely: a transfer is never empty
    assert whole.num_cached_tokens == BLOCK
    assert connector.reserved["whole"][0] == t1_blocks[0]
    assert connector.reserved["whole"][1] != t1_blocks[1]


def test_a_refused_reservation_takes_no_reference_on_the_hits():
    scheduler, kv, connector = remote_scheduler(NUM_BLOCKS)
    history, t1_blocks = first_turn(scheduler, connector, FakeRunner(NUM_BLOCKS, BLOCK))
    too_big = turn("too-big", history[:2 * BLOCK] + list(range(200, 200 + NUM_BLOCKS * BLOCK)))
    assert scheduler.reserve_remote(too_big) is None
    assert [kv.pool.block(i).ref_count for i in t1_blocks] == [0] * len(t1_blocks)
    assert kv.num_free_blocks == NUM_BLOCKS and "too-big" not in scheduler.requests
    fits = turn("fits", history[:2 * BLOCK] + [51, 52])  # the same hits, room for the rest
    assert scheduler.reserve_remote(fits) is not None and fits.num_cached_tokens == 2 * BLOCK
    assert [kv.pool.block(i).ref_count for i in t1_blocks[:2]] == [1, 1]
