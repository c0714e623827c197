"""GGUF blocks read as QuantizedWeight: bit-exact against gguf's own dequantization; Qwen2, Qwen3,
Phi-3, Qwen3-MoE and Mixtral files laid out as llama.cpp's converter lays them out read back as
their checkpoint."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open

from pdserve.engine.config import load_model_config
from pdserve.engine.gguf_weights import gguf_file, hf_name, iter_gguf, read_gguf
from pdserve.engine.loader import split_fused
from pdserve.kernels.quant_weights import QuantizedWeight, dequantize
from tests.gguf_files import ROUTER, checkpoint, dequantized, llama_cpp_permute, write_gguf
from tests.tiny_models import write_tiny_model

Q = gguf.GGMLQuantizationType
HEADS, KV_HEADS, HIDDEN, FFN = 4, 2, 64, 96


def _random(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Normal values with a different magnitude per row, none of them zero."""
    x = rng.standard_normal(shape).astype(np.float32)
    x = np.where(x == 0, np.float32(0.5), x)
    return x * rng.uniform(0.01, 3.0, size=(shape[0],) + (1,) * (len(shape) - 1)).astype(
        np.float32)


def _write(path: Path, tensors: dict[str, tuple[np.ndarray, Q]], arch: str = "llama") -> Path:
    """A GGUF file holding each fp32 array encoded as its type (raw uint8 arrays as they are)."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    for name, (x, qtype) in tensors.items():
        if x.dtype == np.uint8:  # already encoded bytes
            writer.add_tensor(name, x, raw_dtype=qtype)
        elif qtype == Q.F32:
            writer.add_tensor(name, x)
        elif qtype == Q.F16:
            writer.add_tensor(name, x.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _reference(path: Path) -> dict[str, np.ndarray]:
    """gguf's dequantization of every tensor, q/k rows un-permuted as transformers does."""
    out = {}
    for tensor in gguf.GGUFReader(path).tensors:
        w = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        if ".attn_q." in tensor.name or ".attn_k." in tensor.name:
            n_head = HEADS if ".attn_q." in tensor.name else KV_HEADS
            w = w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
            w = w.swapaxes(2, 1).reshape(-1, *w.shape[3:])
        out[hf_name(tensor.name)[0]] = np.array(w)
    return out


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_quantized_blocks_dequantize_bit_for_bit(tmp_path, qtype):
    rng = np.random.default_rng(int(qtype))
    shapes = {"token_embd.weight": (48, HIDDEN), "blk.0.attn_q.weight": (HIDDEN, HIDDEN),
              "blk.0.attn_k.weight": (32, HIDDEN), "blk.1.ffn_down.weight": (HIDDEN, FFN),
              "output.weight": (48, HIDDEN)}
    path = _write(tmp_path / "m.gguf", {n: (_random(rng, s), qtype) for n, s in shapes.items()})
    reference = _reference(path)
    loaded = dict(iter_gguf(path))
    assert sorted(loaded) == sorted(reference)
    bits = 8 if qtype == Q.Q8_0 else 4
    for name, w in loaded.items():
        assert isinstance(w, QuantizedWeight) and (w.bits, w.group_size) == (bits, 32), name
        assert torch.equal(dequantize(w), torch.from_numpy(reference[name])), name


def test_nibbles_reordered_into_our_layout(tmp_path):
    """GGUF block byte i holds weights i (low) and i + 16 (high); ours 2j (low), 2j + 1 (high)."""
    q = np.arange(32, dtype=np.uint8) % 16  # weight k of the block has the value k mod 16
    raw = np.concatenate([np.frombuffer(np.float16(1).tobytes(), np.uint8),
                          (q[:16] | (q[16:] << 4)).astype(np.uint8)])[None, :]
    path = _write(tmp_path / "m.gguf", {"blk.0.ffn_up.weight": (raw, Q.Q4_0)})
    (_, w), = iter_gguf(path)
    assert w.qweight[0].tolist() == [(2 * j % 16) | ((2 * j + 1) % 16) << 4 for j in range(16)]
    assert dequantize(w)[0].tolist() == [float(k % 16 - 8) for k in range(32)]


