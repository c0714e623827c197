"""Tensor-parallel building blocks: linears, embedding, LM head and MoE experts split over TP
ranks.

Weights load straight into their final (sharded, fused) layout through each parameter's
`load(tensor, shard)`, so the same checkpoint serves any TP size that divides the heads.
`prepare_weights` then hands every linear's loaded weight to the kernel backend, which returns
it in the layout its kernel reads (`KernelBackend.prepare_linears`); a linear runs as
`kernel(x, bias)` from then on. With `tp.size == 1` no collective runs.

With LoRA enabled, each adaptable linear also holds `lora`, its adapters' slots
(`engine.lora_slots.LoRAStack`), and adds their deltas for the tokens of a step that use one;
`lora_shard` cuts an adapter's A and B as the linear's own weight is cut.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from pdserve.kernels.backend import ExpertsKernel, KernelBackend, LinearKernel
from pdserve.kernels.decoder_layers import DecoderLayers
from pdserve.kernels.lora_mapping import LoRAMapping, LoRAWeights
from pdserve.kernels.quant_weights import QuantizedWeight, cat_rows, dequantize


class LinearLoRA(Protocol):
    """A linear's adapter slots (`engine.lora_slots.LoRAStack`)."""

    weights: LoRAWeights

    def __call__(self, y: torch.Tensor, x: torch.Tensor, mapping: LoRAMapping) -> None:
        """Add to y each token's adapter delta (in place)."""


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in its TP group; `group` is a torch ProcessGroup (None if size 1).

    The group is used through its own methods, so it needs no global default world: a
    decode group's ranks build it from a rendezvous store like any pairwise group.

    `group` is gloo and carries the CPU tensors (`broadcast`, `all_reduce_host`: rank 0's plan
    messages, admission votes); `device_group`, when set (NCCL on CUDA), carries the model's
    (`all_reduce`, `all_gather_last`: activations, logits), which gloo can't carry on CUDA.
    None: `group` carries everything (a CPU model).
    """

    rank: int = 0
    size: int = 1
    group: Any = None
    expert_parallel: bool = False  # MoE experts whole on each rank, not sliced (engine.models.moe)
    device_group: Any = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size or (self.size > 1 and self.group is None):
            raise ValueError(f"bad tensor-parallel placement: rank {self.rank} of {self.size}")

    def split(self, total: int, what: str) -> int:
        if total % self.size:
            raise ValueError(f"{what} ({total}) must be divisible by the TP size ({self.size})")
        return total // self.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum the model's tensor `x` over the ranks, in place."""
        if self.size > 1:
            (self.device_group or self.group).allreduce([x]).wait()
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' parts of the model's tensor `x` side by side (last dimension)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        (self.device_group or self.group).allgather([parts], [x.contiguous()]).wait()
        return torch.cat(parts, dim=-1)

    def all_reduce_host(self, x: torch.Tensor) -> torch.Tensor:
        """Sum a CPU tensor (admission votes) over the ranks, in place, on the gloo group."""
        if self.size > 1:
            self.group.allreduce([x]).wait()
        return x

    def broadcast(self, x: torch.Tensor, root: int = 0) -> torch.Tensor:
        """`root`'s CPU tensor (rank 0's plan messages) to every rank, on the gloo group."""
        if self.size > 1:
            self.group.broadcast(x, root).wait()
        return x


class ParallelLinear(torch.nn.Module):
    """What both tensor-parallel linears share: the loaded weight (dense `weight`, or
    `quantized` as a checkpoint quantized it) until `prepare_weights`, then only `kernel`."""

    def __init__(self, out_features: int, in_features: int, dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        kw = {"dtype": dtype, "device": device}
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, **kw), False)
        self.out_features, self.in_features = out_features, in_features  # this rank's
        self.dtype = dtype  # of activations: a quantized kernel's scales are cast to it
        self.quantized: QuantizedWeight | None = None
        self.kernel: LinearKernel | None = None  # see prepare_weights
        self.lora: LinearLoRA | None = None  # its adapters' slots, with LoRA enabled

    def _with_lora(self, y: torch.Tensor, x: torch.Tensor, lora: LoRAMapping | None
                   ) -> torch.Tensor:
        """y plus, for each token that runs an adapter, that adapter's delta."""
        if lora is not None and self.lora is not None:
            self.lora(y, x, lora)
        return y

    def loaded(self) -> torch.Tensor | QuantizedWeight:
        return self.quantized if self.quantized is not None else self.weight

    def set_kernel(self, kernel: LinearKernel) -> None:
        self.kernel, self.weight, self.quantized = kernel, None, None  # the kernel's copy only

    def _set_quantized(self, weight: QuantizedWeight) -> None:
        want = tuple(self.weight.shape)
        if weight.shape != want:
            raise ValueError(f"model: a quantized weight of shape {list(weight.shape)} for a "
                             f"linear of {list(want)}")
        self.quantized = weight.to(self.weight.device).contiguous()
        self.weight = None  # the dense placeholder is never filled


