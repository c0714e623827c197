"""Compile every Triton kernel, in each variant the wrappers launch, for an NVIDIA GPU.

The interpreter runs kernels as numpy and lets through what a GPU compile refuses (a
non-constexpr global, a dot shape the hardware lacks, a type clash in a branch), so this
compiles each one to a cubin with Triton's bundled ptxas. No GPU needed:

    python tests/kernels/compile_cuda.py [--arch 90]

Run without TRITON_INTERPRET (test_cuda_compile.py does, in a subprocess).
"""

from __future__ import annotations

import argparse
import sys
import time

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pdserve.kernels.triton.fused_moe import _moe_gemm_kernel
from pdserve.kernels.triton.latent_attention import (
    _gather_latent_kernel,
    _paged_latent_decode_kernel,
    _prefill_attention_kernel,
    _store_latent_kernel,
    qk_split,
)
from pdserve.kernels.triton.lora import _lora_expand_kernel, _lora_shrink_kernel
from pdserve.kernels.triton.pack_blocks import _pack_blocks_kernel
from pdserve.kernels.triton.paged_decode_attention import (
    _paged_decode_attention_kernel,
    _paged_decode_merge_kernel,
)
from pdserve.kernels.triton.paged_prefill_attention import _paged_prefill_attention_kernel
from pdserve.kernels.triton.quant_linear import _quant_linear_kernel
from pdserve.kernels.triton.rms_norm import _rms_norm_kernel
from pdserve.kernels.triton.rotary_embedding import _rotary_embedding_kernel
from pdserve.kernels.triton.store_kv import _store_kv_kernel
from pdserve.kernels.triton.token_bitmask import BLOCK as BITMASK_BLOCK
from pdserve.kernels.triton.token_bitmask import _token_bitmask_kernel

FLOAT_ARGS = {"qk_scale", "eps", "cap", "swiglu_alpha", "swiglu_limit"}


def compile_kernel(kernel, pointers: dict[str, str], constexprs: dict, arch: int) -> None:
    """`pointers` maps each pointer arg to its element type; other args are i32 or fp32."""
    signature, const_values = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            const_values[(i,)] = constexprs[name]
        elif name in pointers:
            signature[name] = "*" + pointers[name]
        else:
            signature[name] = "fp32" if name in FLOAT_ARGS else "i32"
    src = ASTSource(kernel, signature, constexprs=const_values)
    triton.compile(src, target=GPUTarget("cuda", arch, 32))


def _attention_pointers(q: str, cache: str, split: bool, names: list[str]) -> dict[str, str]:
    scale = "fp16" if cache == "i8" else cache
    ptrs = {"q_ptr": q, "k_cache_ptr": cache, "v_cache_ptr": cache, "k_scale_ptr": scale,
            "v_scale_ptr": scale, "block_tables_ptr": "i32", "context_lens_ptr": "i32",
            "query_start_loc_ptr": "i32", "out_ptr": "fp32" if split else q,
            "m_ptr": "fp32" if split else q, "l_ptr": "fp32" if split else q,
            "sinks_ptr": "fp32"}
    return {k: v for k, v in ptrs.items() if k in names}


