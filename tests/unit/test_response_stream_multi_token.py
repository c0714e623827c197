"""ResponseStream with several tokens per delta (speculative decoding, a coalesced backlog): a
stop string completed mid-delta cuts token ids, logprobs and usage at the completing token."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from pdserve.proto import pdserve_pb2
from tests.unit.test_response_stream import (
    delta,
    make_req,
    prefill_response,
    run_stream,
    sample,
    split,
)

PROMPT = "<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n"
TEXT = "The cat sat on the mat and then it slept."


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    return AutoTokenizer.from_pretrained(str(tiny_llama_dir))


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> tuple[int, ...]:
    return tuple(tokenizer(PROMPT, add_special_tokens=False).input_ids)


def logprob(token_id: int) -> pdserve_pb2.TokenLogprob:
    return pdserve_pb2.TokenLogprob(token_id=token_id, logprob=-(token_id % 5) / 4)


def through_stop(tokenizer, ids: list[int], stop: str) -> list[int]:
    """`ids` up to and including the token whose arrival completes `stop`."""
    end = next(i for i in range(len(ids)) if stop in tokenizer.decode(ids[: i + 1]))
    return ids[: end + 1]


@pytest.mark.parametrize("coalesce", [False, True])
@pytest.mark.parametrize("remote", [False, True])
@pytest.mark.parametrize("sizes", [[1] * 12, [2, 5], [6], [3, 3]])
def test_stop_mid_delta_cuts_token_ids_at_the_completing_token(
        tokenizer, prompt_ids, sizes, remote: bool, coalesce: bool) -> None:
    ids = tokenizer(TEXT).input_ids
    kept = through_stop(tokenizer, ids, "sat on")
    assert len(kept) < len(ids) - 2  # tokens follow the stop in the same delta
    req = make_req(prompt_ids, stop=("sat on",), logprobs=0)
    chunks = split(ids, sizes)
    items = [delta(c, logprobs=[logprob(t) for t in c]) for c in chunks[:-1]]
    items.append(delta(chunks[-1], "length", logprobs=[logprob(t) for t in chunks[-1]]))
    prefill = prefill_response(ids[0], logprob=logprob(ids[0])) if remote else None
    run = run_stream(tokenizer, req, items, prefill, coalesce=coalesce)
    assert run.error is None
    assert run.text == "The cat "
    assert (run.last.finish_reason, run.last.stop_reason) == ("stop", "sat on")
    assert run.token_ids == kept
    assert [lp.token_id for m in run.messages for lp in m.logprobs] == kept
    assert run.last.usage.completion_tokens == len(kept)
    # tokens past the stop never reach the client: no latency gap or count for them
    assert sample(run.metrics, "pdserve_generation_tokens_total") == len(kept)
    assert sample(run.metrics, "pdserve_inter_token_latency_seconds_count") == len(kept) - 1


def test_stop_mid_delta_with_the_workers_finish_in_the_same_delta(tokenizer, prompt_ids) -> None:
    """The worker finished too (length) in the delta that completes the stop string: the
    stop string wins and the tokens after it are still dropped."""
    ids = tokenizer(TEXT).input_ids
    req = make_req(prompt_ids, stop=("the mat",))
    run = run_stream(tokenizer, req, [delta(ids[:2]), delta(ids[2:], "length")])
    assert run.text == "The cat sat on "
    assert (run.last.finish_reason, run.last.stop_reason) == ("stop", "the mat")
    assert run.token_ids == through_stop(tokenizer, ids, "the mat")
    assert run.last.usage.completion_tokens == len(run.token_ids)
