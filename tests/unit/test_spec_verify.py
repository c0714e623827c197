"""verify: greedy groups emit the argmax prefix; a seeded request emits, token by token, what
the plain sampler gives for its seed, and its noise stream continues where the plain run's
would; logprobs are those of the raw logits at the emitted rows."""

from __future__ import annotations

import random

import torch

from pdserve.engine.sampler import Sampler, SamplingBatch, make_generator
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.spec.verify import Group, accepted_prefix, verify

CPU = torch.device("cpu")


def _batch(params: list[SamplingParams], vocab_size: int) -> SamplingBatch:
    """verify's batch: one row per logits row, no generators (seeded groups bring theirs)."""
    return SamplingBatch.from_params(params, [None] * len(params), vocab_size, CPU)


def _argmax_prefix(rows: torch.Tensor, drafts: list[int]) -> list[int]:
    tokens = []
    for j in range(len(drafts) + 1):
        tokens.append(int(rows[j].argmax()))
        if j == len(drafts) or tokens[-1] != drafts[j]:
            return tokens
    raise AssertionError("unreachable")


def test_accepted_prefix_stops_at_the_first_mismatch() -> None:
    assert accepted_prefix([5, 6, 7], [5, 6]) == [5, 6, 7]  # every draft holds: one more
    assert accepted_prefix([5, 9, 7], [5, 6]) == [5, 9]
    assert accepted_prefix([4, 6, 7], [5, 6]) == [4]
    assert accepted_prefix([3, 8], []) == [3]  # no drafts: the one token


def _greedy_case(rng: random.Random, num_groups: int, vocab: int, logits_seed: int):
    """Groups of 0-4 drafts that follow the argmax for a random number of positions."""
    sizes = [rng.randint(0, 4) for _ in range(num_groups)]
    logits = torch.randn(sum(sizes) + num_groups, vocab,
                         generator=torch.Generator().manual_seed(logits_seed))
    groups, first = [], 0
    for k in sizes:
        argmax = logits[first : first + k + 1].argmax(dim=-1).tolist()
        held = rng.randint(0, k)
        drafts = argmax[:held] + [(t + 1 + rng.randrange(vocab - 1)) % vocab
                                  for t in argmax[held:k]]
        groups.append(Group(first, tuple(drafts), None))
        first += k + 1
    return logits, groups


def test_greedy_groups_emit_the_argmax_prefix() -> None:
    rng = random.Random(0)
    for trial in range(20):
        logits, groups = _greedy_case(rng, num_groups=12, vocab=50, logits_seed=trial)
        batch = _batch([SamplingParams(temperature=0.0)] * logits.shape[0], 50)
        emitted, out = verify(Sampler(seed=trial), logits, batch, groups)
        for g, tokens in zip(groups, emitted):
            assert tokens == _argmax_prefix(logits[g.first_row :], list(g.drafts))
        assert out.token_ids.tolist() == [t for tokens in emitted for t in tokens]
        assert out.logprobs is None


def test_greedy_groups_among_random_ones_still_emit_the_argmax_prefix() -> None:
    rng = random.Random(1)
    logits, groups = _greedy_case(rng, num_groups=30, vocab=40, logits_seed=9)
    greedy = SamplingParams(temperature=0.0, top_p=0.5)
    params = []
    for i, g in enumerate(groups):  # every other group samples: seeded or shared noise
        seed = i if i % 4 == 1 else None
        p = greedy if i % 2 == 0 else SamplingParams(temperature=1.3, top_k=20, seed=seed)
        params += [p] * (len(g.drafts) + 1)
    groups = [Group(g.first_row, g.drafts, make_generator(i, CPU) if i % 4 == 1 else None)
              for i, g in enumerate(groups)]
    emitted, _ = verify(Sampler(seed=2), logits, _batch(params, 40), groups)
    for i, (g, tokens) in enumerate(zip(groups, emitted)):
        if i % 2 == 0:
            assert tokens == _argmax_prefix(logits[g.first_row :], list(g.drafts))
    sampled_drafts_held = sum(len(t) - 1 for t in emitted[1::2])
    assert sum(len(g.drafts) for g in groups[1::2]) > sampled_drafts_held  # some rejected


def _plain_run(step_logits: torch.Tensor, params: SamplingParams):
    """The non-speculative sampler, one token per step with the request's own generator:
    the tokens, and the generator's state before each step (and after the last)."""
    generator = make_generator(params.seed, CPU)
    tokens, states = [], [generator.get_state()]
    for logits in step_logits:
        batch = SamplingBatch.from_params([params], [generator], step_logits.shape[1], CPU)
        tokens.append(int(Sampler()(logits[None], batch).token_ids[0]))
        states.append(generator.get_state())
    return tokens, states