class ColumnParallelLinear(ParallelLinear):
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
        shard_rows = {name: tp.split(rows, name) for name, rows in shards.items()}
        offsets, offset = {}, 0
        for name, rows in shard_rows.items():
            offsets[name], offset = offset, offset + rows
        super().__init__(offset, in_features, dtype, device)
        self.tp, self.shard_rows, self.offsets = tp, shard_rows, offsets
        kw = {"dtype": dtype, "device": device}
        self.bias = torch.nn.Parameter(torch.empty(offset, **kw), False) if bias else None
        self._parts: dict[str, QuantizedWeight] = {}  # quantized shards until all arrive

    def load(self, name: str, tensor: torch.Tensor | QuantizedWeight, shard: str) -> None:
        rows = self.shard_rows[shard]
        if isinstance(tensor, QuantizedWeight):  # the weight, as a checkpoint quantized it
            self._parts[shard] = tensor.narrow(0, self.tp.rank * rows, rows)
            if len(self._parts) == len(self.shard_rows):
                self._set_quantized(cat_rows([self._parts.pop(n) for n in self.shard_rows]))
            return
        local = tensor.narrow(0, self.tp.rank * rows, rows)
        target = self.weight if name == "weight" else self.bias
        target.data.narrow(0, self.offsets[shard], rows).copy_(local)

    def loaded(self) -> torch.Tensor | QuantizedWeight:
        if self._parts:  # some shards came quantized, others dense: half a weight either way
            raise ValueError(f"model: the fused {'/'.join(self.shard_rows)} weight came partly "
                             f"quantized ({', '.join(self._parts)}) and partly dense")
        return super().loaded()

    @property
    def lora_slices(self) -> dict[str, int]:
        """The slices an adapter adapts one by one (q/k/v, gate/up), with this rank's rows."""
        return self.shard_rows

    def lora_shard(self, name: str, a: torch.Tensor, b: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """An adapter's A [r, in] and B [rows, r] of slice `name`, cut for this rank: B's
        rows as the weight's (A whole)."""
        rows = self.shard_rows[name]
        return a, b.narrow(0, self.tp.rank * rows, rows)

    def forward(self, x: torch.Tensor, lora: LoRAMapping | None = None) -> torch.Tensor:
        return self._with_lora(self.kernel(x, self.bias), x, lora)


class RowParallelLinear(ParallelLinear):
    """y = x W^T (+ b) with W's input columns split over ranks; partial sums all-reduced, the
    bias (whole on every rank) added once, after the sum."""

    def __init__(
        self, in_features: int, out_features: int, tp: TensorParallel,
        dtype: torch.dtype, device: torch.device, bias: bool = False,
    ):
        cols = tp.split(in_features, "in_features")
        super().__init__(out_features, cols, dtype, device)
        self.tp, self.cols = tp, cols
        self.bias = torch.nn.Parameter(torch.empty(out_features, dtype=dtype, device=device),
                                       False) if bias else None

    def load(self, name: str, tensor: torch.Tensor | QuantizedWeight, shard: str = "") -> None:
        if name == "bias":
            self.bias.data.copy_(tensor)
            return
        local = tensor.narrow(1, self.tp.rank * self.cols, self.cols)  # whole groups only
        if isinstance(local, QuantizedWeight):
            self._set_quantized(local)
        else:
            self.weight.data.copy_(local)

    @property
    def lora_slices(self) -> dict[str, int]:
        return {"": self.out_features}

    def lora_shard(self, name: str, a: torch.Tensor, b: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """An adapter's A [r, in] cut by columns as the weight is (B whole): each rank's
        partial delta B (A_rank x_rank) joins the all-reduce of its partial output."""
        return a.narrow(1, self.tp.rank * self.cols, self.cols), b

    def forward(self, x: torch.Tensor, lora: LoRAMapping | None = None) -> torch.Tensor:
        y = self.tp.all_reduce(self._with_lora(self.kernel(x), x, lora))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(torch.nn.Module):
    """Embedding rows split over ranks; also the (tied or untied) LM head, whose `head` kernel
    the backend prepares from the same rows (a packed copy, or the rows themselves)."""

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
        self.head: LinearKernel | None = None  # see prepare_weights

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
        local = self.head(hidden).float()
        return self.tp.all_gather_last(local)[:, : self.vocab_size]

    def loaded(self) -> torch.Tensor:
        return self.weight

    def set_kernel(self, kernel: LinearKernel) -> None:
        self.head = kernel  # the lookup keeps the plain rows


class FusedExperts(torch.nn.Module):
    """This rank's experts, stacked: loaded expert by expert (or whole, as transformers 5 keeps
    them in memory), then one `ExpertsKernel` of the backend. Experts quantized at load (int8 /
    int4, one `QuantizedWeight` per expert's gate, up and down) stay quantized: the kernel gets
    each expert's [gate | up] and down as `QuantizedWeight`s. `variant`: what a subclass adds
    to `prepare_experts` (gpt-oss's biases and activation)."""

    variant: dict = {}

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 tp: TensorParallel, dtype: torch.dtype, device: torch.device):
        super().__init__()
        if tp.expert_parallel:
            self.local_experts = tp.split(num_experts, "num_experts")
            self.expert_start = tp.rank * self.local_experts
            self.inter, self.inter_start = intermediate_size, 0
        else:
            self.local_experts, self.expert_start = num_experts, 0
            self.inter = tp.split(intermediate_size, "moe_intermediate_size")
            self.inter_start = tp.rank * self.inter
        e, i, kw = self.local_experts, self.inter, {"dtype": dtype, "device": device}
        self.w13 = torch.nn.Parameter(torch.empty(e, 2 * i, hidden_size, **kw), False)
        self.w2 = torch.nn.Parameter(torch.empty(e, hidden_size, i, **kw), False)
        self.intermediate_size = intermediate_size
        self.dtype = dtype
        self.kernel: ExpertsKernel | None = None  # see prepare_weights
        self._loaded: set[str] = set()
        self._quantized: dict[tuple[int, str], QuantizedWeight] = {}  # (local expert, part)

    def load(self, name: str, tensor: torch.Tensor | QuantizedWeight, shard: str) -> None:
        """`shard` is "<expert>.gate|up|down" for one expert's tensor, or "gate_up" / "down"
        for all experts stacked ([E, 2 I, H] / [E, H, I])."""
        expert, _, part = shard.rpartition(".")
        if isinstance(tensor, QuantizedWeight):  # one expert's part, quantized
            local = int(expert) - self.expert_start
            if 0 <= local < self.local_experts:
                i, start = self.inter, self.inter_start
                dim = 1 if part == "down" else 0
                weight = tensor.narrow(dim, start, i).to(self.w13.device).contiguous()
                self._quantized[local, part] = weight
                self._loaded.add(f"{local}.{part}")
            return
        if expert:
            local = int(expert) - self.expert_start
            if not 0 <= local < self.local_experts:
                return  # another rank's expert
            self._load_expert(local, part, tensor)
        else:
            stacked = tensor[self.expert_start:self.expert_start + self.local_experts]
            if part == "gate_up":
                gate, up = stacked.chunk(2, dim=1)
                for local in range(self.local_experts):
                    self._load_expert(local, "gate", gate[local])
                    self._load_expert(local, "up", up[local])
            else:
                for local in range(self.local_experts):
                    self._load_expert(local, "down", stacked[local])

    def _load_expert(self, local: int, part: str, tensor: torch.Tensor) -> None:
        i, start = self.inter, self.inter_start
        if part == "down":  # [H, I]: this rank's columns
            self.w2.data[local].copy_(tensor[:, start:start + i])
        else:  # [I, H]: this rank's rows, gate first
            rows = slice(0, i) if part == "gate" else slice(i, 2 * i)
            self.w13.data[local, rows].copy_(tensor[start:start + i])
        self._loaded.add(f"{local}.{part}")

    def prepare(self, ops: KernelBackend) -> None:
        """After loading: the backend's kernel over the stacked weights, which are let go."""
        missing = 3 * self.local_experts - len(self._loaded)
        if missing:
            raise ValueError(f"model: checkpoint lacks {missing} expert tensors")
        if self._quantized:
            if len(self._quantized) != 3 * self.local_experts:
                raise ValueError("model: a MoE layer's experts are partly quantized")
            q, experts = self._quantized, range(self.local_experts)
            w13 = [cat_rows([q[e, "gate"], q[e, "up"]]) for e in experts]
            self.kernel = ops.prepare_experts(w13, [q[e, "down"] for e in experts], self.dtype,
                                              **self.variant)
            self._quantized = {}
        else:
            self.kernel = ops.prepare_experts(self.w13.data, self.w2.data, self.dtype,
                                              **self.variant)
        self.w13 = self.w2 = None

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
                ) -> torch.Tensor:
        return self.kernel(x, topk_weights, topk_ids, expert_start=self.expert_start)


