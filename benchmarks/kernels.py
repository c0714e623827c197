"""Kernel benchmarks: bytes moved, flops, time and achieved bandwidth per kernel.

    python benchmarks/kernels.py [--threads N] [--repeat R]      # N defaults to 1

On CUDA the Triton kernels are timed with `triton.testing.do_bench` and their bandwidth is
given as a share of a measured device-to-device copy (the target: paged decode at batch 64 x
4k context >= 70%), their FLOP/s as a share of a measured cuBLAS matmul (8192^3, fp16). On
CPU the backend that serves there (`cpu`: the C kernels where they build, else `torch`) is
timed (best of `--repeat`), and the SmolLM2-135M decode step's
attention (9 heads, 3 KV heads, head_dim 64, 30 layers, fp32) at batch 32 x 1k context is
compared with dense SDPA over the same K/V stored contiguously (the target: within 1.3x), and
MLA's ops at DeepSeek-V3's per-rank shapes are timed (the C absorbed decode beside its reference).
Timings on a shared machine are noisy: the best of several runs is the figure that means
something.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.kernels.backend import KernelBackend, get_backend
from pdserve.kernels.kv_quant import allocate_kv_cache


@dataclass
class Row:
    name: str
    shape: str
    bytes: float
    flops: float
    seconds: float
    note: str = ""


def cpu_clock() -> Callable[[], float]:
    """One torch thread: the thread's CPU time, blind to time the OS gives other processes;
    more threads: wall time (their CPU time is spread over threads this one cannot see)."""
    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter


def time_cpu(fn: Callable[[], object], repeat: int) -> float:
    fn()  # warm-up: allocator, first-touch pages
    clock, best = cpu_clock(), float("inf")
    for _ in range(repeat):
        start = clock()
        fn()
        best = min(best, clock() - start)
    return best


def time_cuda(fn: Callable[[], object], repeat: int) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100 * max(1, repeat // 5)) / 1e3


def copy_bandwidth(device: torch.device, timer, repeat: int) -> float:
    """Bytes per second of a plain copy (read + write) of 512 MiB: the roofline we compare to."""
    src = torch.empty(128 << 20, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    return 2 * src.nbytes / timer(lambda: dst.copy_(src), repeat)


def gemm_flops(device: torch.device, dtype: torch.dtype, n: int, timer, repeat: int) -> float:
    """FLOP/s of one n x n x n matmul (cuBLAS on CUDA): the compute roof we compare to."""
    a = torch.randn(n, n, device=device).to(dtype)
    return 2 * n**3 / timer(lambda: a @ a, repeat)


def paged_batch(num_seqs, context_len, num_kv_heads, head_dim, block_size, dtype, device, gen,
                ordered=False):
    """Caches holding each sequence in a random permutation of blocks (or in allocation
    order: sequence by sequence, ascending), and the dense K/V they hold."""
    blocks = -(-context_len // block_size)
    num_blocks = num_seqs * blocks
    k_dense = torch.randn(num_seqs, blocks * block_size, num_kv_heads, head_dim, generator=gen)
    v_dense = torch.randn(num_seqs, blocks * block_size, num_kv_heads, head_dim, generator=gen)
    cache = allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype,
                              device)
    perm = torch.arange(num_blocks) if ordered else torch.randperm(num_blocks, generator=gen)
    tables = perm.view(num_seqs, blocks).to(device=device, dtype=torch.int32)
    slots = (perm.view(-1, 1) * block_size + torch.arange(block_size)).view(-1).to(device)
    ops = get_backend(device)
    store = ops.store_kv_int8 if dtype == torch.int8 else ops.store_kv
    key = k_dense.view(-1, num_kv_heads, head_dim).to(device)
    value = v_dense.view(-1, num_kv_heads, head_dim).to(device)
    store(key, value, *cache, slots)
    lens = torch.full((num_seqs,), context_len, dtype=torch.int32, device=device)
    dense = (k_dense[:, :context_len], v_dense[:, :context_len])
    return cache, tables, lens, dense


def attention_cost(num_seqs, context_len, num_heads, num_kv_heads, head_dim, kv_bytes, q_len=1):
    """(bytes, flops) of attention: K/V read once, QK^T and PV at 2 flops per MAC."""
    kv = 2 * num_seqs * context_len * num_kv_heads * head_dim * kv_bytes
    flops = 4 * num_seqs * q_len * num_heads * context_len * head_dim
    return kv, flops


def decode_step_cpu(args, gen) -> list[Row]:
    """SmolLM2-135M decode attention over 30 layers: the paged backend vs dense SDPA.

    The headline pages 16-token blocks at random places (a long-running server's cache);
    the other rows show what the gap is made of (blocks in allocation order, 64-token
    blocks) and what an int8 cache buys.
    """
    layers, num_seqs, ctx, heads, kv_heads, dim = 30, 32, 1024, 9, 3, 64
    ops = get_backend(torch.device("cpu"))
    q = torch.randn(num_seqs, heads, dim, generator=gen)
    qg = q.view(num_seqs, kv_heads, heads // kv_heads, dim)
    _, flops = attention_cost(num_seqs, ctx, heads, kv_heads, dim, 4)
    shape = f"{layers}L x {num_seqs} x {ctx} ctx, H{heads}/{kv_heads} D{dim} fp32"
    rows, t_dense = [], float("inf")
    for block_size, ordered, kv_dtype in ((16, False, torch.float32), (16, True, torch.float32),
                                          (64, False, torch.float32), (16, False, torch.int8)):
        batches, dense = [], []
        for _ in range(layers):
            cache, tables, lens, (k, v) = paged_batch(num_seqs, ctx, kv_heads, dim, block_size,
                                                      kv_dtype, torch.device("cpu"), gen,
                                                      ordered)
            batches.append((cache, tables, lens))
            # Dense: the same K/V as [S, Hkv, L, D], contiguous per sequence and head.
            dense.append((k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()))
        op = ops.paged_decode_attention_int8 if kv_dtype == torch.int8 else \
            ops.paged_decode_attention

        def paged(batches=batches, op=op):
            for cache, tables, lens in batches:
                op(q, *cache, tables, lens, 0.125, ctx)

        def sdpa(dense=dense):
            for k, v in dense:
                F.scaled_dot_product_attention(qg, k, v, scale=0.125)

        # Interleave so both see the same machine load; keep each one's best.
        t_paged = float("inf")
        for _ in range(max(1, args.repeat // 2)):
            t_paged = min(t_paged, time_cpu(paged, 2))
            t_dense = min(t_dense, time_cpu(sdpa, 2))
        nbytes = layers * sum(c.nbytes for c in batches[0][0])  # every block is in use
        layout = f"block {block_size}, {'allocation order' if ordered else 'random places'}"
        name = f"decode attn ({ops.name}, paged)"
        if kv_dtype == torch.int8:
            name, layout = f"decode attn ({ops.name}, int8 KV)", layout + ", int8"
        rows.append(Row(name, shape, nbytes, layers * flops, t_paged, layout))
        del batches, dense
    for row in rows:
        row.note += f": {row.seconds / t_dense:.2f}x dense SDPA"
    rows[0].note += " (target <= 1.3x)"
    nbytes = layers * 2 * num_seqs * ctx * kv_heads * dim * 4
    rows.append(Row("decode attn (dense SDPA)", shape, nbytes, layers * flops, t_dense,
                    "same K/V, contiguous [S, Hkv, L, D]"))
    return rows


def latent_rows_cpu(args, gen) -> list[Row]:
    """MLA (DeepSeek-V3, one rank of TP 8: 16 heads, latent 512 + RoPE 64, qk 192, v 128) in
    bf16: the absorbed decode at 32 sequences x 1k context, the C kernel against the reference;
    the ops the CPU room leaves on the references (store, gather, dense prefill) beside what
    bounds them (a contiguous copy of the same bytes)."""
    num_seqs, ctx, heads, rank, rope, block_size = 32, 1024, 16, 512, 64, 16
    entry_dim, dtype, cpu = rank + rope, torch.bfloat16, torch.device("cpu")
    ops, ref = get_backend(cpu), KernelBackend()
    num_blocks = num_seqs * ctx // block_size
    cache = torch.randn(num_blocks, block_size, entry_dim, generator=gen).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen).view(num_seqs, -1).int()
    lens = torch.full((num_seqs,), ctx, dtype=torch.int32)
    q = torch.randn(num_seqs, heads, entry_dim, generator=gen).to(dtype)
    flops = 2 * num_seqs * ctx * heads * (entry_dim + rank)  # scores, then values
    shape = f"{num_seqs} x {ctx} ctx H{heads} {rank}+{rope} bf16"
    rows = []
    for name, backend in (("torch", ref), (ops.name, ops)):
        t = time_cpu(lambda b=backend: b.paged_latent_decode_attention(
            q, cache, tables, lens, 0.07, ctx, rank), args.repeat)
        rows.append(Row(f"MLA decode ({name})", shape, cache.nbytes, flops, t))
    rows[-1].note = f"{rows[0].seconds / rows[-1].seconds:.1f}x the reference"
    entry = torch.randn(num_seqs, entry_dim, generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_seqs]
    t = time_cpu(lambda: ops.store_latent(entry, cache, slots), args.repeat)
    rows.append(Row(f"MLA store ({ops.name})", f"{num_seqs} tok", 2 * entry.nbytes, 0, t))
    flat = cache.view(-1, entry_dim)
    t_copy = time_cpu(lambda: flat.clone(), args.repeat)
    t = time_cpu(lambda: ops.gather_latent(cache, tables, lens), args.repeat)
    rows.append(Row(f"MLA gather ({ops.name})", f"{num_seqs} x {ctx} ctx", 2 * cache.nbytes,
                    0, t, f"{t / t_copy:.2f}x a contiguous copy"))
    rows.append(latent_prefill_row(ops, heads, 4, 512, gen, args.repeat))
    return rows


def latent_prefill_row(ops, heads, num_seqs, n, gen, repeat) -> Row:
    """MLA's dense prefill attention: `num_seqs` prompts of `n` tokens, qk 192, v 128, bf16."""
    qk, v_dim = 192, 128
    q = torch.randn(num_seqs * n, heads, qk, generator=gen).to(torch.bfloat16)
    k = torch.randn(num_seqs * n, heads, qk, generator=gen).to(torch.bfloat16)
    v = torch.randn(num_seqs * n, heads, v_dim, generator=gen).to(torch.bfloat16)
    qsl = torch.arange(0, num_seqs * n + 1, n, dtype=torch.int32)
    lens = torch.full((num_seqs,), n, dtype=torch.int32)
    t = time_cpu(lambda: ops.prefill_attention(q, k, v, qsl, lens, qk**-0.5), repeat)
    flops = 2 * num_seqs * heads * (qk + v_dim) * n * (n + 1) / 2
    return Row(f"MLA prefill attn ({ops.name})", f"{num_seqs} x {n} tok H{heads} 192/128",
               q.nbytes + k.nbytes + v.nbytes, flops, t)


@dataclass(frozen=True)
class Dims:
    """A model's attention shape and the batch the per-kernel rows run at."""

    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    decode_seqs: int
    decode_context: int
    prefill_seqs: int
    prefill_len: int
    dtype: torch.dtype


LLAMA3_8B = Dims(32, 8, 128, 4096, 64, 4096, 8, 512, torch.float16)
SMOLLM2_135M = Dims(9, 3, 64, 576, 32, 1024, 4, 512, torch.float32)


def decode_row(ops, kv_dtype, device, dims: Dims, timer, repeat, gen) -> Row:
    op = ops.paged_decode_attention_int8 if kv_dtype == torch.int8 else ops.paged_decode_attention
    n, ctx = dims.decode_seqs, dims.decode_context
    q = torch.randn(n, dims.heads, dims.head_dim, generator=gen).to(device, dims.dtype)
    cache, tables, lens, _ = paged_batch(n, ctx, dims.kv_heads, dims.head_dim, 16, kv_dtype,
                                         device, gen)
    t = timer(lambda: op(q, *cache, tables, lens, dims.head_dim**-0.5, ctx), repeat)
    nbytes = sum(c.nbytes for c in cache) + 2 * q.nbytes  # every block is in use
    _, flops = attention_cost(n, ctx, dims.heads, dims.kv_heads, dims.head_dim, 1)
    shape = f"{n} x {ctx} ctx H{dims.heads}/{dims.kv_heads} D{dims.head_dim}"
    name = "decode attn, kv " + str(kv_dtype).removeprefix("torch.")
    return Row(name, shape, nbytes, flops, t, "target >= 70% of copy")


def other_rows(ops: KernelBackend, device, dims: Dims, timer, repeat, gen) -> list[Row]:
    """Prefill, store, norm, rotary, pack at one model's dims on `device`."""
    heads, kv_heads, dim, dtype = dims.heads, dims.kv_heads, dims.head_dim, dims.dtype
    batch, n = dims.prefill_seqs, dims.prefill_len
    elt = dtype.itemsize
    rows = []
    cache, tables, lens, _ = paged_batch(batch, n, kv_heads, dim, 16, dtype, device, gen)
    q = torch.randn(batch * n, heads, dim, generator=gen).to(device, dtype)
    qsl = torch.arange(0, batch * n + 1, n, dtype=torch.int32, device=device)
    t = timer(lambda: ops.paged_prefill_attention(q, *cache, tables, qsl, lens, 0.125, n, n),
              repeat)
    kv, _ = attention_cost(batch, n, heads, kv_heads, dim, elt)
    flops = 4 * batch * heads * dim * n * (n + 1) / 2
    rows.append(Row("prefill attn", f"{batch} x {n} tok causal", kv + 2 * q.nbytes, flops, t))
    # store_kv: one prefill's worth of tokens.
    key = torch.randn(batch * n, kv_heads, dim, generator=gen).to(device, dtype)
    slots = torch.randperm(cache[0].shape[0] * 16, generator=gen)[: batch * n].to(device)
    t = timer(lambda: ops.store_kv(key, key, *cache, slots), repeat)
    rows.append(Row("store_kv", f"{batch * n} tok", 4 * key.nbytes, 0, t))
    # rms_norm with residual, and rotary, over the same tokens.
    x = torch.randn(batch * n, dims.hidden, generator=gen).to(device, dtype)
    w = torch.randn(dims.hidden, generator=gen).to(device, dtype)
    t = timer(lambda: ops.rms_norm(x, w, 1e-5, x), repeat)
    rows.append(Row("rms_norm + residual", f"{batch * n} x {dims.hidden}", 4 * x.nbytes,
                    4 * x.numel(), t))
    cos = torch.randn(4096, dim, generator=gen).to(device)
    pos = torch.randint(0, 4096, (batch * n,), generator=gen).to(device)
    t = timer(lambda: ops.rotary_embedding(q, key, pos, cos, cos), repeat)
    rows.append(Row("rotary (q and k)", f"{batch * n} tok", 2 * (q.nbytes + key.nbytes),
                    3 * (q.numel() + key.numel()), t))
    # pack_blocks: every block of the batch, half the KV heads (a TP=2 shard).
    ids = tables.reshape(-1).long()
    half = max(1, kv_heads // 2)
    t = timer(lambda: ops.pack_blocks(cache[0], cache[1], ids, 0, half), repeat)
    moved = 2 * 2 * ids.numel() * 16 * half * dim * elt
    rows.append(Row("pack_blocks", f"{ids.numel()} blocks, {half} heads", moved, 0, t))
    return rows


def kernel_rows(ops: KernelBackend, device, dims: Dims, timer, repeat, gen) -> list[Row]:
    """Every kernel of `ops` at `dims`: decode (float and int8 KV), then the others."""
    rows = [decode_row(ops, kv, device, dims, timer, repeat, gen) for kv in (dims.dtype,
                                                                            torch.int8)]
    return rows + other_rows(ops, device, dims, timer, repeat, gen)


def print_table(rows: list[Row], roof: float, flop_roof: float, device: str) -> None:
    print(f"{'kernel':<28} {'shape':<36} {'MB':>9} {'GFLOP':>8} {'ms':>9} {'GB/s':>7} "
          f"{'%copy':>6} {'%gemm':>6}  note")
    for r in rows:
        bw = r.bytes / r.seconds
        print(f"{r.name:<28} {r.shape:<36} {r.bytes / 1e6:>9.1f} {r.flops / 1e9:>8.2f} "
              f"{r.seconds * 1e3:>9.3f} {bw / 1e9:>7.1f} {100 * bw / roof:>5.0f}% "
              f"{100 * r.flops / r.seconds / flop_roof:>5.1f}%  {r.note}")
    print(f"(%copy: achieved bytes/s over a measured {device} copy at {roof / 1e9:.1f} GB/s; "
          f"%gemm: achieved FLOP/s over a measured matmul at {flop_roof / 1e12:.2f} TFLOP/s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1: what a decode worker gets of two "
                        "cores, and the only stable figure on a shared machine)")
    parser.add_argument("--repeat", type=int, default=6, help="timed runs; the best is shown")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        print(f"device: {name}; Triton kernels; host threads {torch.get_num_threads()}")
        cuda = torch.device("cuda")
        roof = copy_bandwidth(cuda, time_cuda, args.repeat)
        flop_roof = gemm_flops(cuda, LLAMA3_8B.dtype, 8192, time_cuda, args.repeat)
        rows = kernel_rows(get_backend(cuda), cuda, LLAMA3_8B, time_cuda, args.repeat, gen)
        print_table(rows, roof, flop_roof, "device-to-device")
        return
    clock = "thread CPU time" if cpu_clock() is time.thread_time else "wall time"
    print(f"device: CPU, {get_backend(torch.device('cpu')).name} backend, "
          f"{torch.get_num_threads()} torch threads "
          f"(interop {torch.get_num_interop_threads()}), best of {args.repeat} by {clock}")
    cpu = torch.device("cpu")
    roof = copy_bandwidth(cpu, time_cpu, args.repeat)
    flop_roof = gemm_flops(cpu, SMOLLM2_135M.dtype, 1024, time_cpu, args.repeat)
    rows = decode_step_cpu(args, gen)
    rows += other_rows(get_backend(cpu), cpu, SMOLLM2_135M, time_cpu, args.repeat, gen)
    rows += latent_rows_cpu(args, gen)
    print_table(rows, roof, flop_roof, "CPU memory")


if __name__ == "__main__":
    main()
