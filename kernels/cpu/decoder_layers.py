"""The CPU backend's decoder layers: each bf16 layer of a step in one C call (`decoder_layer.c`).

The module path calls a dozen kernels per layer from Python (norm, QKV, RoPE, store,
attention, O, norm, gate/up, SiLU * up, down), and each call's wrapper costs 5-16 us: at a
decode step's few rows, about as much as the work. `decoder_layer.c` runs the same kernels
back to back, through pointers to those very functions, so its output is bit-identical to the
module path; what it removes is the Python between them.

`CpuDecoderLayers` is the backend's `decoder_layers` op: at `prepare()` it binds each layer's
packed weights once (`bind`: from the layer's `DecoderBlock`), and each step it turns the
`AttentionMetadata` into the per-token form the C attention takes (one decode query per token,
decodes and prefill chunks alike: `DecoderStep`). Under tensor parallelism each layer runs as
two calls (`ATTENTION`, `MLP`), the hidden state all-reduced after each (the O and down
projections give partial sums), as the modules do.

Bound only where every layer fits (a `DecoderBlock` whose linears are bf16 in `linear_bf16.c`'s
packed layout, none quantized, RoPE over the whole head; Qwen3's per-head q/k norms and sliding
windows included); a step takes it only with plain bf16 caches (an int8 cache keeps the module
path). Elsewhere the modules serve, as on any backend.

LoRA: a layer binds its adapters' slots (`DecoderBlock.loras`, bf16 as `lora.c` takes them) and
the C adds each linear's delta right after it, through lora.c's shrink and expand: the calls
the module path makes (`lora_shrink_cpu`, `lora_expand_cpu`), so an adapter's step stays
bit-identical too, without the dozen-calls-per-layer cost the C layer exists to remove. A step
with adapters (`meta.lora`) runs fused only where every layer bound its slots and the mapping
is what the C reads (int32 on the CPU, its slots within the weights'); else the modules serve.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.kernels.attention_metadata import AttentionMetadata
from pdserve.kernels.cpu import build
from pdserve.kernels.cpu.packed_linear import BlockedLinear, blocked_available, tile_cols
from pdserve.kernels.decoder_layers import DecoderBlock, DecoderLayers
from pdserve.kernels.lora_mapping import LoRAMapping, LoRAWeights

ATTENTION, MLP = 1, 2  # the halves of a layer (`parts`)
_P, _I64, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float

# (field of Kernels, kernels/cpu/<file>.c, symbol): what the layer calls, in the order it declares
_KERNELS = (
    ("rms_norm", "rms_norm", "rms_norm"),
    ("linear", "linear_bf16", "linear_bf16"),
    ("rotary_embedding", "rotary_embedding", "rotary_embedding"),
    ("store_kv", "store_kv", "store_kv"),
    ("attention", "paged_decode_attention", "paged_decode_attention_variant"),
    ("silu_and_mul", "silu_and_mul", "silu_and_mul_bf16"),
    ("lora_shrink", "lora", "lora_shrink"),
    ("lora_expand", "lora", "lora_expand"),
)


class _Kernels(ctypes.Structure):
    _fields_ = [(field, _P) for field, _, _ in _KERNELS]


class _Adapter(ctypes.Structure):  # one linear's LoRA slots; a NULL: none bound
    _fields_ = [("a", _P), ("b", _P), ("offsets", _P), ("num_slices", _I64), ("rank", _I64)]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("kernels", ctypes.POINTER(_Kernels)),
        *((name, _P) for name in ("input_norm", "qkv", "qkv_bias", "o_proj", "post_norm",
                                  "gate_up", "down", "q_norm", "k_norm")),
        *((name, _I64) for name in ("hidden", "num_heads", "num_kv_heads", "head_dim",
                                    "intermediate", "window")),
        ("eps", _F), ("scale", _F),
        ("lora", _Adapter * 4),  # qkv, o_proj, gate_up, down
    ]


class _Step(ctypes.Structure):
    _fields_ = [
        ("num_tokens", _I64), ("positions", _P), ("slots", _P), ("cos", _P), ("sin", _P),
        ("block_tables", _P), ("table_stride", _I64), ("context_lens", _P),
        ("max_context", _I64), ("block_size", _I64), ("num_slots", _I64),
        *((name, _P) for name in ("hidden", "residual", "normed", "qkv", "attn", "gate_up",
                                  "act")),
        ("lora_starts", _P), ("lora_slots", _P), ("lora_segments", _I64), ("lora_buf", _P),
    ]


@functools.cache
def _kernels() -> _Kernels | None:
    """The addresses of the kernels the layer calls, or None where one is not built (or the
    CPU lacks AVX512-BF16 for the linears)."""
    if not blocked_available():
        return None
    addresses = {}
    for field, name, symbol in _KERNELS:
        lib = build.load(name)
        if lib is None:
            return None
        addresses[field] = ctypes.cast(getattr(lib, symbol), _P).value
    return _Kernels(**addresses)


def _layer_fn():
    return build.function("decoder_layer", "decoder_layer",
                           (_P, _P, _P, _P, build.INT, build.INT), build.INT)


def available() -> bool:
    return _kernels() is not None and _layer_fn() is not None


@dataclass(frozen=True)
class PreparedLayer:
    """A layer's C view of its weights; `weights` keeps what it points into alive (the
    rope tables stay alive with the step that points into them)."""

    struct: _Layer
    weights: tuple[torch.Tensor, ...]
    lora_slots: int = 0  # the slots its bound adapters hold (0: none bound)
    lora_width: int = 0  # its widest linear's slices * rank: the shrink's columns

    @property
    def dims(self) -> tuple[int, int, int, int, int]:  # hidden, heads, kv heads, head, inter
        s = self.struct
        return s.hidden, s.num_heads, s.num_kv_heads, s.head_dim, s.intermediate


def bind(block: DecoderBlock) -> PreparedLayer | None:
    """The layer bound for `decoder_layer.c`, or None where it does not fit the C path (a
    linear not bf16 in `linear_bf16.c`'s packed layout, RoPE not over the whole head, q/k
    norms not a bf16 [head_dim] pair, the kernels not built)."""
    kernels = _kernels()
    linears = (block.qkv, block.o_proj, block.gate_up, block.down)
    if kernels is None or not all(_blocked(k) for k in linears):
        return None
    qkv, o_proj, gate_up, down = (k.packed for k in linears)
    hidden, heads, kv_heads, dim = (block.input_norm.shape[0], block.num_heads,
                                    block.num_kv_heads, block.head_dim)
    intermediate = gate_up.shape[0] * gate_up.shape[2] // 2
    shapes_fit = (
        _in_features(qkv) == _in_features(gate_up) == hidden == _out_features(o_proj)
        and _out_features(qkv) == (heads + 2 * kv_heads) * dim
        and _in_features(o_proj) == heads * dim
        and _in_features(down) == intermediate and _out_features(down) == hidden
    )
    vectors = _vectors(block)
    rope_fits = all(t.dtype == torch.float32 and t.is_contiguous() and t.shape[-1] == dim
                    for t in block.rope)
    if not shapes_fit or not rope_fits or vectors is None:
        return None
    struct = _Layer(
        ctypes.pointer(kernels), block.input_norm.data_ptr(), qkv.data_ptr(),
        _address(block.qkv_bias), o_proj.data_ptr(), block.post_norm.data_ptr(),
        gate_up.data_ptr(), down.data_ptr(), _address(block.q_norm), _address(block.k_norm),
        hidden, heads, kv_heads, dim, intermediate, block.window or 0, block.eps, dim**-0.5,
    )
    packed = (qkv, o_proj, gate_up, down)
    kept, slots, width = _bind_loras(struct, block.loras, packed)
    return PreparedLayer(struct, packed + vectors + kept, slots, width)


def _bind_loras(
    struct: _Layer, loras: Sequence[LoRAWeights] | None, packed: Sequence[torch.Tensor],
) -> tuple[tuple[torch.Tensor, ...], int, int]:  # what it points into, slots, widest R
    """The layer's adapter slots set in `struct.lora` where all four fit lora.c (bf16, on the
    CPU, contiguous, their linear's shape, one slot count); else none (NULL: an adapter's
    step then keeps the module path) and (), 0, 0."""
    if loras is None or not all(_lora_fits(w, p, loras[0].a.shape[0])
                                for w, p in zip(loras, packed)):
        return (), 0, 0
    kept, width = [], 0
    for i, w in enumerate(loras):
        offsets = torch.tensor(w.slice_offsets, dtype=torch.int64)
        num_slices, rank = len(w.slice_offsets) - 1, w.b.shape[2]
        struct.lora[i] = _Adapter(w.a.data_ptr(), w.b.data_ptr(), offsets.data_ptr(),
                                  num_slices, rank)
        kept += (w.a, w.b, offsets)
        width = max(width, num_slices * rank)
    return tuple(kept), loras[0].a.shape[0], width


def _lora_fits(w: LoRAWeights, packed: torch.Tensor, slots: int) -> bool:
    """Whether lora.c takes w beside its linear (`packed`): a [slots, n R, in], b [slots,
    out, R] bf16 contiguous CPU tensors, offsets rising from 0 to out."""
    offsets, (a, b) = w.slice_offsets, (w.a, w.b)
    plain = all(t.dtype == torch.bfloat16 and t.is_cpu and t.is_contiguous() and t.dim() == 3
                for t in (a, b))
    return (plain and a.shape[0] == b.shape[0] == slots > 0 and b.shape[2] > 0
            and a.shape[1] == (len(offsets) - 1) * b.shape[2]
            and a.shape[2] == _in_features(packed) and b.shape[1] == _out_features(packed)
            and offsets[0] == 0 and offsets[-1] == b.shape[1]
            and all(lo < hi for lo, hi in zip(offsets, offsets[1:])))


class DecoderStep:
    """One step's tokens for every layer: each token's block table row and context (its
    position + 1), slots, RoPE tables, and the bf16 scratch rows the layers reuse. `hidden`
    ([num_tokens, hidden], contiguous bf16) is the stream the layers update in place. With
    `lora` (the step's adapters; None: a base step, which the C then skips LoRA for), its
    segments and an fp32 [num_tokens, lora_width] buffer for each linear's shrink."""

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
        lora: LoRAMapping | None = None,
        lora_width: int = 0,  # the widest linear's slices * rank
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
            *(b.data_ptr() for b in self.buffers), *self._lora(lora, t, lora_width),
        )
        self.rope = rope  # kept alive with the pointers above

    def _lora(self, lora: LoRAMapping | None, t: int, width: int) -> tuple:
        """Step.lora_starts, lora_slots, lora_segments, lora_buf (NULLs for a base step); the
        mapping and the buffer kept alive with the step."""
        self.lora = lora
        if lora is None:
            return None, None, 0, None
        self.lora_buf = torch.empty(t, width, dtype=torch.float32)
        return (lora.segment_starts.data_ptr(), lora.segment_slots.data_ptr(),
                lora.segment_slots.shape[0], self.lora_buf.data_ptr())


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
        raise IndexError(f"decoder_layer: a slot is past the cache's {step.struct.num_slots}")
    if rc:
        raise MemoryError("decoder_layer: a kernel's scratch allocation failed")