def prepare_weights(model: torch.nn.Module, ops: KernelBackend, dtype: torch.dtype) -> None:
    """After loading: every linear's weight (and the LM head's) in `ops`' serving form, each
    loaded weight let go as its kernel is made; then every layer stack bound to them."""
    modules = [m for m in model.modules()
               if isinstance(m, (ParallelLinear, VocabParallelEmbedding))]
    kernels = ops.prepare_linears((m.loaded() for m in modules), dtype)
    for module, kernel in zip(modules, kernels, strict=True):
        module.set_kernel(kernel)
    for module in model.modules():
        if isinstance(module, FusedExperts):
            module.prepare(ops)
    for module in model.modules():
        if isinstance(module, DecoderLayers):
            module.prepare()


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's weights as held: parameters, buffers (weights derived at load) and
    every prepared kernel's tensors
    (quantized linears at their packed size, the LM head's packed copy of a tied embedding),
    each tensor once."""
    tensors = [*model.parameters(), *model.buffers()]
    for m in model.modules():
        if isinstance(m, FusedExperts) and m.kernel is not None:
            tensors += m.kernel.tensors
        if isinstance(m, ParallelLinear) and m.kernel is not None:
            tensors += m.kernel.tensors
        elif isinstance(m, VocabParallelEmbedding) and m.head is not None:
            tensors += m.head.tensors
    unique = {id(t): t for t in tensors}
    return sum(t.numel() * t.element_size() for t in unique.values())
