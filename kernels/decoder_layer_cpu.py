"""A bf16 decoder layer's step in one C call on the CPU backend (`decoder_layer_cpu.c`).

The C side runs the kernels the model's modules call (RMSNorm + residual, the packed bf16
linears, RoPE, the K/V store, paged attention, SiLU * up) back to back, through pointers to
those very functions, so its output is bit-identical to the module path; what it removes is
the Python between them: 5-16 us per kernel call, about a dozen calls per layer.

`prepare_layer` binds a layer's packed weights once (None where a weight is not in
`linear_bf16_cpu.c`'s layout: the module path keeps serving it); `DecoderStep` holds one
step's token metadata and the scratch rows every layer reuses; `decoder_layer_cpu` runs a
layer, or one half of it (`ATTENTION`, `MLP`) where tensor parallelism all-reduces between.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from pdserve.kernels import native, packed_linear

ATTENTION, MLP = 1, 2  # the halves of a layer (`parts`)
_P, _I64, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float

# (field of Kernels, kernels/<file>.c, symbol): what the layer calls, in the order it declares
_KERNELS = (
    ("rms_norm", "rms_norm_cpu", "rms_norm"),
    ("linear", "linear_bf16_cpu", "linear_bf16"),
    ("rotary_embedding", "rotary_embedding_cpu", "rotary_embedding"),
    ("store_kv", "store_kv_cpu", "store_kv"),
    ("attention", "paged_decode_attention_cpu", "paged_decode_attention"),
    ("silu_and_mul", "silu_and_mul_cpu", "silu_and_mul_bf16"),
)


class _Kernels(ctypes.Structure):
    _fields_ = [(field, _P) for field, _, _ in _KERNELS]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("kernels", ctypes.POINTER(_Kernels)),
        *((name, _P) for name in ("input_norm", "qkv", "qkv_bias", "o_proj", "post_norm",
                                  "gate_up", "down")),
        *((name, _I64) for name in ("hidden", "num_heads", "num_kv_heads", "head_dim",
                                    "intermediate")),
        ("eps", _F), ("scale", _F),
    ]


class _Step(ctypes.Structure):
    _fields_ = [
        ("num_tokens", _I64), ("positions", _P), ("slots", _P), ("cos", _P), ("sin", _P),
        ("block_tables", _P), ("table_stride", _I64), ("context_lens", _P),
        ("max_context", _I64), ("block_size", _I64), ("num_slots", _I64),
        *((name, _P) for name in ("hidden", "residual", "normed", "qkv", "attn", "gate_up",
                                  "act")),
    ]


@functools.cache
def _kernels() -> _Kernels | None:
    """The addresses of the kernels the layer calls, or None where one is not built (or the
    CPU lacks AVX512-BF16 for the linears)."""
    if not packed_linear.blocked_available():
        return None
    addresses = {}
    for field, name, symbol in _KERNELS:
        lib = native.load(name)
        if lib is None:
            return None
        addresses[field] = ctypes.cast(getattr(lib, symbol), _P).value
    return _Kernels(**addresses)


def _layer_fn():
    return native.function("decoder_layer_cpu", "decoder_layer",
                           (_P, _P, _P, _P, native.INT, native.INT), native.INT)


def available() -> bool:
    return _kernels() is not None and _layer_fn() is not None


@dataclass(frozen=True)
class PreparedLayer:
    """A layer's C view of its weights; `weights` keeps what it points into alive."""

    struct: _Layer
    weights: tuple[torch.Tensor, ...]

    @property
    def dims(self) -> tuple[int, int, int, int, int]:  # hidden, heads, kv heads, head, inter
        s = self.struct
        return s.hidden, s.num_heads, s.num_kv_heads, s.head_dim, s.intermediate


