"""Which LoRA adapter each token of a step uses, and a linear's adapter weights: the arguments
of the LoRA ops.

A step's tokens are one flat batch; the requests with an adapter each name a slot of the
stacked adapter weights (`engine.lora_slots`), the others none (-1). The runs of tokens that
share a slot are the segments a grouped kernel works on (Punica's SGMV): a prefill chunk is
one run, consecutive decodes of one adapter another.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class LoRAMapping:
    token_slots: torch.Tensor  # [num_tokens] int32: each token's slot, -1 for none
    segment_starts: torch.Tensor  # [num_segments + 1] int32: runs of one slot, covering all
    segment_slots: torch.Tensor  # [num_segments] int32: each run's slot (-1: adds nothing)
    max_segment_len: int
    slots: tuple[int, ...]  # the distinct slots used (>= 0), ascending


@dataclass(frozen=True)
class LoRAWeights:
    """One linear's adapters, stacked over the slots (zero where a slot holds nothing): each
    of its n slices (q/k/v, gate/up; a plain linear is one) has its own A rows and B rows."""

    a: torch.Tensor  # [slots, n * max_rank, in]: slice i's A at rows i * max_rank
    b: torch.Tensor  # [slots, out, max_rank]: slice i's B at rows slice_offsets[i]:[i + 1]
    slice_offsets: tuple[int, ...]  # 0 = o_0 < ... < o_n = out


def lora_mapping(token_slots: np.ndarray, device: torch.device) -> LoRAMapping | None:
    """The mapping of a step whose tokens use `token_slots` ([T] ints, -1 none); None when no
    token uses an adapter (the step runs the base model alone)."""
    slots = np.asarray(token_slots, dtype=np.int32)
    if not len(slots) or (slots < 0).all():
        return None
    change = np.flatnonzero(slots[1:] != slots[:-1]) + 1
    starts = np.concatenate(([0], change, [len(slots)])).astype(np.int32)
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
    return LoRAMapping(
        t(slots), t(starts), t(slots[starts[:-1]]), int(np.diff(starts).max()),
        tuple(int(s) for s in np.unique(slots[slots >= 0])),
    )
