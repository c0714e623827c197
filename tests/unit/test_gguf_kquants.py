"""K-quants and Gemma 3 from GGUF: against gguf-py's dequantization and transformers' GGUF loader.

Synthetic files cover each type (gguf-py cannot quantize to K-quants: their blocks are random
bytes with finite fp16 scales); the real Gemma 3 270M Q4_K_M file (`gemma3-270m`, converted once
and cached) covers the name mapping, the norms and the config.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open

from pdserve.engine.default_model import (
    GEMMA3,
    GEMMA3_CHAT_TEMPLATE,
    ensure_model,
    gemma3_config,
)
from pdserve.engine.gguf_weights import hf_name, iter_gguf, read_gguf
from pdserve.kernels.quant_weights import QuantizedWeight, dequantize

Q = gguf.GGMLQuantizationType
HEADS, KV_HEADS, HIDDEN = 4, 2, 256  # K-quant rows hold whole 256-weight super-blocks
# where each block type keeps its fp16 scale(s): (byte offset, count) within the block
_FP16_FIELDS = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208, 1), Q.Q5_0: (0, 1),
                Q.Q5_1: (0, 2), Q.Q8_0: (0, 1)}


def _blocks(rng: np.random.Generator, qtype: Q, rows: int, cols: int) -> np.ndarray:
    """[rows, row bytes] of random blocks of `qtype` whose fp16 scales are finite."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    start, count = _FP16_FIELDS[qtype]
    scales = rng.uniform(-0.05, 0.05, (rows, cols // block, count)).astype(np.float16)
    raw[..., start:start + 2 * count] = scales.view(np.uint8)
    return raw.reshape(rows, -1)


def _write(path: Path, tensors: dict[str, tuple[np.ndarray, Q]], arch: str = "llama",
           extra=None) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    for add in extra or ():
        add(writer)
    for name, (x, qtype) in tensors.items():
        if x.dtype == np.uint8:
            writer.add_tensor(name, x, raw_dtype=qtype)
        else:
            writer.add_tensor(name, x)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q5_0, Q.Q5_1])
def test_types_without_a_kernel_load_as_gguf_py_dequantizes_them(tmp_path, qtype):
    rng = np.random.default_rng(int(qtype))
    shapes = {"blk.0.attn_q.weight": (HIDDEN, HIDDEN), "blk.0.attn_k.weight": (128, HIDDEN),
              "blk.0.ffn_down.weight": (HIDDEN, 2 * HIDDEN), "output.weight": (64, HIDDEN)}
    path = _write(tmp_path / "m.gguf",
                  {n: (_blocks(rng, qtype, *s), qtype) for n, s in shapes.items()})
    loaded = dict(iter_gguf(path))
    for tensor in gguf.GGUFReader(path).tensors:  # gguf-py's own reader and dequantization
        ref = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        if ".attn_q." in tensor.name or ".attn_k." in tensor.name:  # llama: RoPE rows back
            n = HEADS if ".attn_q." in tensor.name else KV_HEADS
            ref = ref.reshape(n, -1, 2, ref.shape[1]).swapaxes(2, 1).reshape(ref.shape)
        w = loaded[hf_name(tensor.name)[0]]
        assert isinstance(w, torch.Tensor) and w.dtype == torch.float32, tensor.name
        assert np.isfinite(ref).all() and torch.equal(w, torch.from_numpy(ref)), tensor.name


def test_read_gguf_reads_what_gguf_py_reads(tmp_path):
    rng = np.random.default_rng(7)
    extra = [lambda w: w.add_array("tokenizer.ggml.tokens", ["<pad>", "ä", "<end_of_turn>"]),
             lambda w: w.add_array("tokenizer.ggml.scores", [0.0, -1.5, 2.25]),
             lambda w: w.add_bool("tokenizer.ggml.add_bos_token", True),
             lambda w: w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-6),
             lambda w: w.add_uint64("llama.context_length", 1 << 40)]
    tensors = {"output_norm.weight": (rng.standard_normal(HIDDEN).astype(np.float32), Q.F32),
               "blk.0.attn_v.weight": (rng.standard_normal((8, HIDDEN)).astype(np.float16),
                                       Q.F16),
               "blk.0.ffn_up.weight": (_blocks(rng, Q.Q8_0, 8, HIDDEN), Q.Q8_0),
               "blk.0.ffn_down.weight": (_blocks(rng, Q.Q6_K, HIDDEN, HIDDEN), Q.Q6_K)}
    path = _write(tmp_path / "m.gguf", tensors, extra=extra)
    ours, reader = read_gguf(path), gguf.GGUFReader(path)
    assert sorted(ours.metadata) == sorted(k for k in reader.fields if not k.startswith("GGUF."))
    for key, value in ours.metadata.items():
        ref = reader.fields[key].contents()
        assert (value.tolist() if isinstance(value, np.ndarray) else value) == ref, key
    assert [(t.name, t.kind) for t in ours.tensors] == [(t.name, t.tensor_type.name)
                                                        for t in reader.tensors]
    for mine, theirs in zip(ours.tensors, reader.tensors):
        assert mine.data.dtype == theirs.data.dtype and mine.data.shape == theirs.data.shape
        assert np.array_equal(mine.data, theirs.data), mine.name


