"""Read a llama.cpp GGUF file as (Hugging Face tensor name, weight) pairs, blocks kept as they are.

Q4_0 and Q4_1 become int4 `QuantizedWeight`s and Q8_0 int8 ones, all with group size 32 (a GGUF
block); F32, F16 and BF16 become dense tensors. Each block's fp16 parameters are kept exactly in
fp32, so `dequantize` of a yielded weight equals `gguf.quants.dequantize` of its block bit for
bit. Q5_0, Q5_1 and the K-quants (Q4_K, Q5_K, Q6_K: what Q4_K_M / Q5_K_M files hold) have no
kernel here: they are dequantized with gguf-py to dense fp32, as transformers' GGUF loader does,
and so is every member of a fused q/k/v or gate/up group whose members' types differ.

Five dense architectures, named as llama.cpp's converter (convert_hf_to_gguf.py) names them.
`llama` (Llama, Mistral, SmolLM2): the converter interleaves the rows of attn_q / attn_k for
llama.cpp's LLaMA-style RoPE (adjacent pairs rotated), so they are put back in Hugging Face order
(each head's halves rotated). `qwen2` (q/k/v biases), `qwen3` (per-head q/k norms) and `phi3`
run with NeoX RoPE there, which rotates halves as Hugging Face does: their rows are unchanged.
`phi3` keeps Hugging Face's fused attn_qkv (q, k, v rows) and ffn_up (gate, then up rows),
yielded under Hugging Face's fused names: the loader's `split_fused` cuts them by rows, as for
every format, quantized blocks kept; its longrope factor tensors are skipped (config.json holds
them). `gemma3`: no interleaving; the converter stores each Gemma RMSNorm weight as 1 + w, so 1
is subtracted back, in fp32, as transformers does.

Two mixture-of-experts architectures: `qwen3moe` (Qwen3-MoE: qwen3's names) and `llama` files
that carry experts (Mixtral, which the converter writes as llama, q/k interleaved as above).
Their router is ffn_gate_inp; the converter stacks each layer's experts into ffn_gate_exps,
ffn_up_exps and ffn_down_exps, [experts, rows, columns], which are cut back into one weight per
expert under its Hugging Face name (Mixtral's w1 gate, w3 up, w2 down), each decoded on its own
(blocks kept, as any weight's). A layer's three expert tensors take one form, as a fused group
does. Other mixture-of-experts files (deepseek2, gpt-oss, qwen2moe, ...) are refused, naming
the architecture. Which Hugging Face model a file stands for comes from the config.json beside
it: the reader only gives names.

Every yielded tensor owns its memory (none is a view of the file): the file is read through a
memory map and only one tensor is decoded at a time. `read_gguf` parses the header itself:
gguf-py's GGUFReader builds a numpy view per array element, ~9 s for Gemma 3's 262k-token
vocabulary, where this takes a fraction of a second.

Why one file: the header, the name maps and the block decoding are one format's reading, and
none of them is used apart.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pdserve.kernels.quant_weights import QuantizedWeight

GROUP = 32  # weights per Q4_0 / Q4_1 / Q8_0 block
KEPT_BITS = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4}  # served as their blocks
DEQUANTIZED = ("Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")  # to dense fp32 with gguf-py
SUPPORTED = ("F32", "F16", "BF16", *KEPT_BITS, *DEQUANTIZED)

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_PROJECTIONS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


@dataclass(frozen=True)
class _Arch:
    block_names: dict[str, str]
    unpermute_qk: bool  # llama.cpp interleaved q/k rows for its RoPE (LlamaModel.permute)
    norm_shift: float  # llama.cpp stored each *norm.weight as w + this
    # stacked experts tensor -> one expert's Hugging Face module, "{}" where its index goes
    experts: dict[str, str] = field(default_factory=dict)


_LLAMA_NAMES = {**_PROJECTIONS, "ffn_norm": "post_attention_layernorm"}
_QWEN3_NAMES = {**_LLAMA_NAMES, "attn_q_norm": "self_attn.q_norm",
                "attn_k_norm": "self_attn.k_norm"}
_ARCHS = {
    # Mixtral too: its router and experts as MixtralForCausalLM names them
    "llama": _Arch({**_LLAMA_NAMES, "ffn_gate_inp": "block_sparse_moe.gate"}, True, 0.0,
                   {"ffn_gate_exps": "block_sparse_moe.experts.{}.w1",
                    "ffn_up_exps": "block_sparse_moe.experts.{}.w3",
                    "ffn_down_exps": "block_sparse_moe.experts.{}.w2"}),
    "qwen2": _Arch(_LLAMA_NAMES, False, 0.0),  # q/k/v biases: the same names, .bias
    "qwen3": _Arch(_QWEN3_NAMES, False, 0.0),
    "qwen3moe": _Arch({**_QWEN3_NAMES, "ffn_gate_inp": "mlp.gate"}, False, 0.0,
                      {"ffn_gate_exps": "mlp.experts.{}.gate_proj",
                       "ffn_up_exps": "mlp.experts.{}.up_proj",
                       "ffn_down_exps": "mlp.experts.{}.down_proj"}),
    # Phi3ForCausalLM's fused matrices as Hugging Face names them (engine.loader.split_fused);
    # llama.cpp also reads a phi3 file with separate attn_q / attn_k / attn_v
    "phi3": _Arch({**_LLAMA_NAMES, "attn_qkv": "self_attn.qkv_proj",
                   "ffn_up": "mlp.gate_up_proj"}, False, 0.0),
    # Gemma3ForCausalLM: two norms around attention, two around the MLP, per-head q/k norms
    "gemma3": _Arch({**_PROJECTIONS, "attn_q_norm": "self_attn.q_norm",
                     "attn_k_norm": "self_attn.k_norm", "ffn_norm": "pre_feedforward_layernorm",
                     "post_attention_norm": "post_attention_layernorm",
                     "post_ffw_norm": "post_feedforward_layernorm"}, False, 1.0),
}
# Tensors our network fuses into one linear (q/k/v, gate/up), which takes one form: blocks of
# one bit width for all, or dense for all. Q4_K_M files mix types within a layer (attn_v Q8_0
# beside attn_q Q5_0 in Gemma 3's), so such a group loads dense. A layer's experts likewise:
# FusedExperts holds all of them quantized or none, each expert's gate and up as one matrix.
_FUSED = {"attn_q": "qkv", "attn_k": "qkv", "attn_v": "qkv", "ffn_gate": "gate_up",
          "ffn_up": "gate_up", "ffn_gate_exps": "experts", "ffn_up_exps": "experts",
          "ffn_down_exps": "experts"}
# Llama 3's RoPE frequency factors and Phi-3's longrope ones: Hugging Face reads them from
# config.json's rope_scaling and has no tensor for them (transformers' GGUF loader skips them).
_SKIPPED = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}
# Stacked experts and their router (ffn_gate_exps, ffn_gate_inp, shared ffn_*_shexp): what
# marks a mixture-of-experts file of an architecture not read here
_EXPERTS = re.compile(r"blk\.\d+\.ffn_\w+_(?:exps|inp|shexp)\.(?:weight|bias)")
# a block's tensor: blk.<layer>.<name>.<weight|bias>
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GLOBAL = re.compile(r"(\w+)\.(weight|bias)")


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    kind: str  # the GGML type's name: "Q4_K", "F32", ...
    # a view of the file, as gguf-py's reader gives it: F32 / F16 in their dtype with the
    # dimensions reversed ([rows, columns]); every other type as its bytes, [rows, row bytes]
    data: np.ndarray


@dataclass(frozen=True)
class GGUFFile:
    metadata: dict[str, Any]  # scalars as Python values, numeric arrays as numpy, strings as str
    tensors: list[GGUFTensor]

    @property
    def arch(self) -> str:
        return self.metadata.get("general.architecture", "")


def gguf_file(model_dir: Path) -> Path | None:
    """The single *.gguf file in `model_dir`; None if there is none, ValueError if several."""
    files = sorted(Path(model_dir).glob("*.gguf"))
    if len(files) > 1:
        raise ValueError(f"model: {model_dir} holds several GGUF files "
                         f"({', '.join(f.name for f in files)}); keep exactly one")
    return files[0] if files else None


def iter_gguf(path: Path) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """Yield every tensor of the llama (Mixtral too), qwen2, qwen3, qwen3moe, phi3 or gemma3
    GGUF file `path` under its Hugging Face name (Phi-3's fused attn_qkv / ffn_up as their
    q/k/v and gate/up parts; stacked experts as one weight per expert)."""
    file = read_gguf(path)
    arch = _architecture(file, path)
    heads = _field(file, f"{file.arch}.attention.head_count", path)
    kv_heads = _field(file, f"{file.arch}.attention.head_count_kv", path, default=heads)
    dense_groups = _mixed_fused_groups(file.tensors)
    for tensor in file.tensors:
        if tensor.name in _SKIPPED:
            continue
        kind = tensor.kind
        if kind not in SUPPORTED:
            raise ValueError(f"GGUF tensor {tensor.name} is {kind}; pdserve loads "
                             f"{', '.join(SUPPORTED[:-1])} and {SUPPORTED[-1]}")
        dense = kind in KEPT_BITS and _fused_group(tensor.name) in dense_groups
        experts = _expert_names(tensor.name, arch, len(tensor.data))
        if experts is not None:  # [experts, rows, columns (or row bytes)]: one expert at a time
            for name, data in zip(experts, tensor.data, strict=True):
                yield name, _weight(tensor.name, kind, data, dense)
            continue
        name, layer = hf_name(tensor.name, file.arch)
        data = tensor.data
        if arch.unpermute_qk and (".attn_q." in tensor.name or ".attn_k." in tensor.name):
            n = _per_layer(heads if ".attn_q." in tensor.name else kv_heads, layer)
            data = data[_unpermute_rows(data.shape[0], n, tensor.name)]
        if arch.norm_shift and "norm.weight" in tensor.name:
            weight = torch.from_numpy(_dequantize(data, kind) - np.float32(arch.norm_shift))
        else:
            weight = _weight(tensor.name, kind, data, dense)
        yield name, weight


def _weight(name: str, kind: str, data: np.ndarray, dense: bool
            ) -> torch.Tensor | QuantizedWeight:
    """A tensor's data decoded; `dense`: blocks of its fused group's other form, dequantized."""
    return torch.from_numpy(_dequantize(data, kind)) if dense else _decode(name, kind, data)


def _architecture(file: GGUFFile, path: Path) -> _Arch:
    """The file's architecture; ValueError for any other, naming mixture-of-experts ones."""
    arch = _ARCHS.get(file.arch)
    if arch is not None:
        return arch
    experts = next((t.name for t in file.tensors if _EXPERTS.fullmatch(t.name)), None)
    if experts is not None or "moe" in file.arch:
        found = f" (tensor {experts})" if experts else ""
        raise ValueError(f"GGUF file {path}: {file.arch!r} is a mixture-of-experts model"
                         f"{found}; of those pdserve reads qwen3moe and llama (Mixtral) GGUF "
                         "files only: serve its Hugging Face checkpoint instead")
    raise ValueError(f"GGUF file {path}: general.architecture is {file.arch!r}; pdserve "
                     f"reads {', '.join(_ARCHS)} GGUF files")


