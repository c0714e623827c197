"""The structured-output token mask: the C kernel (`kernels/cpu/token_bitmask.c`), the Triton
kernel (interpreted) and the torch reference against xgrammar's own
`apply_token_bitmask_inplace` (an independent implementation of the same layout), on random
bitmasks with the words a grammar makes (all set, none set, mixed) and vocabularies that end
mid-word. Masking is exact: the results are equal."""

from __future__ import annotations

import pytest
import torch
import xgrammar as xgr

from pdserve.kernels.cpu.token_bitmask import apply_token_bitmask_cpu
from pdserve.kernels.reference.token_bitmask import apply_token_bitmask_ref
from pdserve.kernels.triton.token_bitmask import apply_token_bitmask


def random_bitmask(rows: int, vocab: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    words = -(-vocab // 32)
    bitmask = torch.randint(-2**31, 2**31 - 1, (rows, words), generator=gen, dtype=torch.int32)
    kind = torch.randint(0, 3, (rows, words), generator=gen)
    bitmask[kind == 0] = 0  # nothing allowed: most of a grammar's vocabulary
    bitmask[kind == 1] = -1  # everything allowed
    if rows > 1:
        bitmask[0] = -1  # a row without a grammar
    return bitmask


@pytest.mark.parametrize("vocab", [1000, 49152, 32 * 7 + 5])
@pytest.mark.parametrize("rows", [1, 9])  # 9: spread over the OpenMP threads
def test_kernel_and_reference_equal_xgrammar(vocab, rows):
    bitmask = random_bitmask(rows, vocab, vocab + rows)
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows))
    want = logits.clone()
    xgr.apply_token_bitmask_inplace(want, bitmask, vocab_size=vocab)
    for apply in (apply_token_bitmask_ref, apply_token_bitmask_cpu, apply_token_bitmask):
        got = logits.clone()
        apply(got, bitmask)
        assert torch.equal(got, want), apply.__name__
    assert torch.isinf(want).any() and (rows == 1 or torch.isfinite(want[0]).all())


def test_a_wider_bitmask_and_other_dtypes_take_the_reference():
    bitmask = random_bitmask(3, 100, 1)
    wide = torch.cat([bitmask, torch.zeros(3, 2, dtype=torch.int32)], dim=1)  # padded words
    logits = torch.randn(3, 100)
    want = logits.clone()
    apply_token_bitmask_ref(want, bitmask)
    got = logits.clone()
    apply_token_bitmask_cpu(got, wide)
    assert torch.equal(got, want)
    half = logits.bfloat16()
    apply_token_bitmask_cpu(half, bitmask)
    assert torch.equal(torch.isinf(half), torch.isinf(want))