def test_dense_types_keep_their_dtype_and_values(tmp_path):
    rng = np.random.default_rng(3)
    x32, x16, xbf = _random(rng, (HIDDEN,)), _random(rng, (32, HIDDEN)), _random(rng, (FFN,))
    path = _write(tmp_path / "m.gguf", {"output_norm.weight": (x32, Q.F32),
                                        "blk.0.attn_v.weight": (x16, Q.F16),
                                        "blk.0.ffn_norm.weight": (xbf, Q.BF16)})
    loaded = dict(iter_gguf(path))
    assert torch.equal(loaded["model.norm.weight"], torch.from_numpy(x32))
    assert torch.equal(loaded["model.layers.0.self_attn.v_proj.weight"],
                       torch.from_numpy(x16.astype(np.float16)))
    bf = loaded["model.layers.0.post_attention_layernorm.weight"]
    assert bf.dtype == torch.bfloat16
    ref = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(xbf, Q.BF16), Q.BF16))
    assert torch.equal(bf.float(), ref)


def test_q_and_k_rows_return_to_hugging_face_order(tmp_path):
    rng = np.random.default_rng(4)
    q, k = _random(rng, (HIDDEN, HIDDEN)), _random(rng, (32, HIDDEN))
    bias = _random(rng, (HIDDEN,))
    path = _write(tmp_path / "m.gguf", {
        "blk.2.attn_q.weight": (llama_cpp_permute(q, HEADS), Q.F32),
        "blk.2.attn_k.weight": (llama_cpp_permute(k, KV_HEADS), Q.F32),
        "blk.2.attn_q.bias": (llama_cpp_permute(bias, HEADS), Q.F32)})
    loaded = dict(iter_gguf(path))
    assert torch.equal(loaded["model.layers.2.self_attn.q_proj.weight"], torch.from_numpy(q))
    assert torch.equal(loaded["model.layers.2.self_attn.k_proj.weight"], torch.from_numpy(k))
    assert torch.equal(loaded["model.layers.2.self_attn.q_proj.bias"], torch.from_numpy(bias))


def test_a_refused_type_names_the_tensor_and_its_type(tmp_path):
    block, size = gguf.GGML_QUANT_SIZES[Q.Q2_K]
    raw = np.random.default_rng(5).integers(0, 256, (8, size), dtype=np.uint8)
    path = _write(tmp_path / "m.gguf", {"blk.0.ffn_down.weight": (raw, Q.Q2_K)})
    assert block == 256
    with pytest.raises(ValueError, match=r"GGUF tensor blk\.0\.ffn_down\.weight is Q2_K; "
                                         r"pdserve loads F32, F16, BF16, Q8_0, Q4_0, Q4_1, "
                                         r"Q5_0, Q5_1, Q4_K, Q5_K and Q6_K"):
        list(iter_gguf(path))


def test_other_architectures_and_unknown_tensors_are_refused(tmp_path):
    x = (np.ones(32, dtype=np.float32), Q.F32)
    with pytest.raises(ValueError, match="general.architecture is 'falcon'; pdserve reads "
                                         "llama, qwen2, qwen3, qwen3moe, phi3, gemma3 "
                                         "GGUF files"):
        list(iter_gguf(_write(tmp_path / "f.gguf", {"output_norm.weight": x}, arch="falcon")))
    with pytest.raises(ValueError, match="GGUF tensor blk.0.ssm_a has no Hugging Face"):
        list(iter_gguf(_write(tmp_path / "u.gguf", {"blk.0.ssm_a": x})))
    skipped = _write(tmp_path / "r.gguf", {"rope_freqs.weight": x, "output_norm.weight": x})
    assert [name for name, _ in iter_gguf(skipped)] == ["model.norm.weight"]


def test_gguf_file_is_the_single_gguf_of_a_directory(tmp_path):
    assert gguf_file(tmp_path) is None
    (tmp_path / "a.gguf").write_bytes(b"")
    assert gguf_file(tmp_path) == tmp_path / "a.gguf"
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="several GGUF files"):
        gguf_file(tmp_path)


@pytest.fixture(scope="module")
def smollm2_gguf(smollm2_dir):
    file = gguf_file(smollm2_dir)
    assert file is not None and file.name == "model.gguf" and file.is_symlink()
    return file, dict(iter_gguf(file))


