"""GPU hot path as Triton kernels, each beside its plain-torch reference.

Every kernel module holds `_name_kernel` (Triton), `name()` (the checked wrapper) and
`name_ref()` (plain torch: the CPU serving path and the test oracle):

    store_kv                  new K/V rows into cache slots (+ store_kv_int8: quantizing)
    paged_decode_attention    one query per sequence, split-K for long contexts (+ _int8)
    paged_prefill_attention   a causal chunk of queries per sequence (+ _int8)
    rms_norm                  with fused residual add, Hugging Face numerics
    rotary_embedding          rotate-half RoPE on q and k, in place
    pack_blocks               one layer's blocks <-> one contiguous transfer buffer

`paged_kv` is the torch attention both references share, `kv_quant` defines the int8 cache
format, `checks` the wrappers' argument checks, and `registry.get_backend(device)` picks
`triton` (CUDA) or `torch` (anything else).
"""
