"""Greedy reference outputs from Hugging Face transformers `generate` (fp32, CPU)."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch


@cache
def hf_greedy(model_dir: Path, prompts: tuple[tuple[int, ...], ...], max_new_tokens: int):
    """Each prompt alone (no padding), greedy; tokens after the prompt, EOS included."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    eos = model.config.eos_token_id
    pad = eos[0] if isinstance(eos, (list, tuple)) else eos
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
            do_sample=False, pad_token_id=pad,
        )
        outputs.append(out[0, len(prompt):].tolist())
    return tuple(tuple(o) for o in outputs)


def mixed_prompts(vocab_size: int, seed: int, chat: tuple[tuple[int, ...], ...] = ()):
    """Prompts of 1 to 300 tokens; several share long prefixes; plus any chat prompts."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(3, vocab_size, (300,), generator=g).tolist()
    tail = lambda n: torch.randint(3, vocab_size, (n,), generator=g).tolist()  # noqa: E731
    prompts = [
        base,  # 300
        tail(1),
        base[:150] + tail(20),  # shares 150 tokens with the first
        tail(7),
        base[:64],  # exactly 4 blocks of 16, all shared
        base[:200] + tail(3),
        tail(33),
        base[:17],
        tail(120),
    ]
    return tuple(tuple(p) for p in prompts) + tuple(chat)


def assert_same_greedy(got, want, atol: float = 1e-4) -> None:
    """Two engines' outputs (logprobs asked for): the same tokens, log-probabilities within
    `atol` (two weight layouts of the same values sum in other orders)."""
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(torch.tensor([t.logprob for t in a.logprobs]),
                                   torch.tensor([t.logprob for t in b.logprobs]),
                                   rtol=0, atol=atol)
