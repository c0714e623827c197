"""Attention sinks (gpt-oss): the references against a transcription of transformers'
`eager_attention_forward`, then the Triton decode (split-K and not) and prefill kernels, float
and int8 caches, against the references (interpreter, small shapes).

A sink is one learned logit per query head that joins the softmax's denominator, unscaled,
with no value; gpt-oss runs it on every layer, with a sliding window on alternate ones.
Sinks here are drawn N(0, 2^2) beside scores of about unit spread, so they move every output
(by ~0.5-1 relative norm: a kernel that drops them fails every bound). Bounds as the kernels'
own tests: fp32 1e-5, bf16 1e-2 (relative norm error against the fp32 reference); the
reference against the transcription 1e-5 (both fp32, sums in other orders).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from paged_case import finite, make_case, poison_before, quantize_case, rel_err

from pdserve.kernels.attention_metadata import (
    AttentionMetadata,
    DecodeMetadata,
    PrefillMetadata,
)
from pdserve.kernels.backend import get_backend
from pdserve.kernels.reference.paged_attention import (
    paged_decode_attention_int8_ref,
    paged_decode_attention_ref,
    paged_prefill_attention_int8_ref,
    paged_prefill_attention_ref,
)
from pdserve.kernels.triton.paged_decode_attention import (
    paged_decode_attention,
    paged_decode_attention_int8,
)
from pdserve.kernels.triton.paged_prefill_attention import (
    paged_prefill_attention,
    paged_prefill_attention_int8,
)

BOUND = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
SCALE = 0.125


def sinks_for(num_heads: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_heads, generator=torch.Generator().manual_seed(seed)) * 2.0


def eager_attention_with_sinks(query, key, value, attention_mask, scaling, sinks, groups):
    """transformers' `eager_attention_forward` of GptOss, line for line (no dropout):
    query [B, H, L, D], key/value [B, Hkv, S, D], an additive mask [B, 1, L, S]."""
    key_states = key.repeat_interleave(groups, dim=1)  # repeat_kv
    value_states = value.repeat_interleave(groups, dim=1)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    sinks = sinks.reshape(1, -1, 1, 1).expand(query.shape[0], -1, query.shape[-2], -1)
    combined_logits = torch.cat([attn_weights, sinks], dim=-1)
    combined_logits = combined_logits - combined_logits.max(dim=-1, keepdim=True).values
    probs = F.softmax(combined_logits, dim=-1, dtype=combined_logits.dtype)
    scores = probs[..., :-1]  # the sink dropped
    attn_output = torch.matmul(scores.to(value_states.dtype), value_states)
    return attn_output.transpose(1, 2).contiguous()  # [B, L, H, D]


def causal_mask(n: int, sliding_window: int | None) -> torch.Tensor:  # [1, 1, n, n] additive
    q, k = torch.arange(n)[:, None], torch.arange(n)[None, :]
    visible = k <= q
    if sliding_window is not None:
        visible &= k > q - sliding_window  # HF's sliding-window causal mask
    return torch.zeros(n, n).masked_fill(~visible, float("-inf"))[None, None]


@pytest.mark.parametrize("sliding_window", [None, 5])
def test_references_match_transformers_eager_attention(sliding_window):
    """A whole 37-token prompt (prefill) and its last token again (decode), 8 query heads on 2
    KV heads, against the transcription on the dense K/V the cache was filled from."""
    n, num_kv_heads, group, head_dim = 37, 2, 4, 32
    case = finite(make_case([n], 16, num_kv_heads, head_dim, torch.float32, seed=3))
    q = torch.randn(n, num_kv_heads * group, head_dim)
    sinks = sinks_for(num_kv_heads * group)
    key, value = (t.transpose(0, 1)[None] for t in (case.keys[0], case.values[0]))
    want = eager_attention_with_sinks(q.transpose(0, 1)[None], key, value,
                                      causal_mask(n, sliding_window), SCALE, sinks, group)[0]
    starts = torch.tensor([0, n], dtype=torch.int32)
    variant = {"sliding_window": sliding_window, "sinks": sinks}
    prefill = paged_prefill_attention_ref(q, case.k_cache, case.v_cache, case.block_tables,
                                          starts, case.context_lens, SCALE, **variant)
    assert rel_err(prefill, want) < 1e-5
    decode = paged_decode_attention_ref(q[-1:], case.k_cache, case.v_cache, case.block_tables,
                                        case.context_lens, SCALE, **variant)
    assert rel_err(decode, want[-1:]) < 1e-5
    plain = paged_prefill_attention_ref(q, case.k_cache, case.v_cache, case.block_tables,
                                        starts, case.context_lens, SCALE,
                                        sliding_window=sliding_window)
    assert rel_err(plain, want) > 0.1  # the sinks matter at these scales


def test_transcription_is_transformers_own():
    """The transcription above gives what transformers' function does (where it is installed)."""
    gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    sinks, mask = torch.randn(4), causal_mask(6, 3)
    module = torch.nn.Module()
    module.sinks, module.num_key_value_groups = torch.nn.Parameter(sinks), 2
    module.train(False)
    theirs, _ = gpt_oss.eager_attention_forward(module, q, k, v, mask, SCALE)
    assert torch.allclose(eager_attention_with_sinks(q, k, v, mask, SCALE, sinks, 2), theirs)