def _vectors(block: DecoderBlock) -> tuple[torch.Tensor, ...] | None:
    """The block's norm weights and bias (those it has), or None where one is not a bf16 row
    of its size: the q/k norms come as a pair of [head_dim] or not at all."""
    head_norms = tuple(n for n in (block.q_norm, block.k_norm) if n is not None)
    if len(head_norms) == 1 or any(n.shape[0] != block.head_dim for n in head_norms):
        return None
    vectors = (block.input_norm, block.post_norm) + head_norms + (
        (block.qkv_bias,) if block.qkv_bias is not None else ())
    return vectors if all(_bf16_rows(v) for v in vectors) else None


def _address(t: torch.Tensor | None) -> int | None:  # NULL for a part the model lacks
    return t.data_ptr() if t is not None else None


def _blocked(kernel: object) -> bool:  # packed_linear's blocked layout, bf16
    if not isinstance(kernel, BlockedLinear):
        return False
    w = kernel.packed
    return (w.dtype == torch.bfloat16 and w.is_contiguous() and w.shape[2] == tile_cols()
            and w.shape[3] == 2)


def _in_features(w: torch.Tensor) -> int:
    return w.shape[1] * 2


def _out_features(w: torch.Tensor) -> int:
    return w.shape[0] * w.shape[2]


