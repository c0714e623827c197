"""MoE offline throughput: pdserve `LLM.generate` vs transformers vs vLLM's CPU build.

`offline_throughput.py`'s comparison on a Mixture-of-Experts model: the same workload (32
ShareGPT-like token-id prompts from `pdserve.bench.workloads.sharegpt_like`, `--scale`
shrinks them), the same children per system (warm-up on two short prompts, then one timed
pass; peak RSS, CPU seconds), the same vLLM child (`offline_vllm.py`, when `--vllm-python`
exists), the same greedy agreement and JSON; see that file's docstring for how each system is
driven. Not run here: its roofline lines (they count a dense MLP).

Model: a random Qwen3-MoE checkpoint of a realistic layer shape, written by transformers
itself (`Qwen3MoeForCausalLM.save_pretrained`) in bf16 and cached under
$PDSERVE_CACHE_DIR/models (default ~/.cache/pdserve/models): hidden 1024, 4 layers, 16 query
/ 4 KV heads of 64, every layer sparse with 64 experts of intermediate size 256, top-8 with
the top-k weights renormalized (Qwen3-30B-A3B's routing), SmolLM2's tokenizer and vocabulary
(49152) so text tooling works; 0.31 B weights, 0.14 B active per token. Weights drawn as
tests/tiny_models.py draws them (N(0, 0.1), embeddings N(0, 0.15), norms 1 + N(0, 0.1)): at
this width logits spread with std ~3; in fp32 (`--dtype float32`) all three systems agree token
for token, in bf16 rounding still flips some greedy tokens late in long outputs, between
transformers' own two paths too (printed as the yardstick).
`--model-dir` runs another HF checkpoint instead (Mixtral, a real Qwen3-MoE).

Systems, each in a child of its own with `--threads` threads: pdserve (experts through the
CPU backend's fused-MoE op, kernels/cpu/fused_moe.py); transformers `generate` (static
batches of `--hf-batch-size`) and `generate_batch` (continuous batching), both with
transformers' default experts implementation (printed; `grouped_mm` on torch >= 2.9);
vLLM's CPU build, skipped with the reason printed when its virtualenv is missing.

Printed: each system's output tok/s, pdserve / transformers (the issue's target: >= 5x) and
pdserve / vLLM, the threads each side had, the CPU (lscpu's model name, whether it has
AVX512-BF16) and greedy agreement against pdserve (reported, not asserted; transformers runs
in bf16 where torch has a bf16 matmul kernel, else fp32, see `--hf-dtype`).

    .venv/bin/python benchmarks/moe.py --threads 2 --json bench-results/moe.json
    .venv/bin/python benchmarks/moe.py --scale 0.1 --num-prompts 4   # a quick check
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# Run as a script, sys.path[0] is benchmarks/, whose kernels.py would shadow Hugging Face's
# `kernels` package for transformers (and for the spawned children, which inherit sys.path).
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]


def _sibling(name: str):
    """benchmarks/<name>.py imported by its path under its own name, as offline_throughput
    imports its siblings: a spawned child runs this file again, so `run_phase` (pickled as
    offline_throughput.run_phase) resolves there too."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, _HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


offline = _sibling("offline_throughput")
PDSERVE, HF_GENERATE, HF_BATCH, VLLM = (offline.PDSERVE, offline.HF_GENERATE, offline.HF_BATCH,
                                        offline.VLLM)
TARGET_VS_HF = 5.0  # the issue's: pdserve >= 5x transformers

