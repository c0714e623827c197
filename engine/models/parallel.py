"""Tensor-parallel building blocks: linears, embedding and LM head split over TP ranks.

Weights load straight into their final (sharded, fused) layout through each parameter's
`load(tensor, shard)`, so the same checkpoint serves any TP size that divides the heads.
With `tp.size == 1` no collective runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from pdserve.kernels import huge_pages, packed_linear, quant_linear_cpu
from pdserve.kernels.quant_linear import quant_linear, quant_linear_ref
from pdserve.kernels.quant_weights import QuantizedWeight, cat_rows, dequantize


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in its TP group; `group` is a torch ProcessGroup (None if size 1).

    The group is used through its own methods, so it needs no global default world: a
    decode group's ranks build it from a rendezvous store like any pairwise group.
    """

    rank: int = 0
    size: int = 1
    group: Any = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size or (self.size > 1 and self.group is None):
            raise ValueError(f"bad tensor-parallel placement: rank {self.rank} of {self.size}")

    def split(self, total: int, what: str) -> int:
        if total % self.size:
            raise ValueError(f"{what} ({total}) must be divisible by the TP size ({self.size})")
        return total // self.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            self.group.allreduce([x]).wait()
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.group.allgather([parts], [x.contiguous()]).wait()
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor, root: int = 0) -> torch.Tensor:
        if self.size > 1:
            self.group.broadcast(x, root).wait()
        return x


class ColumnParallelLinear(torch.nn.Module):
    """y = x W^T + b with W's output rows split over ranks; fused sub-matrices by `shards`.

    `shards` lists the (name, full rows) stacked in the fused weight, e.g. q/k/v or gate/up;
    each rank holds its slice of each, stacked in the same order.
    """

    def __init__(
        self,
        in_features: int,
        shards: dict[str, int],
        bias: bool,
        tp: TensorParallel,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        self.tp = tp
        self.shard_rows = {name: tp.split(rows, name) for name, rows in shards.items()}
        self.offsets, offset = {}, 0
        for name, rows in self.shard_rows.items():
            self.offsets[name], offset = offset, offset + rows
        kw = {"dtype": dtype, "device": device}
        self.weight = torch.nn.Parameter(torch.empty(offset, in_features, **kw), False)
        self.bias = torch.nn.Parameter(torch.empty(offset, **kw), False) if bias else None
        self.dtype = dtype  # of activations: the quantized kernels' scales are cast to it
        self.quantized: QuantizedWeight | quant_linear_cpu.PreparedWeight | None = None
        self._parts: dict[str, QuantizedWeight] = {}  # quantized shards until all arrive

    def load(self, name: str, tensor: torch.Tensor | QuantizedWeight, shard: str) -> None:
        rows = self.shard_rows[shard]
        if isinstance(tensor, QuantizedWeight):  # the weight, as a checkpoint quantized it
            self._parts[shard] = tensor.narrow(0, self.tp.rank * rows, rows)
            if len(self._parts) == len(self.shard_rows):
                _set_quantized(self, cat_rows([self._parts.pop(n) for n in self.shard_rows]))
            return
        local = tensor.narrow(0, self.tp.rank * rows, rows)
        target = self.weight if name == "weight" else self.bias
        target.data.narrow(0, self.offsets[shard], rows).copy_(local)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            return _quant_linear(x, self.quantized, self.bias)
        return packed_linear.linear(x, self.weight, self.bias)

    def prepare_weights(self, pack: bool, memory: huge_pages.Arena | None = None) -> None:
        _prepare(self, pack, memory)


class RowParallelLinear(torch.nn.Module):
    """y = x W^T with W's input columns split over ranks; partial sums all-reduced."""

    def __init__(
        self, in_features: int, out_features: int, tp: TensorParallel,
        dtype: torch.dtype, device: torch.device,
    ):
        super().__init__()
        self.tp = tp
        self.cols = tp.split(in_features, "in_features")
        kw = {"dtype": dtype, "device": device}
        self.weight = torch.nn.Parameter(torch.empty(out_features, self.cols, **kw), False)
        self.dtype = dtype
        self.quantized: QuantizedWeight | quant_linear_cpu.PreparedWeight | None = None

    def load(self, name: str, tensor: torch.Tensor | QuantizedWeight, shard: str = "") -> None:
        local = tensor.narrow(1, self.tp.rank * self.cols, self.cols)  # whole groups only
        if isinstance(local, QuantizedWeight):
            _set_quantized(self, local)
        else:
            self.weight.data.copy_(local)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            return self.tp.all_reduce(_quant_linear(x, self.quantized))
        return self.tp.all_reduce(packed_linear.linear(x, self.weight))

    def prepare_weights(self, pack: bool, memory: huge_pages.Arena | None = None) -> None:
        _prepare(self, pack, memory)


class VocabParallelEmbedding(torch.nn.Module):
    """Embedding rows split over ranks; also the (tied or untied) LM head."""

    def __init__(
        self, vocab_size: int, hidden_size: int, tp: TensorParallel,
        dtype: torch.dtype, device: torch.device,
    ):
        super().__init__()
        self.tp = tp
        self.rows = -(-vocab_size // tp.size)
        self.start = tp.rank * self.rows
        self.vocab_size = vocab_size
        kw = {"dtype": dtype, "device": device}
        self.weight = torch.nn.Parameter(torch.zeros(self.rows, hidden_size, **kw), False)
        self.packed_head: torch.Tensor | None = None

    def load(self, name: str, tensor: torch.Tensor | QuantizedWeight, shard: str = "") -> None:
        if isinstance(tensor, QuantizedWeight):  # kept dense in the serving dtype
            tensor = dequantize(tensor)
        local = tensor[self.start : self.start + self.rows]
        self.weight.data[: local.shape[0]].copy_(local)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill(outside[:, None], 0))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab] fp32
        local = packed_linear.linear(hidden, self.head_weight).float()
        return self.tp.all_gather_last(local)[:, : self.vocab_size]

    @property
    def head_weight(self) -> torch.Tensor:
        return self.packed_head if self.packed_head is not None else self.weight

    def prepare_weights(self, pack: bool, memory: huge_pages.Arena | None = None) -> None:
        """A packed copy for the LM head (the lookup keeps the plain rows); never quantized."""
        if pack and packed_linear.can_pack(self.weight):
            self.packed_head = packed_linear.pack(self.weight, memory)


