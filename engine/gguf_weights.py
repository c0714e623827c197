"""Read a llama.cpp GGUF file as (Hugging Face tensor name, weight) pairs, blocks kept as they are.

Q4_0 and Q4_1 become int4 `QuantizedWeight`s and Q8_0 int8 ones, all with group size 32 (a GGUF
block); F32, F16 and BF16 become dense tensors. Each block's fp16 parameters are kept exactly in
fp32, so `dequantize` of a yielded weight equals `gguf.quants.dequantize` of its block bit for
bit. Rows of attn_q / attn_k are put back in Hugging Face order (llama.cpp interleaves them for
its RoPE), as transformers' GGUF loader does.

Every yielded tensor owns its memory: the file is read through the reader's memory map and only
one tensor is decoded at a time, never to fp32 (except the per-block scales and offsets).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from pdserve.kernels.quant_weights import QuantizedWeight

GROUP = 32  # weights per Q4_0 / Q4_1 / Q8_0 block
SUPPORTED = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Precomputed RoPE frequency factors (Llama 3): Hugging Face derives them from config.json's
# rope_scaling and has no tensor for them, as transformers' GGUF loader skips them too.
_SKIPPED = {"rope_freqs.weight"}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GLOBAL = re.compile(r"(\w+)\.(weight|bias)")


def gguf_file(model_dir: Path) -> Path | None:
    """The single *.gguf file in `model_dir`; None if there is none, ValueError if several."""
    files = sorted(Path(model_dir).glob("*.gguf"))
    if len(files) > 1:
        raise ValueError(f"model: {model_dir} holds several GGUF files "
                         f"({', '.join(f.name for f in files)}); keep exactly one")
    return files[0] if files else None


def iter_gguf(path: Path) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """Yield every tensor of the llama GGUF file `path` under its Hugging Face name."""
    tensors, heads, kv_heads = _open(path)
    for tensor in tensors:
        if tensor.name in _SKIPPED:
            continue
        kind = tensor.tensor_type.name
        if kind not in SUPPORTED:
            raise ValueError(f"GGUF tensor {tensor.name} is {kind}; pdserve loads "
                             f"{', '.join(SUPPORTED[:-1])} and {SUPPORTED[-1]}")
        name, layer = hf_name(tensor.name)
        data = tensor.data
        if ".attn_q." in tensor.name or ".attn_k." in tensor.name:
            n = _per_layer(heads if ".attn_q." in tensor.name else kv_heads, layer)
            data = data[_unpermute_rows(data.shape[0], n, tensor.name)]
        yield name, _decode(tensor.name, kind, data)


def _open(path: Path) -> tuple[list, int | list[int], int | list[int]]:
    """The file's tensors (views of its memory map) and head counts; the metadata is dropped.

    The reader parses every metadata field, the tokenizer's vocabulary included, into Python
    objects (about 160 MB and most of the load time for SmolLM2); only the tensors outlive it.
    """
    import gguf

    reader = gguf.GGUFReader(path)
    if reader.byte_order != "I":
        raise ValueError(f"GGUF file {path} is in the other byte order; pdserve reads "
                         "little-endian GGUF files")
    arch = _field(reader, "general.architecture", path)
    if arch != "llama":
        raise ValueError(f"GGUF file {path}: general.architecture is {arch!r}; pdserve reads "
                         "llama GGUF files")
    heads = _field(reader, "llama.attention.head_count", path)
    kv_heads = _field(reader, "llama.attention.head_count_kv", path, default=heads)
    return reader.tensors, heads, kv_heads


def hf_name(gguf_name: str) -> tuple[str, int | None]:
    """The Hugging Face Llama name of a GGUF tensor and its layer (None outside the blocks)."""
    match = _BLOCK.fullmatch(gguf_name)
    if match and match[2] in _BLOCK_NAMES:
        layer = int(match[1])
        return f"model.layers.{layer}.{_BLOCK_NAMES[match[2]]}.{match[3]}", layer
    match = _GLOBAL.fullmatch(gguf_name)
    if match and match[1] in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[match[1]]}.{match[2]}", None
    raise ValueError(f"GGUF tensor {gguf_name} has no Hugging Face Llama name")


def _unpermute_rows(rows: int, n_head: int, name: str) -> np.ndarray:
    """Row order taking llama.cpp's RoPE-interleaved q/k rows back to Hugging Face order.

    transformers' `_reverse_permute_weights`: w.reshape(n_head, rows // n_head // 2, 2, ...)
    .swapaxes(2, 1), written as the index of the GGUF row each output row comes from.
    """
    if n_head <= 0 or rows % (2 * n_head):
        raise ValueError(f"GGUF tensor {name}: {rows} rows do not split into {n_head} heads "
                         "of an even size")
    index = np.arange(rows).reshape(n_head, rows // n_head // 2, 2)
    return index.swapaxes(2, 1).reshape(rows)


def _decode(name: str, kind: str, data: np.ndarray) -> torch.Tensor | QuantizedWeight:
    """One tensor's data (the reader's array, rows already in their final order)."""
    if kind == "F32":
        return torch.from_numpy(np.array(data, dtype=np.float32))
    if kind == "F16":
        return torch.from_numpy(np.array(data, dtype=np.float16))
    if kind == "BF16":  # the reader gives raw bytes: [..., 2 * columns] uint8
        return torch.from_numpy(np.array(data).view(np.int16)).view(torch.bfloat16)
    if data.ndim != 2:
        raise ValueError(f"GGUF tensor {name}: {kind} is read as a matrix, got "
                         f"{data.ndim} dimensions")
    block_bytes = {"Q8_0": 2 + GROUP, "Q4_0": 2 + GROUP // 2, "Q4_1": 4 + GROUP // 2}[kind]
    rows = data.shape[0]
    blocks = data.reshape(rows, -1, block_bytes)
    scales = _fp16_to_fp32(blocks[..., 0:2])
    if kind == "Q8_0":
        q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(rows, -1)
        return QuantizedWeight(8, GROUP, torch.from_numpy(q), torch.from_numpy(scales))
    if kind == "Q4_1":  # w = d * q + m
        offsets = _fp16_to_fp32(blocks[..., 2:4])
        nibbles = blocks[..., 4:]
    else:  # Q4_0: w = d * (q - 8) = d * q - 8d, exact in fp32 (d has 11 significant bits)
        offsets = scales * np.float32(-8)
        nibbles = blocks[..., 2:]
    qweight = _reorder_nibbles(nibbles).reshape(rows, -1)
    return QuantizedWeight(4, GROUP, torch.from_numpy(qweight), torch.from_numpy(scales),
                           torch.from_numpy(offsets))


def _fp16_to_fp32(raw: np.ndarray) -> np.ndarray:
    """[rows, blocks, 2] little-endian fp16 bytes -> fp32 [rows, blocks]."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _reorder_nibbles(qs: np.ndarray) -> np.ndarray:
    """llama.cpp's 16 bytes per block (weight i low, i + 16 high) -> ours (2j low, 2j + 1 high).

    Byte j < 8 of ours holds weights 2j and 2j + 1: the low nibbles of GGUF bytes 2j and 2j + 1;
    byte 8 + j holds weights 16 + 2j and 17 + 2j: the high nibbles of those same bytes.
    """
    even, odd = qs[..., 0::2], qs[..., 1::2]
    out = np.empty(qs.shape, dtype=np.uint8)
    out[..., :8] = (even & 0x0F) | (odd << 4)
    out[..., 8:] = (even >> 4) | (odd & 0xF0)
    return out


def _field(reader, key: str, path: Path, default=None):
    """A metadata value (a scalar, or a list for an array field); ValueError if absent."""
    field = reader.fields.get(key)
    if field is None:
        if default is None:
            raise ValueError(f"GGUF file {path} has no {key} metadata")
        return default
    return field.contents()


def _per_layer(value, layer: int | None) -> int:
    """A head count, given once or per layer (llama.cpp accepts both)."""
    return int(value[layer] if isinstance(value, list) else value)
