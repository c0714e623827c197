"""The engine on the Triton kernels (interpreted on CPU) and on the C kernels gives the torch
backend's tokens."""

from __future__ import annotations

from pdserve import LLM, SamplingParams


def test_engine_on_triton_and_cpu_kernels_matches_torch(tiny_llama_dir):
    prompts = [[11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28], [40, 41]]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outputs = {}
    for backend in ("torch", "cpu", "triton"):
        llm = LLM(model=str(tiny_llama_dir), num_threads=2, num_kv_blocks=16, max_model_len=256,
                  kernel_backend=backend)
        assert llm.engine.core.runner.ops.name == backend
        outputs[backend] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outputs["triton"] == outputs["torch"]
    assert outputs["cpu"] == outputs["torch"]
