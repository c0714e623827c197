"""The GPU half of benchmarks/kernels.py, run on the interpreter at toy sizes.

No GPU here, so this is what checks that the benchmark's CUDA path (every Triton kernel,
float and int8 KV, through the registry) runs and reports finite numbers.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

from pdserve.kernels.backend import get_backend


def _benchmark_module():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels.py"
    spec = importlib.util.spec_from_file_location("kernel_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_benchmark_rows_for_every_triton_kernel(capsys):
    bench = _benchmark_module()
    tiny = bench.Dims(heads=4, kv_heads=2, head_dim=64, hidden=64, decode_seqs=2,
                      decode_context=40, prefill_seqs=1, prefill_len=20, dtype=torch.float16)
    gen = torch.Generator().manual_seed(0)
    triton = get_backend("cpu", "triton")
    rows = bench.kernel_rows(triton, torch.device("cpu"), tiny, bench.time_cpu, 1, gen)
    names = [r.name for r in rows]
    assert names[:2] == ["decode attn, kv float16", "decode attn, kv int8"]
    assert {"prefill attn", "store_kv", "rms_norm + residual", "pack_blocks"} <= set(names)
    assert all(r.seconds > 0 and r.bytes > 0 for r in rows)
    bench.print_table(rows, 1e9, 1e12, "test")
    assert "decode attn, kv int8" in capsys.readouterr().out