def _expert_names(gguf_name: str, arch: _Arch, count: int) -> list[str] | None:
    """The Hugging Face names of the `count` experts of a stacked experts tensor, in order;
    None for any other tensor."""
    match = _BLOCK.fullmatch(gguf_name)
    if match is None or match[2] not in arch.experts or match[3] != "weight":
        return None
    module = arch.experts[match[2]]
    return [f"model.layers.{match[1]}.{module.format(e)}.weight" for e in range(count)]


def _fused_group(gguf_name: str) -> tuple[str, str] | None:
    """(block, fused linear) of a q/k/v or gate/up weight; None for any other tensor."""
    match = _BLOCK.fullmatch(gguf_name)
    if match is None or match[2] not in _FUSED or match[3] != "weight":  # biases stay dense
        return None
    return match[1], _FUSED[match[2]]


def _mixed_fused_groups(tensors: list[GGUFTensor]) -> set[tuple[str, str]]:
    """The fused groups whose members do not all keep blocks of one bit width."""
    forms: dict[tuple[str, str], set] = {}
    for tensor in tensors:
        group = _fused_group(tensor.name)
        if group is not None:
            forms.setdefault(group, set()).add(KEPT_BITS.get(tensor.kind, "dense"))
    return {group for group, kinds in forms.items() if len(kinds) > 1 or "dense" in kinds}