def test_smollm2_blocks_are_its_gguf_bit_for_bit(smollm2_gguf):
    """First and last layer and the embedding against gguf (every tensor: the test below)."""
    file, loaded = smollm2_gguf
    kinds = {"int4": 0, "int8": 0, "dense": 0}
    for tensor in gguf.GGUFReader(file).tensors:
        w = loaded[hf_name(tensor.name)[0]]
        kinds["dense" if isinstance(w, torch.Tensor) else f"int{w.bits}"] += 1
        if not tensor.name.startswith(("blk.0.", "blk.29.", "token_embd.")):
            continue
        ref = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        if ".attn_q." in tensor.name or ".attn_k." in tensor.name:
            n_head = 9 if ".attn_q." in tensor.name else 3
            ref = ref.reshape(n_head, -1, 2, ref.shape[1]).swapaxes(2, 1).reshape(ref.shape)
        dense = w if isinstance(w, torch.Tensor) else dequantize(w)
        assert torch.equal(dense, torch.from_numpy(np.array(ref))), tensor.name
    assert kinds == {"int4": 210, "int8": 1, "dense": 61}


def test_smollm2_matches_its_converted_checkpoint(smollm2_dir, smollm2_gguf):
    _, loaded = smollm2_gguf
    with safe_open(str(smollm2_dir / "model.safetensors"), framework="pt") as f:
        assert sorted(loaded) == sorted(f.keys())
        for name, w in loaded.items():
            ref = f.get_tensor(name)
            assert tuple(w.shape) == tuple(ref.shape), name
            dense = dequantize(w) if isinstance(w, QuantizedWeight) else w
            # transformers made it with gguf.quants.dequantize and the same un-permutation
            assert torch.equal(dense, ref), name


# --- Qwen2, Qwen3, Phi-3, Qwen3-MoE and Mixtral files as llama.cpp's converter writes them -----

LONGROPE = {"type": "longrope", "short_factor": [1.0 + i / 8 for i in range(8)],
            "long_factor": [2.0 + i for i in range(8)]}
CONVERTED = {"qwen2": {}, "qwen3": {"head_dim": 32},  # head_dim != hidden / heads
             "phi3": {"pad_token_id": 0, "original_max_position_embeddings": 512,
                      "rope_scaling": LONGROPE},
             "qwen3_moe": {"head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2,
                           "moe_intermediate_size": 32},
             "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2,
                         "intermediate_size": 64}}


@pytest.fixture(scope="module")
def converted_dirs(tmp_path_factory):
    """Tiny random checkpoints, one per architecture (no tokenizer: nothing is generated)."""
    return {arch: write_tiny_model(tmp_path_factory.mktemp(arch), arch, seed=5, tokenizer=False,
                                   vocab_size=96, **overrides)
            for arch, overrides in CONVERTED.items()}


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0, Q.Q4_0], ids=lambda q: q.name)
@pytest.mark.parametrize("arch", sorted(CONVERTED))
def test_converted_file_reads_back_as_its_checkpoint(converted_dirs, arch, qtype):
    """Every tensor is the checkpoint's: exactly in F32 (Mixtral's q/k rows back in Hugging
    Face order), gguf-py's dequantization of its blocks in Q8_0 / Q4_0 (kept as blocks, each
    expert's too; the router F32); Phi-3's fused attn_qkv / ffn_up under Hugging Face's fused
    names, which the loader's split_fused cuts by whole rows of blocks; the longrope factor
    tensors skipped; stacked experts as one weight per expert."""
    model_dir = converted_dirs[arch]
    path = write_gguf(model_dir, qtype, f"{qtype.name}.gguf")
    file = read_gguf(path)
    names = {t.name for t in file.tensors}
    if arch == "phi3":  # what llama.cpp's converter writes for a Phi-3
        assert {"blk.1.attn_qkv.weight", "blk.1.ffn_up.weight", "rope_factors_long.weight",
                "rope_factors_short.weight"} <= names and "blk.1.ffn_gate.weight" not in names
    if arch in ("qwen3_moe", "mixtral"):  # ... for a Qwen3-MoE, and a Mixtral (as llama)
        assert file.arch == {"qwen3_moe": "qwen3moe", "mixtral": "llama"}[arch]
        assert file.metadata[f"{file.arch}.expert_count"] == 4
        layer = {t.name: t for t in file.tensors if t.name.startswith("blk.1.ffn_")}
        assert set(layer) == {"blk.1.ffn_norm.weight", "blk.1.ffn_gate_inp.weight",
                              "blk.1.ffn_gate_exps.weight", "blk.1.ffn_up_exps.weight",
                              "blk.1.ffn_down_exps.weight"}
        assert layer["blk.1.ffn_gate_inp.weight"].kind == "F32"
        assert layer["blk.1.ffn_down_exps.weight"].data.shape[0] == 4  # [experts, ...]
    reference = checkpoint(model_dir) if qtype == Q.F32 else dequantized(model_dir, qtype)
    assert sorted(name for name, _ in iter_gguf(path)) == sorted(reference)
    config = load_model_config(model_dir)
    want = dict(split_fused(reference.items(), config))
    got = dict(split_fused(iter_gguf(path), config))
    assert sorted(got) == sorted(want)
    for name, w in got.items():
        if isinstance(w, QuantizedWeight):
            assert (w.bits, w.group_size) == ({Q.Q8_0: 8, Q.Q4_0: 4}[qtype], 32), name
            w = dequantize(w)
        else:  # only norms, biases and the router stay dense
            assert qtype == Q.F32 or w.dim() == 1 or ROUTER.fullmatch(name), name
        assert w.dtype == torch.float32 and torch.equal(w, want[name]), name