def _decode_ref(case, q, **variant):
    c = finite(case)
    return paged_decode_attention_ref(q.float(), c.k_cache.float(), c.v_cache.float(),
                                      c.block_tables, c.context_lens, SCALE, **variant)


LENS = [1, 300, 37]


@pytest.mark.parametrize("dtype,sliding_window", [(torch.float32, None), (torch.float32, 40),
                                                  (torch.bfloat16, 40)])
def test_triton_decode_with_sinks_matches_reference(dtype, sliding_window):
    """One program per sequence and split-K (the sink in split 0's partials, merged as any)."""
    case = make_case(LENS, 16, 2, 64, dtype, seed=1)
    q = torch.randn(len(LENS), 8, 64).to(dtype)
    variant = {"sliding_window": sliding_window, "sinks": sinks_for(8)}
    ref = _decode_ref(case, q, **variant)
    firsts = [max(0, n - (sliding_window or n)) for n in LENS]
    poisoned = poison_before(case, firsts)
    for num_splits in (1, 3):
        out = paged_decode_attention(q, poisoned.k_cache, poisoned.v_cache, case.block_tables,
                                     case.context_lens, SCALE, num_splits=num_splits, **variant)
        assert rel_err(out, ref) < BOUND[dtype], num_splits


SEQS = [(1, 1), (21, 200), (37, 37)]  # (query_len, context_len)


def _prefill_inputs(seqs, num_heads, dtype):
    query_lens = torch.tensor([n for n, _ in seqs])
    starts = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    starts[1:] = query_lens.cumsum(0)
    return torch.randn(int(query_lens.sum()), num_heads, 64).to(dtype), starts


@pytest.mark.parametrize("dtype,sliding_window", [(torch.float32, None), (torch.float32, 24),
                                                  (torch.bfloat16, 24)])
def test_triton_prefill_with_sinks_matches_reference(dtype, sliding_window):
    case = make_case([c for _, c in SEQS], 16, 2, 64, dtype, seed=2)
    q, starts = _prefill_inputs(SEQS, 8, dtype)
    variant = {"sliding_window": sliding_window, "sinks": sinks_for(8, seed=1)}
    c = finite(case)
    ref = paged_prefill_attention_ref(q.float(), c.k_cache.float(), c.v_cache.float(),
                                      c.block_tables, starts, c.context_lens, SCALE, **variant)
    firsts = [max(0, ctx - n - (sliding_window or ctx) + 1) for n, ctx in SEQS]
    poisoned = poison_before(case, firsts)
    out = paged_prefill_attention(q, poisoned.k_cache, poisoned.v_cache, case.block_tables,
                                  starts, case.context_lens, SCALE, **variant)
    assert rel_err(out, ref) < BOUND[dtype]


