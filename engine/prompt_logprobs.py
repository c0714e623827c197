"""Prompt logprobs (vLLM's `prompt_logprobs`): each prompt token's log-probability under the
raw model distribution at the position before it, with its rank and the top-n alternatives.

The runner computes them for the rows a step's PromptLogprobsTasks name (the request keeps
them across chunks); `output_prompt_logprobs` turns a request's into what RequestOutput carries.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from pdserve.engine.outputs import Logprob
from pdserve.engine.scheduler_output import ScheduledRequest, TokenLogprobs

# Logits rows per pass: a 2048-token chunk at once would hold 2048 x vocab fp32 twice over.
ROWS_PER_PASS = 256

PromptLogprobs = list[dict[int, Logprob] | None]


def prompt_logprob_rows(entries: Sequence[ScheduledRequest]) -> list[int]:
    """The flat batch rows (entries in plan order) whose logits the tasks need, in order."""
    rows: list[int] = []
    offset = 0
    for e in entries:
        task = e.prompt_logprobs
        if task is not None:
            first = offset + task.first_position - 1 - e.num_computed_tokens
            assert offset <= first and first + len(task.token_ids) <= offset + e.num_tokens, e
            rows.extend(range(first, first + len(task.token_ids)))
        offset += e.num_tokens
    return rows


def compute_prompt_logprobs(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    entries: Sequence[ScheduledRequest],
) -> dict[str, tuple[TokenLogprobs, ...]]:
    """Per request with a task, one TokenLogprobs (rank set) per task position.

    `hidden` [T, H] is the step's whole batch; `compute_logits` [N, H] -> [N, V] (a
    collective under tensor parallelism: every rank calls it alike, as the plan is shared).
    """
    tasks = [e for e in entries if e.prompt_logprobs is not None]
    if not tasks:
        return {}
    rows = torch.tensor(prompt_logprob_rows(entries), device=hidden.device)
    targets = torch.tensor([t for e in tasks for t in e.prompt_logprobs.token_ids],
                           device=hidden.device)
    num_top = max(e.prompt_logprobs.num_top for e in tasks)
    parts = [
        _logprobs_of(compute_logits(hidden[rows[i:i + ROWS_PER_PASS]]),
                     targets[i:i + ROWS_PER_PASS], num_top)
        for i in range(0, len(rows), ROWS_PER_PASS)
    ]
    chosen, ranks, top_ids, top_values = (torch.cat(p).tolist() for p in zip(*parts))
    out: dict[str, tuple[TokenLogprobs, ...]] = {}
    row = 0
    for e in tasks:
        task = e.prompt_logprobs
        n = task.num_top
        out[e.request_id] = tuple(
            TokenLogprobs(token, chosen[r], tuple(zip(top_ids[r][:n], top_values[r][:n])),
                          ranks[r])
            for r, token in enumerate(task.token_ids, row)
        )
        row += len(task.token_ids)
    return out


def _logprobs_of(logits: torch.Tensor, targets: torch.Tensor, num_top: int):
    """[N, V] logits, [N] targets -> their logprobs [N], ranks [N], top ids and values [N, k]."""
    logprobs = logits.float().log_softmax(dim=-1)  # [N, V]
    chosen = logprobs.gather(1, targets.unsqueeze(1))  # [N, 1]
    ranks = (logprobs >= chosen).sum(dim=-1)  # [N]; vLLM's rank: 1 for the most likely
    top = logprobs.topk(min(num_top, logprobs.shape[1]), dim=-1)  # best first
    return chosen.squeeze(1), ranks, top.indices, top.values


def output_prompt_logprobs(
    prompt_token_ids: Sequence[int],
    entries: Sequence[TokenLogprobs],
    decode: Callable[[int], str | None],
) -> PromptLogprobs:
    """vLLM's shape: None for the first token, then {token id: Logprob} per position, the
    prompt token first and then the top-n best first (a prompt token among the top-n takes
    its place and rank there). `decode(token_id)` gives each token's text, alone."""
    assert len(entries) == len(prompt_token_ids) - 1, (len(entries), len(prompt_token_ids))
    texts: dict[int, str | None] = {}
    text = lambda t: texts[t] if t in texts else texts.setdefault(t, decode(t))  # noqa: E731
    out: PromptLogprobs = [None]
    for token, lp in zip(prompt_token_ids[1:], entries):
        assert lp.token_id == token, (lp.token_id, token)
        position = {token: Logprob(lp.logprob, lp.rank, text(token))}
        for rank, (top_id, value) in enumerate(lp.top, 1):
            position[top_id] = Logprob(value, rank, text(top_id))
        out.append(position)
    return out