Linear = ColumnParallelLinear | RowParallelLinear


def _set_quantized(layer: Linear, weight: QuantizedWeight) -> None:
    want = tuple(layer.weight.shape)
    if weight.shape != want:
        raise ValueError(f"model: a quantized weight of shape {list(weight.shape)} for a "
                         f"linear of {list(want)}")
    layer.quantized = weight.to(layer.weight.device).contiguous()
    layer.weight = None  # the dense placeholder is never filled


def _prepare(layer: Linear, pack: bool, memory: huge_pages.Arena | None) -> None:
    """After loading, on the CPU backend (`pack`): the weight in the form its kernel reads
    (torch's int4/int8 ops' packing of a quantized weight, `packed_linear.pack` for a dense
    bf16 one, into `memory`)."""
    if not pack:
        return
    if isinstance(layer.quantized, QuantizedWeight):
        layer.quantized = quant_linear_cpu.prepare(layer.quantized, layer.dtype)
    elif layer.quantized is None and packed_linear.can_pack(layer.weight):
        layer.weight = torch.nn.Parameter(packed_linear.pack(layer.weight.data, memory), False)


def _quant_linear(x: torch.Tensor, weight: QuantizedWeight | quant_linear_cpu.PreparedWeight,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(weight, quant_linear_cpu.PreparedWeight):
        return quant_linear_cpu.linear(x, weight, bias)
    if x.device.type == "cpu":  # the torch backend: references only
        return quant_linear_ref(x, weight, bias)
    return quant_linear(x, weight, bias)  # Triton


def prepare_weights(model: torch.nn.Module, pack: bool) -> None:
    """Every linear of `model` in its serving form, after the weights are loaded (`pack`:
    the CPU backend's layouts, see `_prepare`; the blocked bf16 ones all in one mapping of huge
    pages, which every decode step streams through)."""
    modules = [m for m in model.modules()
               if isinstance(m, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding))]
    memory = None
    if pack:
        memory = huge_pages.Arena(packed_linear.blocked_bytes(m.weight) for m in modules)
    for module in modules:
        module.prepare_weights(pack, memory)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's weights as held (quantized linears at their packed size, and the
    LM head's packed copy of a tied embedding)."""
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    for m in model.modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and m.quantized is not None:
            held += m.quantized.nbytes
        if isinstance(m, VocabParallelEmbedding) and m.packed_head is not None:
            held += m.packed_head.numel() * m.packed_head.element_size()  # the head's copy
    return held