def test_other_mixture_of_experts_files_are_refused_by_architecture(tmp_path):
    x = (np.ones((4, 32, 32), dtype=np.float32), Q.F32)
    for arch in ("deepseek2", "gpt-oss"):
        path = _write(tmp_path / f"{arch}.gguf", {"blk.0.ffn_gate_exps.weight": x}, arch=arch)
        with pytest.raises(ValueError, match=rf"'{arch}' is a mixture-of-experts model \(tensor "
                                             r"blk\.0\.ffn_gate_exps\.weight\); of those pdserve "
                                             r"reads qwen3moe and llama \(Mixtral\) GGUF files"):
            list(iter_gguf(path))
    with pytest.raises(ValueError, match="'qwen2moe' is a mixture-of-experts model; "):
        list(iter_gguf(_write(tmp_path / "q.gguf", {"blk.0.attn_q.weight": x},
                              arch="qwen2moe")))


@pytest.mark.parametrize("down", [Q.Q4_1, Q.Q8_0, Q.Q5_0], ids=lambda q: q.name)
def test_a_layers_experts_take_one_form(tmp_path, down):
    """Gate and up of each expert are fused, and FusedExperts holds all of a layer's experts
    quantized or none: blocks kept when the three stacks share one bit width, all dequantized
    (gguf-py's values) when they do not."""
    rng = np.random.default_rng(int(down))
    stacks = {"blk.0.ffn_gate_exps.weight": (_random(rng, (3, FFN, HIDDEN)), Q.Q4_0),
              "blk.0.ffn_up_exps.weight": (_random(rng, (3, FFN, HIDDEN)), Q.Q4_0),
              "blk.0.ffn_down_exps.weight": (_random(rng, (3, HIDDEN, FFN)), down)}
    path = _write(tmp_path / "m.gguf", stacks, arch="qwen3moe")
    loaded = dict(iter_gguf(path))
    part = {"gate": "gate_exps", "up": "up_exps", "down": "down_exps"}
    assert sorted(loaded) == sorted(f"model.layers.0.mlp.experts.{e}.{p}_proj.weight"
                                    for e in range(3) for p in part)
    kept = down == Q.Q4_1  # 4 bits, as Q4_0
    for tensor in gguf.GGUFReader(path).tensors:
        ref = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        for e in range(3):
            p = next(p for p, g in part.items() if g in tensor.name)
            w = loaded[f"model.layers.0.mlp.experts.{e}.{p}_proj.weight"]
            assert isinstance(w, QuantizedWeight) == kept, tensor.name
            w = dequantize(w) if kept else w
            assert torch.equal(w, torch.from_numpy(np.array(ref[e]))), (tensor.name, e)


def test_a_fused_qkv_that_does_not_split_into_the_heads_is_refused():
    config = SimpleNamespace(num_heads=4, num_kv_heads=2, head_dim=16)  # 64 + 32 + 32 rows
    fused = [("model.layers.0.self_attn.qkv_proj.weight", torch.ones(HIDDEN + 6, HIDDEN))]
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.qkv_proj\.weight: 70 "
                                         r"rows do not split into .*q_proj / .*v_proj of 64"):
        list(split_fused(fused, config))