def hf_name(gguf_name: str, arch: str = "llama") -> tuple[str, int | None]:
    """The Hugging Face name of a GGUF tensor of `arch` and its layer (None outside the blocks)."""
    match = _BLOCK.fullmatch(gguf_name)
    block_names = _ARCHS[arch].block_names
    if match and match[2] in block_names:
        layer = int(match[1])
        return f"model.layers.{layer}.{block_names[match[2]]}.{match[3]}", layer
    match = _GLOBAL.fullmatch(gguf_name)
    if match and match[1] in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[match[1]]}.{match[2]}", None
    raise ValueError(f"GGUF tensor {gguf_name} has no Hugging Face {arch} name")


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
    if kind in DEQUANTIZED:  # super-blocks of 256 (K) or 5-bit blocks: no kernel, dense fp32
        return torch.from_numpy(_dequantize(data, kind))
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


def _dequantize(data: np.ndarray, kind: str) -> np.ndarray:
    """gguf-py's dequantization to fp32 (a new array), the one transformers' loader uses."""
    import gguf

    out = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[kind])
    return np.array(out, dtype=np.float32)  # a copy for F32, whose "dequantization" is a view


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


def _field(file: GGUFFile, key: str, path: Path, default=None):
    """A metadata value (a scalar, or a list for an array field); ValueError if absent."""
    value = file.metadata.get(key)
    if value is None:
        if default is None:
            raise ValueError(f"GGUF file {path} has no {key} metadata")
        return default
    return value.tolist() if isinstance(value, np.ndarray) else value