# The checkpoint's shape (Qwen3MoeConfig fields); the vocabulary is the tokenizer's.
MOE_SHAPE = {
    "hidden_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 256,
    "intermediate_size": 3072,  # a dense MLP's; unused, every layer is sparse
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
CHECKPOINT_SEED = 0
CHECKPOINT_NAME = f"bench-qwen3-moe-h1024-l4-e64-k8-i256-bf16-seed{CHECKPOINT_SEED}-v1"


# ----------------------------------------------------------------------------- child side


def write_checkpoint(out: str, opts: dict) -> dict:
    """Child: the random Qwen3-MoE checkpoint (module doc) at `out`, written whole into a
    temporary sibling and renamed, so a half-written one is never found."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from pdserve.engine.default_model import ensure_default_model

    torch.set_num_threads(opts["threads"])
    dest = Path(out)
    tokenizer = AutoTokenizer.from_pretrained(str(ensure_default_model()))
    config = AutoConfig.for_model("qwen3_moe", vocab_size=len(tokenizer), **MOE_SHAPE)
    config.architectures = ["Qwen3MoeForCausalLM"]
    torch.manual_seed(CHECKPOINT_SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():  # tests/tiny_models.py's draws: well-separated logits
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.15 if "embed" in name else 0.1)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}."))
    tmp.chmod(0o755)  # mkdtemp makes it 0700
    try:
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        os.replace(tmp, dest)
    except OSError:
        if not (dest / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone after the rename; left over otherwise
    return _param_counts(model)


def _param_counts(model) -> dict:
    """Weights in the checkpoint and those one token runs through (its top-k experts only)."""
    cfg = model.config
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    active = total - experts + experts * cfg.num_experts_per_tok // cfg.num_experts
    return {"params": total, "active_params": active}


def hf_experts_implementation(path: str, opts: dict) -> str:
    """Child: which experts implementation transformers picks for this checkpoint by default
    (the model built on the meta device: nothing loaded)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return ", ".join(f"{k or 'model'}: {v}" for k, v in model.get_experts_implementation().items())


# ---------------------------------------------------------------------------- parent side


def ensure_checkpoint(args: argparse.Namespace) -> Path:
    """`--model-dir`, or the cached random checkpoint (written the first time, in a child)."""
    if args.model_dir is not None:
        return args.model_dir
    from pdserve.engine.default_model import cache_dir

    path = cache_dir() / CHECKPOINT_NAME
    if not (path / "config.json").is_file():
        print(f"writing the random Qwen3-MoE checkpoint to {path} ...", flush=True)
        counts = offline._spawn(write_checkpoint, str(path), {"threads": args.threads})
        print(f"  {counts['params'] / 1e9:.2f} B weights, {counts['active_params'] / 1e9:.2f} B "
              f"active per token")
    return path


def cpu_info() -> dict:
    """lscpu's model name and the bf16 instructions its flags list (/proc/cpuinfo without
    lscpu)."""
    fields: dict[str, str] = {}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True,
                             env=dict(os.environ, LC_ALL="C")).stdout
        fields = {k.strip(): v.strip() for k, _, v in
                  (line.partition(":") for line in out.splitlines())}
    except (OSError, subprocess.CalledProcessError):
        pass
    if "Model name" not in fields or "Flags" not in fields:
        with open("/proc/cpuinfo") as f:
            info = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in f)}
        fields.setdefault("Model name", info.get("model name", "unknown"))
        fields.setdefault("Flags", info.get("flags", ""))
    flags = set(fields["Flags"].split())
    return {"model_name": fields["Model name"], "cpus": os.cpu_count(),
            "avx512f": "avx512f" in flags, "avx512_bf16": "avx512_bf16" in flags,
            "amx_bf16": "amx_bf16" in flags}


def _tok_s(result: dict) -> float:
    return result["output_tokens"] / result["wall_s"]


def _print_summary(args: argparse.Namespace, results: list[dict]) -> dict:
    """pdserve's throughput over each other system's, and the threads each had."""
    by = {r["system"]: r for r in results}
    ratios = {}
    print()
    for other in (HF_GENERATE, HF_BATCH, VLLM):
        if PDSERVE not in by:
            break
        if other not in by:
            why = ("--skip-hf" if other != VLLM and args.skip_hf else
                   "--skip-vllm" if other == VLLM and args.skip_vllm else
                   f"{args.vllm_python} missing" if other == VLLM else "not run")
            print(f"pdserve / {other}: - ({why})")
            continue
        ratio = _tok_s(by[PDSERVE]) / _tok_s(by[other])
        ratios[other] = ratio
        target = ""
        if other in (HF_GENERATE, HF_BATCH):
            met = "met" if ratio >= TARGET_VS_HF else "NOT met"
            target = f"  (target >= {TARGET_VS_HF:.0f}x: {met})"
        print(f"pdserve / {other} = {ratio:.2f}x output tok/s "
              f"({_tok_s(by[PDSERVE]):.1f} vs {_tok_s(by[other]):.1f}){target}")
    print("threads: " + ", ".join(f"{r['system']} {r['threads']}" for r in results)
          + f" (--threads {args.threads}: torch.set_num_threads in each child, pdserve's "
          f"num_threads, vLLM's OMP threads bound to cores 0-{args.threads - 1}; "
          f"{os.cpu_count()} cpus)")
    return ratios