def test_a_fused_group_mixing_types_loads_dense_and_a_uniform_one_keeps_blocks(tmp_path):
    """Gemma 3's Q4_K_M file has attn_v in Q8_0 beside attn_q / attn_k in Q5_0."""
    rng = np.random.default_rng(8)
    path = _write(tmp_path / "m.gguf", {
        "blk.0.attn_q.weight": (_blocks(rng, Q.Q5_0, HIDDEN, HIDDEN), Q.Q5_0),
        "blk.0.attn_k.weight": (_blocks(rng, Q.Q5_0, 128, HIDDEN), Q.Q5_0),
        "blk.0.attn_v.weight": (_blocks(rng, Q.Q8_0, 128, HIDDEN), Q.Q8_0),
        "blk.0.ffn_gate.weight": (_blocks(rng, Q.Q8_0, 64, HIDDEN), Q.Q8_0),
        "blk.0.ffn_up.weight": (_blocks(rng, Q.Q8_0, 64, HIDDEN), Q.Q8_0)}, arch="gemma3")
    loaded = dict(iter_gguf(path))
    v = loaded["model.layers.0.self_attn.v_proj.weight"]
    assert isinstance(v, torch.Tensor) and v.dtype == torch.float32
    ref = gguf.quants.dequantize(gguf.GGUFReader(path).tensors[2].data, Q.Q8_0)
    assert torch.equal(v, torch.from_numpy(ref))
    assert isinstance(loaded["model.layers.0.mlp.gate_proj.weight"], QuantizedWeight)
    assert isinstance(loaded["model.layers.0.mlp.up_proj.weight"], QuantizedWeight)