def _per_layer(value, layer: int | None) -> int:
    """A head count, given once or per layer (llama.cpp accepts both)."""
    return int(value[layer] if isinstance(value, list) else value)


# --- the file format (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md) ---------------

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)  # as gguf-py's reader: v1 had 32-bit counts
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}  # GGUFValueType -> struct format
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32


def read_gguf(path: str | Path) -> GGUFFile:
    """The metadata and tensors (views of a read-only memory map) of the GGUF file `path`."""
    import gguf

    raw = np.memmap(path, dtype=np.uint8, mode="r")
    buf = memoryview(raw)
    if bytes(buf[:4]) != _MAGIC:
        raise ValueError(f"GGUF file {path}: not a GGUF file (no GGUF magic)")
    version, n_tensors, n_fields = struct.unpack_from("<IQQ", buf, 4)
    if version not in _VERSIONS:
        if version & 0xFFFF == 0:
            raise ValueError(f"GGUF file {path} is in the other byte order; pdserve reads "
                             "little-endian GGUF files")
        raise ValueError(f"GGUF file {path}: version {version}; pdserve reads versions 2 and 3")
    offset, metadata = 24, {}
    for _ in range(n_fields):
        key, offset = _read_string(buf, offset)
        (kind,), offset = struct.unpack_from("<I", buf, offset), offset + 4
        metadata[key], offset = _read_value(buf, offset, kind)
    infos = []
    for _ in range(n_tensors):
        name, offset = _read_string(buf, offset)
        (n_dims,) = struct.unpack_from("<I", buf, offset)
        dims = struct.unpack_from(f"<{n_dims}Q", buf, offset + 4)
        kind, start = struct.unpack_from("<IQ", buf, offset + 4 + 8 * n_dims)
        offset += 4 + 8 * n_dims + 12
        infos.append((name, gguf.GGMLQuantizationType(kind), dims, start))
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    data_start = -(-offset // alignment) * alignment
    tensors = [_tensor(raw, data_start, info, path) for info in infos]
    return GGUFFile(metadata, tensors)


def _tensor(raw: np.ndarray, data_start: int, info: tuple, path) -> GGUFTensor:
    """A tensor as gguf-py's reader shapes it (see GGUFTensor.data)."""
    import gguf

    name, qtype, dims, start = info
    shape = tuple(int(d) for d in reversed(dims))  # GGUF lists the fastest dimension first
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    n_bytes = int(np.prod(shape, dtype=np.int64)) * type_size // block
    begin = data_start + start
    if begin + n_bytes > raw.size:
        raise ValueError(f"GGUF file {path}: tensor {name} runs past the end of the file "
                         "(truncated?)")
    data = raw[begin:begin + n_bytes]
    if qtype == gguf.GGMLQuantizationType.F32:
        data = data.view(np.float32).reshape(shape)
    elif qtype == gguf.GGMLQuantizationType.F16:
        data = data.view(np.float16).reshape(shape)
    else:
        data = data.reshape(gguf.quant_shape_to_byte_shape(shape, qtype))
    return GGUFTensor(name, qtype.name, data)


def _read_string(buf: memoryview, offset: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", buf, offset)
    end = offset + 8 + length
    return str(buf[offset + 8:end], "utf-8", "replace"), end


def _read_value(buf: memoryview, offset: int, kind: int) -> tuple[Any, int]:
    if kind == _STRING:
        return _read_string(buf, offset)
    if kind in _SCALARS:
        fmt = _SCALARS[kind]
        return struct.unpack_from(fmt, buf, offset)[0], offset + struct.calcsize(fmt)
    if kind != _ARRAY:
        raise ValueError(f"GGUF metadata value of unknown type {kind}")
    item_kind, count = struct.unpack_from("<IQ", buf, offset)
    offset += 12
    if item_kind in _SCALARS:  # numeric arrays at once, not item by item
        dtype = np.dtype(_SCALARS[item_kind])
        end = offset + count * dtype.itemsize
        return np.frombuffer(buf[offset:end], dtype=dtype).copy(), end
    items = []
    for _ in range(count):
        item, offset = _read_value(buf, offset, item_kind)
        items.append(item)
    return items, offset