def prepare_layer(
    input_norm: torch.Tensor,  # [hidden] bf16
    qkv: torch.Tensor,  # packed [(H + 2 Hkv) * D / 64, hidden / 2, 64, 2]
    qkv_bias: torch.Tensor | None,  # [(H + 2 Hkv) * D]
    o_proj: torch.Tensor,  # packed, H * D inputs
    post_norm: torch.Tensor,  # [hidden]
    gate_up: torch.Tensor,  # packed, 2 * intermediate outputs
    down: torch.Tensor,  # packed, intermediate inputs
    num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
) -> PreparedLayer | None:
    """The layer bound for `decoder_layer_cpu`, or None where it does not fit the C path (a
    weight not bf16 in `linear_bf16_cpu.c`'s packed layout, the kernels not built)."""
    kernels = _kernels()
    linears = (qkv, o_proj, gate_up, down)
    if kernels is None or not all(_blocked(w) for w in linears):
        return None
    hidden = input_norm.shape[0]
    intermediate = gate_up.shape[0] * gate_up.shape[2] // 2
    shapes_fit = (
        _in_features(qkv) == _in_features(gate_up) == hidden == _out_features(o_proj)
        and _out_features(qkv) == (num_heads + 2 * num_kv_heads) * head_dim
        and _in_features(o_proj) == num_heads * head_dim
        and _in_features(down) == intermediate and _out_features(down) == hidden
    )
    vectors = (input_norm, post_norm) + ((qkv_bias,) if qkv_bias is not None else ())
    if not shapes_fit or not all(_bf16_rows(v) for v in vectors):
        return None
    weights = (input_norm, qkv, o_proj, post_norm, gate_up, down) + vectors[2:]
    struct = _Layer(
        ctypes.pointer(kernels), input_norm.data_ptr(), qkv.data_ptr(),
        qkv_bias.data_ptr() if qkv_bias is not None else None, o_proj.data_ptr(),
        post_norm.data_ptr(), gate_up.data_ptr(), down.data_ptr(),
        hidden, num_heads, num_kv_heads, head_dim, intermediate, eps, head_dim**-0.5,
    )
    return PreparedLayer(struct, weights)


class DecoderStep:
    """One step's tokens for every layer: each token's block table row and context (its
    position + 1), slots, RoPE tables, and the bf16 scratch rows the layers reuse. `hidden`
    ([num_tokens, hidden], contiguous bf16) is the stream the layers update in place."""

    def __init__(
        self,
        layer: PreparedLayer,
        hidden: torch.Tensor,  # [T, hidden] bf16, contiguous: overwritten layer by layer
        positions: torch.Tensor,  # [T] int64
        slot_mapping: torch.Tensor,  # [T] int64
        block_tables: torch.Tensor,  # [T, max_blocks] int32: each token's sequence's table
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [max_positions, head_dim] fp32
        block_size: int,
        num_slots: int,
    ):
        size, heads, kv_heads, head_dim, inter = layer.dims
        t = hidden.shape[0]
        new = functools.partial(torch.empty, dtype=torch.bfloat16)
        self.hidden, self.residual = hidden, new(t, size)
        self.positions = positions.to(torch.int64).contiguous()
        self.context_lens = (self.positions + 1).to(torch.int32)
        self.block_tables = block_tables.to(torch.int32).contiguous()
        self.slots = slot_mapping.to(torch.int64).contiguous()
        self.buffers = [new(t, n) for n in (size, (heads + 2 * kv_heads) * head_dim,
                                            heads * head_dim, 2 * inter, inter)]
        cos, sin = rope
        self.struct = _Step(
            t, self.positions.data_ptr(), self.slots.data_ptr(), cos.data_ptr(), sin.data_ptr(),
            self.block_tables.data_ptr(), self.block_tables.stride(0),
            self.context_lens.data_ptr(), int(self.context_lens.max()) if t else 0,
            block_size, num_slots, hidden.data_ptr(), self.residual.data_ptr(),
            *(b.data_ptr() for b in self.buffers),
        )
        self.rope = rope  # kept alive with the pointers above


def decoder_layer_cpu(
    layer: PreparedLayer, step: DecoderStep, k_cache: torch.Tensor, v_cache: torch.Tensor,
    parts: int = ATTENTION | MLP, first: bool = False,
) -> None:
    """Run `parts` of `layer` on `step.hidden` in place; `first`: the layer takes the
    embedding (the residual stream starts as a copy of it). Caches: [num_blocks, block_size,
    num_kv_heads, head_dim] bf16, contiguous (the caller checks)."""
    if step.struct.num_tokens == 0:
        return
    rc = _layer_fn()(ctypes.byref(layer.struct), ctypes.byref(step.struct), k_cache.data_ptr(),
                     v_cache.data_ptr(), parts, int(first))
    if rc == 1:
        raise IndexError(f"decoder_layer_cpu: a slot is past the cache's {step.struct.num_slots}")
    if rc:
        raise MemoryError("decoder_layer_cpu: attention scratch allocation failed")


def _blocked(w: torch.Tensor) -> bool:  # packed_linear's blocked layout, bf16
    return (w.dim() == 4 and w.dtype == torch.bfloat16 and w.is_contiguous()
            and w.shape[2] == packed_linear.tile_cols() and w.shape[3] == 2)


def _in_features(w: torch.Tensor) -> int:
    return w.shape[1] * 2


def _out_features(w: torch.Tensor) -> int:
    return w.shape[0] * w.shape[2]


def _bf16_rows(v: torch.Tensor) -> bool:
    return v.dtype == torch.bfloat16 and v.is_contiguous() and v.dim() == 1