def _bf16_rows(v: torch.Tensor) -> bool:
    return v.dtype == torch.bfloat16 and v.is_contiguous() and v.dim() == 1


class CpuDecoderLayers(DecoderLayers):
    """The layer stack with each layer's step as one C call where it fits (module doc)."""

    def __init__(self, layers=None) -> None:
        super().__init__(layers)
        self.fused: list[PreparedLayer] | None = None  # bound by `prepare`, where all fit
        self.rope: tuple[torch.Tensor, torch.Tensor] | None = None
        self.all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.parts = (ATTENTION | MLP,)
        # the adapters' slots where every layer bound them (0: not all did), the widest R
        self.lora_slots = self.lora_width = 0

    def prepare(self) -> None:
        blocks = [layer.block() for layer in self]
        prepared = [bind(b) for b in blocks if b is not None]
        if not prepared or len(prepared) < len(self) or None in prepared:
            return
        self.fused, self.rope, self.all_reduce = prepared, blocks[0].rope, blocks[0].all_reduce
        self.parts = (ATTENTION | MLP,) if self.all_reduce is None else (ATTENTION, MLP)
        self.lora_slots = min(layer.lora_slots for layer in prepared)
        self.lora_width = max(layer.lora_width for layer in prepared)

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden] bf16: the embedding, updated in place
        positions: torch.Tensor,  # [T] int64
        kv_caches: Sequence[tuple[torch.Tensor, ...]],
        meta: AttentionMetadata,
        layer_hook: Callable[[int], None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # hidden, residual: for the final norm
        if (self.fused is None or not _plain_bf16(kv_caches)
                or not self._takes(meta.lora, hidden.shape[0])):
            return super().forward(hidden, positions, kv_caches, meta, layer_hook)
        num_blocks, block_size = kv_caches[0][0].shape[:2]
        step = DecoderStep(self.fused[0], hidden.contiguous(), positions, meta.slot_mapping,
                           token_block_tables(meta), self.rope, block_size,
                           num_blocks * block_size, meta.lora, self.lora_width)
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.fused, kv_caches)):
            if meta.kv_ready is not None:
                meta.kv_ready(i)
            for part in self.parts:
                decoder_layer_cpu(layer, step, k_cache, v_cache, part, first=i == 0)
                if self.all_reduce is not None:
                    self.all_reduce(step.hidden)
            if layer_hook is not None:
                layer_hook(i)
        return step.hidden, step.residual

    def _takes(self, lora: LoRAMapping | None, num_tokens: int) -> bool:
        """Whether the C layers run a step with these adapters (None: a base step, always):
        every layer's bound, the segments int32 on the CPU and the slots within the weights'
        (else the modules serve, and say what is wrong)."""
        if lora is None:
            return True
        starts, slots = lora.segment_starts, lora.segment_slots
        return (self.lora_slots > 0 and lora.token_slots.shape[0] == num_tokens
                and all(t.is_cpu and t.dtype == torch.int32 and t.is_contiguous()
                        for t in (starts, slots))
                and starts.shape[0] == slots.shape[0] + 1
                and (not lora.slots or lora.slots[-1] < self.lora_slots))


def _plain_bf16(kv_caches: Sequence[tuple[torch.Tensor, ...]]) -> bool:
    """Whether a step over these caches can run in C: plain (k, v) bf16 pairs."""
    return all(len(cache) == 2 and all(t.dtype == torch.bfloat16 and t.is_contiguous()
                                       for t in cache)
               for cache in kv_caches)


def token_block_tables(meta: AttentionMetadata) -> torch.Tensor:  # [T, max_blocks] int32
    """Each token's sequence's block table row: decodes first, then every prefill chunk's
    tokens (a query token at position p attends to its sequence's first p + 1 tokens)."""
    parts = []
    if meta.decode is not None:
        parts.append(meta.decode.block_tables)
    if meta.prefill is not None:
        p = meta.prefill
        parts.append(torch.repeat_interleave(p.block_tables, p.query_start_loc.diff().long(),
                                             dim=0))
    if len(parts) == 1:
        return parts[0]
    width = max(t.shape[1] for t in parts)
    return torch.cat([F.pad(t, (0, width - t.shape[1])) for t in parts])