def test_triton_int8_with_sinks_matches_references():
    """int8 caches: the int8 references with sinks against the float ones on the dequantized
    values' source (2e-2, int8's own error), the Triton int8 kernels against them (1e-5):
    decode in 2 splits, prefill with a window."""
    fp = make_case([200, 7], 16, 1, 64, torch.float32, seed=6)
    case, sinks = quantize_case(fp), sinks_for(4, seed=2)
    c = finite(case)
    q = torch.randn(2, 4, 64)
    args = (case.block_tables, case.context_lens, SCALE)
    ref = paged_decode_attention_int8_ref(q, c.k_cache, c.v_cache, c.k_scale, c.v_scale, *args,
                                          sinks=sinks)
    assert rel_err(ref, _decode_ref(fp, q, sinks=sinks)) < 2e-2
    out = paged_decode_attention_int8(q, case.k_cache, case.v_cache, case.k_scale, case.v_scale,
                                      *args, num_splits=2, sinks=sinks)
    assert rel_err(out, ref) < 1e-5
    seqs = [(20, 200), (7, 7)]
    q, starts = _prefill_inputs(seqs, 4, torch.float32)
    args = (case.block_tables, starts, case.context_lens, SCALE)
    variant = {"sliding_window": 33, "sinks": sinks}
    ref = paged_prefill_attention_int8_ref(q, c.k_cache, c.v_cache, c.k_scale, c.v_scale,
                                           *args, **variant)
    p = poison_before(case, [200 - 20 - 33 + 1, 0])  # before the chunk's first window
    out = paged_prefill_attention_int8(q, p.k_cache, p.v_cache, p.k_scale, p.v_scale, *args,
                                       **variant)
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("name", ["torch", "triton"])
def test_backend_attention_passes_sinks(name):
    """`KernelBackend.attention` with sinks: a decode and a prefill chunk in one step, each
    part as its single op gives it."""
    ops = get_backend("cpu", name)
    case = finite(make_case([40, 30], 16, 2, 64, torch.float32, seed=4))
    sinks = sinks_for(4, seed=3)
    q, k, v = torch.randn(11, 4, 64), torch.randn(11, 2, 64), torch.randn(11, 2, 64)
    block_size = case.k_cache.shape[1]

    def slot(seq: int, position: int) -> int:
        return int(case.block_tables[seq, position // block_size]) * block_size + (
            position % block_size)

    # the decode token at position 39 of sequence 0, a chunk at positions 20..29 of sequence 1
    slot_mapping = torch.tensor([slot(0, 39)] + [slot(1, p) for p in range(20, 30)])
    decode = DecodeMetadata(case.block_tables[:1], case.context_lens[:1], 40)
    prefill = PrefillMetadata(case.block_tables[1:], torch.tensor([0, 10], dtype=torch.int32),
                              case.context_lens[1:], 10, 30)
    meta = AttentionMetadata(slot_mapping, 1, decode, prefill)
    kv = (case.k_cache.clone(), case.v_cache.clone())
    out = ops.attention(q, k, v, kv, meta, SCALE, sliding_window=12, sinks=sinks)
    want_decode = paged_decode_attention_ref(q[:1], *kv, case.block_tables[:1],
                                             case.context_lens[:1], SCALE, sliding_window=12,
                                             sinks=sinks)
    want_prefill = paged_prefill_attention_ref(q[1:], *kv, case.block_tables[1:],
                                               prefill.query_start_loc, case.context_lens[1:],
                                               SCALE, sliding_window=12, sinks=sinks)
    assert rel_err(out, torch.cat([want_decode, want_prefill])) < 1e-5


def test_sinks_are_checked():
    case = make_case([5], 16, 2, 64, torch.float32)
    q = torch.randn(1, 4, 64)
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, SCALE)
    for bad, match in ((torch.zeros(3), "sinks must have shape"),
                       (torch.zeros(4, dtype=torch.bfloat16), "sinks must have dtype"),
                       (torch.zeros(8)[::2], "contiguous")):
        for op in (paged_decode_attention_ref, paged_decode_attention):
            with pytest.raises(ValueError, match=match):
                op(*args, sinks=bad)