def test_gemma3_config_follows_llama_cpp_for_what_the_file_leaves_out():
    meta = {"gemma3.block_count": 8, "gemma3.embedding_length": 512,
            "gemma3.feed_forward_length": 1024, "gemma3.attention.head_count": 4,
            "gemma3.attention.key_length": 128, "gemma3.context_length": 4096,
            "gemma3.attention.sliding_window": 64, "tokenizer.ggml.tokens": ["a", "b"]}
    config = gemma3_config(meta, {"output.weight"})
    assert config["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"] + [
        "sliding_attention"] * 2
    assert config["rope_parameters"] == {
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    assert (config["query_pre_attn_scalar"], config["num_key_value_heads"]) == (128, 4)
    assert (config["vocab_size"], config["tie_word_embeddings"]) == (2, False)
    assert config["eos_token_id"] == [1] and config["rms_norm_eps"] == 1e-6
    meta.update({"gemma3.attention.sliding_window_pattern": [True, False] * 4,
                 "gemma3.rope.freq_base_swa": 5e4, "gemma3.rope.scaling.type": "linear",
                 "gemma3.rope.scaling.factor": 8.0, "gemma3.attention.scale": 0.0625,
                 "gemma3.final_logit_softcapping": 30.0})
    config = gemma3_config(meta, set())
    assert config["layer_types"] == ["sliding_attention", "full_attention"] * 4
    assert config["rope_parameters"]["full_attention"] == {
        "rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}
    assert config["rope_parameters"]["sliding_attention"]["rope_theta"] == 5e4
    assert config["query_pre_attn_scalar"] == 256.0 and config["final_logit_softcapping"] == 30
    with pytest.raises(ValueError, match="sliding_window_pattern has 3 flags for 8 layers"):
        gemma3_config({**meta, "gemma3.attention.sliding_window_pattern": [True] * 3}, set())


# --- the real file -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gemma3():
    """(converted directory, our read of its GGUF, every tensor as iter_gguf yields it)."""
    if importlib.util.find_spec(GEMMA3.module) is None:
        pytest.skip(f"gemma3-270m needs its package: {GEMMA3.install}")
    model_dir = ensure_model(GEMMA3)
    path = model_dir / "model.gguf"
    return model_dir, read_gguf(path), dict(iter_gguf(path))


def test_gemma3_tensors_of_each_type_are_gguf_py_dequantized(gemma3):
    _, file, loaded = gemma3
    first = {}
    for tensor in file.tensors:
        first.setdefault(tensor.kind, tensor)
    assert sorted(first) == ["F32", "Q4_K", "Q5_0", "Q6_K", "Q8_0"]  # Q4_K_M's mix
    for kind in ("Q4_K", "Q6_K", "Q5_0"):
        tensor = first[kind]
        w = loaded[hf_name(tensor.name, "gemma3")[0]]
        ref = gguf.quants.dequantize(tensor.data, gguf.GGMLQuantizationType[kind])
        assert w.dtype == torch.float32 and torch.equal(w, torch.from_numpy(ref)), tensor.name


def test_gemma3_names_and_norms_are_transformers_gguf_loaders(gemma3):
    """transformers' own name map (from a Gemma3ForCausalLM, two layers deep: the map walks
    every submodule, ~2.5 s for all 18) and its gemma3 tensor processor, on layers 0 and 1."""
    from transformers import AutoConfig, Gemma3ForCausalLM
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        get_gguf_hf_weights_map,
    )

    model_dir, file, loaded = gemma3
    config = AutoConfig.from_pretrained(model_dir, num_hidden_layers=2)
    with torch.device("meta"):
        model = Gemma3ForCausalLM(config)
    processor = TENSOR_PROCESSORS["gemma3"]()
    names = get_gguf_hf_weights_map(model, processor)
    checked = []
    for tensor in file.tensors:
        if tensor.name.startswith(("blk.0.", "blk.1.", "output_norm.", "token_embd.")):
            assert names[tensor.name] == hf_name(tensor.name, "gemma3")[0]
        if tensor.name.startswith(("blk.0.", "blk.1.", "output_norm.")):
            ref = processor.process(gguf.quants.dequantize(tensor.data, Q[tensor.kind]),
                                    tensor.name).weights  # 1 subtracted from every norm
            w = loaded[names[tensor.name]]
            assert torch.equal(w, torch.from_numpy(np.asarray(ref, np.float32))), tensor.name
            checked.append(tensor.name)
    assert len(checked) == 2 * 13 + 1 and len(loaded) == len(file.tensors) == 236


def test_gemma3_converted_checkpoint_is_the_gguf_dequantized(gemma3):
    model_dir, _, loaded = gemma3
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        assert sorted(f.keys()) == sorted(loaded)
        for name in ("model.embed_tokens.weight", "model.layers.5.self_attn.q_norm.weight",
                     "model.layers.5.self_attn.v_proj.weight",
                     "model.layers.0.mlp.down_proj.weight"):
            w = loaded[name]  # the first 4096 rows: the embedding is 671 MB in fp32
            w = w.narrow(0, 0, min(4096, w.shape[0]))
            dense = dequantize(w) if isinstance(w, QuantizedWeight) else w.float()
            assert torch.equal(f.get_slice(name)[:4096], dense), name


def test_gemma3_config_is_the_gguf_metadata(gemma3):
    from transformers import AutoConfig

    model_dir, file, _ = gemma3
    meta = file.metadata
    config = json.loads((model_dir / "config.json").read_text())
    for key, field in [("hidden_size", "embedding_length"), ("num_hidden_layers", "block_count"),
                       ("intermediate_size", "feed_forward_length"),
                       ("num_attention_heads", "attention.head_count"),
                       ("num_key_value_heads", "attention.head_count_kv"),
                       ("head_dim", "attention.key_length"), ("head_dim", "attention.value_length"),
                       ("max_position_embeddings", "context_length"),
                       ("sliding_window", "attention.sliding_window")]:
        assert config[key] == meta[f"gemma3.{field}"], key
    assert np.float32(config["rms_norm_eps"]) == np.float32(
        meta["gemma3.attention.layer_norm_rms_epsilon"])
    embed = next(t for t in file.tensors if t.name == "token_embd.weight")
    assert config["vocab_size"] == len(meta["tokenizer.ggml.tokens"]) == embed.data.shape[0]
    assert config["tie_word_embeddings"] and all(t.name != "output.weight" for t in file.tensors)
    assert config["eos_token_id"] == [meta["tokenizer.ggml.eos_token_id"], 106]
    assert meta["tokenizer.ggml.tokens"][106] == "<end_of_turn>"
    assert config["bos_token_id"] == meta["tokenizer.ggml.bos_token_id"]
    hf = AutoConfig.from_pretrained(model_dir)  # as transformers reads it
    assert (hf.model_type, hf.architectures, hf.query_pre_attn_scalar) == (
        "gemma3_text", ["Gemma3ForCausalLM"], meta["gemma3.attention.key_length"])
    assert hf.layer_types == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert hf.rope_parameters["full_attention"]["rope_theta"] == meta["gemma3.rope.freq_base"]
    assert hf.rope_parameters["sliding_attention"]["rope_theta"] == 10_000.0
    assert hf.final_logit_softcapping is None and hf.attn_logit_softcapping is None
    assert (model_dir / "model.gguf").resolve().stat().st_size == 253_113_024


def test_gemma3_chat_template_renders_gemma_turns(gemma3):
    model_dir = gemma3[0]
    text = (model_dir / "chat_template.jinja").read_text()
    assert text == GEMMA3_CHAT_TEMPLATE
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(
        [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi "},
          {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]],
        chat_template=text, add_generation_prompt=True, bos_token="<bos>")
    assert rendered == ["<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
                        "<start_of_turn>model\nHello.<end_of_turn>\n"
                        "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"]
