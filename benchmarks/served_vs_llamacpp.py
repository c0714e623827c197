"""pdserve's embedded default (1 prefill + 1 decode worker), the same with the fixed placement
it had before, pdserve colocated and llama.cpp's server, one after the other on this machine,
the same OpenAI client and prompts: issue 42's table, and its targets checked in the same run
(pdserve's default at least 2x llama.cpp's output tok/s, its TTFT p50 no worse than
llama.cpp's, its TPOT p50 no worse than the fixed placement's).

The servers, their flags and the workload are benchmarks/serving_vs_vllm.py's (ShareGPT-like
token-id prompts, 32 requests at concurrency 16 by default, greedy, every request generating
its whole output length); llama.cpp runs `-np <concurrency> -t <cores>` on the same weights as
a bf16 GGUF. Build it and convert the model first (about 10 minutes on 2 cores, once):

    benchmarks/install_llamacpp.sh
    .venv/bin/python -m benchmarks.served_vs_llamacpp
"""

from __future__ import annotations

import sys

from benchmarks.serving_vs_vllm import parse_args, run

SYSTEMS = "pdserve-pd,pdserve-pd-fixed,pdserve-colocated,llamacpp"


def verdict(results: dict) -> str:
    """The targets, from the same run: pdserve's default against llama.cpp."""
    if "pdserve-pd" not in results or "llamacpp" not in results:
        return "targets: not checked (pdserve-pd and llamacpp must both have run)"
    pd, cpp = results["pdserve-pd"]["summary"], results["llamacpp"]["summary"]
    throughput = pd["output_token_throughput"] / cpp["output_token_throughput"]
    ttft = pd["ttft"]["p50"] / cpp["ttft"]["p50"]
    lines = [f"output tok/s: pdserve {throughput:.2f}x llama.cpp's (target >= 2x): "
             f"{'met' if throughput >= 2 else 'MISSED'}",
             f"TTFT p50: pdserve {ttft:.2f}x llama.cpp's (target <= 1x): "
             f"{'met' if ttft <= 1 else 'MISSED'}"]
    if "pdserve-pd-fixed" in results:  # the deployment as it placed prompts before
        tpot = pd["tpot"]["p50"] / results["pdserve-pd-fixed"]["summary"]["tpot"]["p50"]
        lines.append(f"TPOT p50: {tpot:.2f}x the fixed placement's (target <= 1x, within "
                     f"this host's swing): {'met' if tpot <= 1 else 'over'}")
    return "\n".join(lines)


def main() -> int:
    if "--systems" not in sys.argv:
        sys.argv[1:1] = ["--systems", SYSTEMS]
    if "--out" not in sys.argv:
        sys.argv[1:1] = ["--out", "bench-results/served_vs_llamacpp"]
    print(verdict(run(parse_args(), "served_vs_llamacpp")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
