"""A whole model on the kernel tests' device (`PDSERVE_KERNEL_DEVICE`) against the torch
reference on the CPU: greedy, token for token. A dense and a MoE model in every serving
variant (fp32, bf16, int8 KV, int8 / int4 weights; n-gram speculation on the dense one), and
each other architecture's features (tests/tiny_models.py's CASES: windows and soft caps,
local/global layers, latent attention with grouped routing, sinks with biased experts,
LongRoPE) in fp32 and bf16. In GPU mode (scripts/gpu_check.sh) that is CUDA with the Triton
kernels, CUDA graphs and all; on the CPU it is the C kernels.

Random tiny models without a tokenizer (prompts are token ids), written by transformers, so
the check needs nothing the GPU machine lacks. Where the two runs part, it must be a near tie
in the reference (its log-probabilities of the two tokens within the variant's tolerance):
another order of summation may flip a tie, and nothing else may.
"""

from __future__ import annotations

import os

import pytest

from pdserve.engine.sampling_params import SamplingParams
from pdserve.llm import LLM
from tests.kernel_device import kernel_device
from tests.tiny_models import CASES, write_tiny_model

DEVICE = kernel_device(os.environ)
VOCAB = 512
PROMPTS = [[5, 17, 300, 42, 9], list(range(7, 60)), [1] * 3, [(i * 37) % VOCAB for i in range(90)]]
MAX_TOKENS = 24

VARIANTS = {  # LLM arguments, tolerance of a near tie (reference log-prob gap)
    "fp32": ({"dtype": "float32"}, 1e-3),
    "bf16": ({"dtype": "bfloat16"}, 0.1),
    "int8-kv": ({"dtype": "float32", "kv_cache_dtype": "int8"}, 1e-3),
    "int8-weights": ({"dtype": "float32", "quantization": "int8"}, 1e-3),
    "int4-weights": ({"dtype": "float32", "quantization": "int4",
                      "quantization_group_size": 32}, 1e-3),
    "ngram-spec": ({"dtype": "float32", "speculative_config": {
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}}, 1e-3),
}
MODELS = {  # name: (model_type, overrides, the variants checked on a GPU)
    "llama": ("llama", {}, list(VARIANTS)),
    "qwen3_moe": ("qwen3_moe", {"num_experts": 8, "num_experts_per_tok": 2,
                                "moe_intermediate_size": 32, "head_dim": 16},
                  [v for v in VARIANTS if v != "ngram-spec"]),
    **{case: (*CASES[case], ["fp32", "bf16"]) for case in (
        "gemma2-softcap", "gemma3-local-global", "deepseek-v3-qlora-grouped",
        "gpt-oss-sinks-window", "phi3-longrope-window")},
}
# On the CPU the quantized variants are each checked against the references elsewhere
# (tests/integration); here every model in fp32 and bf16, and the speculation, keep the
# harness honest in seconds (and caught gpt-oss in bf16 failing at its routing weights).
CASES_CHECKED = [(model, variant) for model, (_, _, variants) in MODELS.items()
                 for variant in variants
                 if DEVICE == "cuda" or variant in ("fp32", "bf16", "ngram-spec")]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    return {name: str(write_tiny_model(tmp_path_factory.mktemp(name), model_type, seed=3,
                                       tokenizer=False, vocab_size=VOCAB, **extra))
            for name, (model_type, extra, _) in MODELS.items()
            if any(model == name for model, _ in CASES_CHECKED)}


def _generate(path: str, device: str, backend: str | None, args: dict, logprobs: int | None):
    llm = LLM(path, device=device, kernel_backend=backend, skip_tokenizer_init=True,
              num_kv_blocks=64, max_model_len=256, max_num_seqs=8, seed=0, **args)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            logprobs=logprobs)
    return llm.generate(PROMPTS, params)


@pytest.mark.parametrize("model,variant", CASES_CHECKED)
def test_greedy_on_the_device_equals_the_cpu_reference(model_dirs, model, variant):
    args, tie = VARIANTS[variant]
    ours = _generate(model_dirs[model], DEVICE, None, args, None)
    plain = {k: v for k, v in args.items() if k != "speculative_config"}  # greedy is greedy
    refs = _generate(model_dirs[model], "cpu", "torch", plain, logprobs=20)
    for i, (out, ref) in enumerate(zip(ours, refs, strict=True)):
        got, want = list(out.token_ids), list(ref.token_ids)
        if got == want:
            continue
        at = next(j for j, (a, b) in enumerate(zip(got, want)) if a != b)
        ranked = dict(ref.logprobs[at].top)
        assert got[at] in ranked, f"prompt {i}, token {at}: {got[at]} is not in the top 20"
        gap = ranked[want[at]] - ranked[got[at]]
        assert gap <= tie, f"prompt {i} parts at token {at} with a log-prob gap of {gap:.2e}"

