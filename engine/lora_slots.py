"""LoRASlots: the LoRA adapters one worker holds, in host memory and in the slots a step runs.

Each adaptable linear (q/k/v, o, gate/up, down of every dense layer) gets a `LoRAStack`: its
adapters' A and B stacked over `max_loras` device slots, zero where a slot holds nothing (or an
adapter of smaller rank, or one that leaves the linear alone). A step's requests name their
adapters; `mapping` puts each into a slot (least recently used slot first out), and tells the
linears which slot each token uses (`kernels.lora_mapping`). Adapters read from disk are kept
in host memory, `max_cpu_loras` of them, least recently used dropped first.

One owner: this object alone writes the slots and the host cache. The scheduler keeps a step's
adapters within `max_loras`; every rank of a tensor-parallel group keeps its own slots, each
cut for its rank (`lora_shard`), from the same plans.
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict

import numpy as np
import torch

from pdserve.engine.config import LoRAConfig, ModelConfig
from pdserve.engine.lora_adapter import LoRAAdapter, load_adapter
from pdserve.engine.lora_request import LoRARequest
from pdserve.engine.models.parallel import ParallelLinear
from pdserve.engine.scheduler_output import SchedulerOutput
from pdserve.kernels.backend import KernelBackend
from pdserve.kernels.lora_mapping import LoRAMapping, LoRAWeights, lora_mapping

logger = logging.getLogger(__name__)

_ADAPTABLE = re.compile(r"layers\.(\d+)\.((?:self_attn|mlp)\.\w+_proj)")


class LoRAStack:
    """One linear's adapter slots (`weights`, `kernels.lora_mapping.LoRAWeights`), written
    slot by slot, cut for this rank."""

    def __init__(self, linear: ParallelLinear, config: LoRAConfig, ops: KernelBackend,
                 dtype: torch.dtype, device: torch.device):
        self.slices = linear.lora_slices  # name -> this rank's output rows
        self.shard = linear.lora_shard
        self.rank, self.ops = config.max_lora_rank, ops
        kw = {"dtype": dtype, "device": device}
        n, r = len(self.slices), self.rank
        self.weights = LoRAWeights(
            torch.zeros(config.max_loras, n * r, linear.in_features, **kw),
            torch.zeros(config.max_loras, linear.out_features, r, **kw),
            tuple(int(o) for o in np.cumsum([0, *self.slices.values()])))

    def set(self, slot: int, parts: dict[str, tuple[torch.Tensor, torch.Tensor]] | None
            ) -> None:
        """Slot `slot` holds `parts` (slice -> A, B: an adapter's, uncut), or nothing."""
        w = self.weights
        w.a[slot].zero_()
        w.b[slot].zero_()
        for i, name in enumerate(self.slices):
            if parts is None or name not in parts:
                continue
            a, b = self.shard(name, *parts[name])
            r, start = a.shape[0], i * self.rank
            w.a[slot, start:start + r].copy_(a)
            w.b[slot, w.slice_offsets[i]:w.slice_offsets[i + 1], :r].copy_(b)

    def __call__(self, y: torch.Tensor, x: torch.Tensor, mapping: LoRAMapping) -> None:
        w = self.weights
        self.ops.add_lora(y, x, w.a, w.b, mapping, w.slice_offsets)


class LoRASlots:
    """Adapters are told apart by their whole `LoRARequest` (name, id, path): one loaded anew
    under an old name is another adapter, and the old one leaves as the least recently used."""

    def __init__(self, model: torch.nn.Module, config: LoRAConfig, model_config: ModelConfig,
                 ops: KernelBackend, dtype: torch.dtype, device: torch.device):
        self.config, self.model_config, self.dtype = config, model_config, dtype
        self.device = device
        self.stacks: dict[tuple[int, str], LoRAStack] = {}
        for name, module in model.named_modules():
            m = _ADAPTABLE.fullmatch(name)
            if m and isinstance(module, ParallelLinear):
                module.lora = LoRAStack(module, config, ops, dtype, device)
                self.stacks[int(m[1]), m[2]] = module.lora
        self._host: OrderedDict[LoRARequest, LoRAAdapter] = OrderedDict()  # most recent last
        self._slots: OrderedDict[LoRARequest, int] = OrderedDict()  # likewise

    @property
    def loaded(self) -> tuple[str, ...]:
        """The names of the adapters held, in host memory or in a slot."""
        return tuple(sorted({lora.lora_name for lora in (*self._host, *self._slots)}))

    def add(self, lora: LoRARequest) -> LoRAAdapter:
        """The adapter in host memory, read (and checked) if it is not: ValueError naming
        what is wrong with it."""
        adapter = self._host.get(lora)
        if adapter is None:
            adapter = load_adapter(lora, self.model_config, self.config.max_lora_rank,
                                   self.dtype)
            logger.info("LoRA adapter %s (id %d) read from %s, rank %d", lora.lora_name,
                        lora.lora_int_id, lora.lora_path, adapter.rank)
        self._host[lora] = adapter
        self._host.move_to_end(lora)
        while len(self._host) > self.config.num_cpu_loras:
            dropped, _ = self._host.popitem(last=False)
            logger.debug("LoRA adapter %s (id %d) dropped from host memory", dropped.lora_name,
                         dropped.lora_int_id)
        return adapter

    def mapping(self, plan: SchedulerOutput) -> LoRAMapping | None:
        """The step's adapters in slots, and the slot of each of its tokens; None when no
        request of the step runs one."""
        loras = {e.lora for e in plan.requests if e.lora is not None}
        if not loras:
            return None
        assert len(loras) <= self.config.max_loras, "the scheduler keeps a step to max_loras"
        for lora in loras:
            self._activate(lora, loras)
        per_request = [self._slots[e.lora] if e.lora else -1 for e in plan.requests]
        counts = [e.num_tokens for e in plan.requests]
        return lora_mapping(np.repeat(np.array(per_request, np.int32), counts), self.device)

    def _activate(self, lora: LoRARequest, wanted: set[LoRARequest]) -> None:
        """`lora` in a slot: a free one, else the least recently used one's that the step
        does not want (that adapter stays in host memory)."""
        if lora in self._slots:
            self._slots.move_to_end(lora)
            return
        adapter = self.add(lora)
        used = set(self._slots.values())
        free = [s for s in range(self.config.max_loras) if s not in used]
        if free:
            slot = free[0]
        else:
            slot = self._slots.pop(next(held for held in self._slots if held not in wanted))
        for key, stack in self.stacks.items():
            stack.set(slot, adapter.weights.get(key))
        self._slots[lora] = slot