def variants():
    """(label, kernel, pointer types, constexprs) for each variant the wrappers launch."""
    decode_names = _paged_decode_attention_kernel.arg_names
    prefill_names = _paged_prefill_attention_kernel.arg_names
    for q, cache, dot in (("fp16", "fp16", tl.float16), ("bf16", "bf16", tl.bfloat16),
                          ("fp32", "fp32", tl.float32), ("bf16", "i8", tl.bfloat16)):
        prec = "ieee" if dot == tl.float32 else "tf32"
        quant = cache == "i8"
        # (window, soft cap, sinks): Gemma 2's window and cap on the bf16 cache; gpt-oss's
        # sinks with a window on bf16, without on int8; the others plain
        variants = {"bf16": ((False, False, False), (True, True, False), (True, False, True)),
                    "i8": ((False, False, False), (False, False, True))}
        for window, cap, sinks in variants.get(cache, ((False, False, False),)):
            flags = dict(WINDOW=window, SOFT_CAP=cap, SINKS=sinks)
            tag = "".join(f" {name}" for name, on in
                          (("window", window), ("softcap", cap), ("sinks", sinks)) if on)
            for group, split in ((8, True), (1, False)):
                yield (f"decode {cache} group={group} split={split}{tag}",
                       _paged_decode_attention_kernel,
                       _attention_pointers(q, cache, split, decode_names),
                       dict(GROUP=group, GROUP_PAD=16, HEAD_DIM=128, DIM_PAD=128, BLOCK_SIZE=16,
                            BLOCK_N=64, QUANT=quant, SPLIT=split, DOT=dot, PRECISION=prec,
                            **flags))
            yield (f"prefill {cache}{tag}", _paged_prefill_attention_kernel,
                   _attention_pointers(q, cache, False, prefill_names),
                   dict(GROUP=3, HEAD_DIM=64, DIM_PAD=64, BLOCK_SIZE=32, BLOCK_M=64, BLOCK_N=64,
                        QUANT=quant, DOT=dot, PRECISION=prec, **flags))
    yield ("decode merge", _paged_decode_merge_kernel,
           {"out_ptr": "bf16", "acc_ptr": "fp32", "m_ptr": "fp32", "l_ptr": "fp32"},
           dict(HEAD_DIM=80, DIM_PAD=128, SPLITS_PAD=32))
    for quant, cache in ((False, "bf16"), (True, "i8")):
        yield (f"store_kv {cache}", _store_kv_kernel,
               {"key_ptr": "bf16", "value_ptr": "bf16", "k_cache_ptr": cache,
                "v_cache_ptr": cache, "k_scale_ptr": "fp16", "v_scale_ptr": "fp16",
                "slot_mapping_ptr": "i64"},
               dict(NUM_KV_HEADS=3, HEAD_DIM=64, BLOCK_SIZE=16, HEADS_PAD=4, DIM_PAD=64,
                    QUANT=quant))
    for residual in (False, True):
        yield (f"rms_norm residual={residual}", _rms_norm_kernel,
               {"out_ptr": "bf16", "new_residual_ptr": "bf16", "x_ptr": "bf16",
                "residual_ptr": "bf16", "weight_ptr": "bf16"},
               dict(HIDDEN=576, BLOCK=1024, HAS_RESIDUAL=residual))
    yield ("rotary", _rotary_embedding_kernel,
           {"q_ptr": "bf16", "k_ptr": "bf16", "positions_ptr": "i64", "cos_ptr": "fp32",
            "sin_ptr": "fp32"},
           dict(NUM_HEADS=9, NUM_KV_HEADS=3, HEADS_PAD=16, KV_HEADS_PAD=4, HALF=32,
                HALF_PAD=32))
    for unpack in (False, True):
        yield (f"pack_blocks unpack={unpack}", _pack_blocks_kernel,
               {"buffer_ptr": "fp16", "k_cache_ptr": "fp16", "v_cache_ptr": "fp16",
                "block_ids_ptr": "i64"},
               dict(BLOCK_SIZE=16, NUM_HEADS=4, HEAD_DIM=128, TOKENS=16, COLS_PAD=512,
                    UNPACK=unpack))
    for x, bits, group, block_m, block_n, block_k in (
            ("bf16", 4, 32, 16, 32, 32), ("fp16", 4, 128, 64, 64, 64),
            ("bf16", 8, 4096, 16, 32, 64), ("fp32", 8, 32, 64, 64, 32)):
        dot = {"bf16": tl.bfloat16, "fp16": tl.float16, "fp32": tl.float32}[x]
        yield (f"quant_linear int{bits} {x} group={group}", _quant_linear_kernel,
               {"out_ptr": x, "x_ptr": x, "qweight_ptr": "u8" if bits == 4 else "i8",
                "scales_ptr": "fp32", "offsets_ptr": "fp32", "bias_ptr": x},
               dict(GROUP_SIZE=group, INT4=bits == 4, HAS_BIAS=bits == 4, BLOCK_M=block_m,
                    BLOCK_N=block_n, BLOCK_K=block_k, DOT=dot,
                    PRECISION="ieee" if x == "fp32" else "tf32"))


    yield from latent_variants()
    yield ("token_bitmask fp32", _token_bitmask_kernel,
           {"logits_ptr": "fp32", "bitmask_ptr": "i32"}, dict(BLOCK=BITMASK_BLOCK))
    segments = {"segment_starts_ptr": "i32", "segment_slots_ptr": "i32"}
    for x, block_m in (("bf16", 16), ("fp32", 64)):  # decodes' blocks; a prefill chunk's
        dot = tl.bfloat16 if x == "bf16" else tl.float32
        yield (f"lora_shrink {x}", _lora_shrink_kernel,
               {"buf_ptr": "fp32", "x_ptr": x, "a_ptr": x, **segments},
               dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=64, DOT=dot,
                    PRECISION="ieee" if x == "fp32" else "tf32"))
        yield (f"lora_expand {x}", _lora_expand_kernel,
               {"y_ptr": x, "buf_ptr": "fp32", "b_ptr": x, "slice_offsets_ptr": "i32",
                **segments},
               dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=16,
                    PRECISION="ieee" if x == "fp32" else "tf32x3"))
    # w13 + SiLU*up; w2; gpt-oss's biases and swigluoai on both; int8 and int4 experts
    for gated, x, oai, bits in ((True, "bf16", False, 0), (False, "bf16", False, 0),
                                (True, "fp32", False, 0), (True, "bf16", True, 0),
                                (False, "bf16", True, 0), (True, "bf16", False, 8),
                                (False, "bf16", False, 8), (True, "bf16", True, 4),
                                (False, "fp32", False, 4)):
        dot = tl.float32 if x == "fp32" else tl.bfloat16
        weight = {0: x, 8: "i8", 4: "u8"}[bits]
        yield (f"fused_moe {'w13 gated' if gated else 'w2 weighted'} {x}"
               f"{' bias swigluoai' if oai else ''}{f' int{bits}' if bits else ''}",
               _moe_gemm_kernel,
               {"c_ptr": x, "a_ptr": x, "b_ptr": weight, "scales_ptr": "fp32",
                "offsets_ptr": "fp32", "bias_ptr": x, "weights_ptr": "fp32",
                "sorted_ids_ptr": "i64", "block_experts_ptr": "i64"},
               dict(A_ROW_DIV=8 if gated else 1, GATED=gated, WEIGHTED=not gated,
                    HAS_BIAS=oai, ACTIVATION=int(oai), QUANT=bits, GROUP_SIZE=32 if bits else 1,
                    BLOCK_M=16, BLOCK_N=64, BLOCK_K=32 if bits else 64,
                    DOT=dot, PRECISION="ieee" if x == "fp32" else "tf32"))