def _wrong(token: int, vocab: int, rng: random.Random) -> int:
    return (token + 1 + rng.randrange(vocab - 1)) % vocab


def test_seeded_request_emits_the_plain_samplers_tokens_and_stream() -> None:
    vocab, num_positions = 64, 120
    # Near-flat logits: the draw decides, not the argmax.
    step_logits = torch.randn(num_positions, vocab,
                              generator=torch.Generator().manual_seed(3)) * 0.6
    params = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=1234)
    plain, states = _plain_run(step_logits, params)
    assert len(set(plain)) > 20
    neighbour = SamplingParams(temperature=1.0, min_p=0.3, seed=77)  # other filters in batch
    rng = random.Random(5)
    generator = make_generator(params.seed, CPU)
    other = make_generator(neighbour.seed, CPU)
    pos, calls, rejected = 0, 0, 0
    while pos + 5 < num_positions:
        k = rng.randint(1, 4)
        held = rng.randint(0, k)  # drafts that are the plain run's tokens
        drafts = plain[pos : pos + held] + [_wrong(plain[pos + held], vocab, rng)] * (k - held)
        lead = rng.randint(0, 2)  # unrelated rows before the request's group
        rows = torch.randn(lead + k + 1 + 3, vocab, generator=torch.Generator().manual_seed(pos))
        rows[lead : lead + k + 1] = step_logits[pos : pos + k + 1]
        params_rows = [SamplingParams()] * lead + [params] * (k + 1) + [neighbour] * 3
        groups = [Group(lead, tuple(drafts), generator), Group(lead + k + 1, (1, 2), other)]
        if lead:
            groups.insert(0, Group(0, (0,) * (lead - 1), None))
        emitted, _ = verify(Sampler(seed=calls), rows, _batch(params_rows, vocab), groups)
        mine = emitted[1] if lead else emitted[0]
        assert mine == plain[pos : pos + held + 1], (pos, k, held)
        pos += held + 1
        # one draw per position looked at: the stream is where the plain run's is
        assert torch.equal(generator.get_state(), states[pos]), pos
        calls += 1
        rejected += held < k
    assert calls > 20 and 0 < rejected < calls
    # and it goes on as the plain run does, without speculation
    rest = step_logits[pos:]
    for j in range(rest.shape[0]):
        batch = SamplingBatch.from_params([params], [generator], vocab, CPU)
        assert int(Sampler(seed=j)(rest[j : j + 1], batch).token_ids[0]) == plain[pos + j]


def test_seeded_group_with_no_drafts_takes_one_draw() -> None:
    vocab = 30
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(8))
    params = SamplingParams(temperature=1.0, seed=5)
    plain, states = _plain_run(logits, params)
    generator = make_generator(5, CPU)
    emitted, _ = verify(Sampler(), logits, _batch([params], vocab), [Group(0, (), generator)])
    assert emitted == [plain]
    assert torch.equal(generator.get_state(), states[1])


def test_logprobs_are_the_raw_log_softmax_at_the_emitted_rows() -> None:
    vocab = 100
    rng = random.Random(2)
    logits, groups = _greedy_case(rng, num_groups=10, vocab=vocab, logits_seed=4)
    logits = logits * 3
    params, seeded = [], []
    for i, g in enumerate(groups):  # greedy, shared-noise and seeded groups, some not asking
        p = [SamplingParams(temperature=0.0, logprobs=2),
             SamplingParams(temperature=0.5, top_k=5, logprobs=4),
             SamplingParams(temperature=0.8, min_p=0.1, seed=i, logprobs=None)][i % 3]
        params += [p] * (len(g.drafts) + 1)
        seeded.append(make_generator(i, CPU) if i % 3 == 2 else None)
    groups = [Group(g.first_row, g.drafts, gen) for g, gen in zip(groups, seeded)]
    emitted, out = verify(Sampler(seed=0), logits, _batch(params, vocab), groups)
    rows = [g.first_row + j for g, tokens in zip(groups, emitted) for j in range(len(tokens))]
    flat = [t for tokens in emitted for t in tokens]
    assert out.token_ids.tolist() == flat
    assert len(rows) > len(groups)  # some groups emitted several rows
    raw = logits.double()[rows]  # what the model gave, before temperature and filters
    want = raw.log_softmax(dim=-1)  # [emitted, V]
    assert out.logprobs is not None and out.top_logprobs is not None
    assert torch.allclose(out.logprobs.double(), want[range(len(rows)), flat], atol=1e-4)
    top = want.topk(4, dim=-1)  # the batch's largest request: 4
    assert out.top_logprob_ids.tolist() == top.indices.tolist()
    assert torch.allclose(out.top_logprobs.double(), top.values, atol=1e-4)
