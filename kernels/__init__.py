"""Every op the model calls, through one dispatch: `backend.get_backend(device)`.

Three rooms, one per backend, with a module of the same name in each for the same op:

    reference/   plain torch: the `torch` backend, and the oracle every kernel is tested against
    cpu/         C kernels (AVX512-BF16 and AVX2 paths), their loader and ctypes wrappers,
                 packed bf16 weights in huge pages, a bf16 layer's step as one C call
    triton/      Triton kernels for CUDA (`_name_kernel` and its checked wrapper `name()`)

The ops:

    store_kv                  new K/V rows into cache slots (+ store_kv_int8: quantizing)
    paged_decode_attention    one query per sequence, split-K for long contexts (+ _int8)
    paged_prefill_attention   a causal chunk of queries per sequence (+ _int8)
    rms_norm                  with fused residual add, Hugging Face numerics
    rotary_embedding          rotate-half RoPE on q and k, in place
    silu_and_mul              SwiGLU's activation over a fused [gate | up] projection
    pack_blocks               one layer's blocks <-> one contiguous transfer buffer
    linear                    dense, packed or weight-only quantized: `prepare_linears`
    decoder_layers            the model's layer stack, run over a step

Beside the rooms: `backend` (the contract, and the `torch` backend), `decoder_layers` (the
layer stack op, and the block a backend may fuse), `attention_metadata` (the attention ops'
argument), `checks` (argument checks, plain torch), `kv_quant` (the int8 cache format) and
`quant_weights` (the int8 / int4 weight format).
"""