def latent_variants():
    """MLA's kernels at DeepSeek-V3's shapes (rank 512 + rope 64; qk 192, v 128) per dtype."""
    for x, dot in (("bf16", tl.bfloat16), ("fp16", tl.float16), ("fp32", tl.float32)):
        prec = "ieee" if x == "fp32" else "tf32"
        for split in (True, False):
            yield (f"latent decode {x} split={split}", _paged_latent_decode_kernel,
                   {"out_ptr": "fp32" if split else x, "m_ptr": "fp32" if split else x,
                    "l_ptr": "fp32" if split else x, "q_ptr": x, "cache_ptr": x,
                    "block_tables_ptr": "i32", "context_lens_ptr": "i32"},
                   dict(RANK=512, RANK_PAD=512, ROPE=64, ROPE_PAD=64, BLOCK_H=16,
                        BLOCK_SIZE=64, BLOCK_N=32, SPLIT=split, DOT=dot, PRECISION=prec))
        qk_a, qk_b_pad = qk_split(192)
        yield (f"prefill_attention {x} qk=192 v=128", _prefill_attention_kernel,
               {"out_ptr": x, "q_ptr": x, "k_ptr": x, "v_ptr": x, "query_start_loc_ptr": "i32",
                "context_lens_ptr": "i32", "key_start_ptr": "i64"},
               dict(QK_DIM=192, QK_A=qk_a, QK_B_PAD=qk_b_pad, V_DIM=128, V_PAD=128,
                    BLOCK_M=64, BLOCK_N=32, DOT=dot, PRECISION=prec))
    yield ("latent decode merge rank=512", _paged_decode_merge_kernel,
           {"out_ptr": "bf16", "acc_ptr": "fp32", "m_ptr": "fp32", "l_ptr": "fp32"},
           dict(HEAD_DIM=512, DIM_PAD=512, SPLITS_PAD=32))
    yield ("store_latent bf16", _store_latent_kernel,
           {"entry_ptr": "bf16", "cache_ptr": "bf16", "slot_mapping_ptr": "i64"},
           dict(ENTRY_DIM=576, DIM_PAD=1024, BLOCK_SIZE=64))
    yield ("gather_latent bf16", _gather_latent_kernel,
           {"out_ptr": "bf16", "cache_ptr": "bf16", "block_tables_ptr": "i32",
            "context_lens_ptr": "i32", "out_start_ptr": "i64"},
           dict(ENTRY_DIM=576, DIM_PAD=1024, BLOCK_SIZE=64, BLOCK_T=16))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="SM version, e.g. 80 or 90")
    arch = parser.parse_args().arch
    failed = 0
    for label, kernel, pointers, constexprs in variants():
        start = time.perf_counter()
        try:
            compile_kernel(kernel, pointers, constexprs, arch)
            print(f"ok    sm_{arch} {label} ({time.perf_counter() - start:.1f}s)")
        except Exception as e:  # report every failure, not just the first
            failed += 1
            print(f"FAIL  sm_{arch} {label}: {type(e).__name__}: {e}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