def _print_hf_agreement(results: list[dict], agreement: dict) -> None:
    """transformers' two paths against each other: how far bf16 rounding alone moves greedy
    tokens on this model (the yardstick for pdserve's agreement above)."""
    by = {r["system"]: r for r in results}
    if HF_GENERATE in by and HF_BATCH in by:
        a = offline._agreement(by[HF_GENERATE]["token_ids"], by[HF_BATCH]["token_ids"])
        agreement[f"{HF_GENERATE} vs {HF_BATCH}"] = a
        print(f"greedy agreement {HF_GENERATE} vs {HF_BATCH} (the same weights, two "
              f"transformers paths): {a['exact']}/{a['of']} requests identical, mean common "
              f"prefix {a['mean_common_prefix']:.1%} of the output")


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = offline.build_parser(__doc__.splitlines()[0])
    p.add_argument("--model-dir", type=Path, default=None,
                   help="an HF MoE checkpoint to run instead of the random Qwen3-MoE one")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = _parse_args(argv)
    path = ensure_checkpoint(args)
    hf = json.loads((path / "config.json").read_text())
    reqs, warm = offline.workload(args, hf["vocab_size"])
    opts = offline._options(args, reqs, path)
    cpu = cpu_info()
    experts = hf.get("num_experts") or hf.get("num_local_experts")
    print(f"model: {path.name} ({hf.get('model_type')}, hidden {hf['hidden_size']}, "
          f"{hf['num_hidden_layers']} layers, {experts} experts top-{hf.get('num_experts_per_tok')}"
          f", expert intermediate {hf.get('moe_intermediate_size') or hf['intermediate_size']}, "
          f"{hf['num_attention_heads']}/{hf['num_key_value_heads']} heads, vocab "
          f"{hf['vocab_size']}); dtype {opts['dtype']}")
    offline._print_workload(args, reqs)
    print(f"lscpu: {cpu['model_name']}; {cpu['cpus']} cpus; AVX512-BF16 "
          f"{'yes' if cpu['avx512_bf16'] else 'no'} (AVX-512F {'yes' if cpu['avx512f'] else 'no'}"
          f", AMX-BF16 {'yes' if cpu['amx_bf16'] else 'no'})")
    hf_experts = None
    if not args.skip_hf:
        hf_experts = offline._spawn(hf_experts_implementation, str(path), opts)
        print(f"transformers: {opts['hf_dtype']}, experts implementation {hf_experts}")
    results = offline.run_systems(args, reqs, warm, opts)
    print()
    offline._print_table(results)
    offline._print_notes(args, results)
    if not args.skip_hf:
        print(f"transformers ran in {opts['hf_dtype']}, the others in {opts['dtype']}.")
    ratios = _print_summary(args, results)
    agreement = offline._print_agreement(results)
    _print_hf_agreement(results, agreement)
    report = {
        "cpu": {**cpu, "kernels": offline._cpu_kind()},
        "model": {"path": str(path), "config": hf},
        "dtype": {"pdserve": opts["dtype"], "transformers": opts["hf_dtype"]},
        "transformers_experts": hf_experts,
        "ratios": {f"pdserve / {k}": v for k, v in ratios.items()},
        "target_vs_transformers": TARGET_VS_HF,
        **offline._report(args, reqs, results, agreement),
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    return report


if __name__ == "__main__":
    main()
