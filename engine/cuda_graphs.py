"""DecodeGraphs: decode steps replayed from CUDA graphs captured at start-up (vLLM's design).

Why: a decode step of a small batch launches a few hundred short kernels, and on a GPU their
launch cost (Python, the dispatcher, the driver) exceeds the work. A CUDA graph replays the
whole forward pass as one launch. A graph fixes its tensors' addresses and shapes, so:

- Sizes: graphs are captured for a set of batch sizes (`EngineConfig.capture_sizes`); a step
  of n sequences runs the graph of the smallest captured size >= n (`padded_batch_size`), its
  real rows first. A larger step, or one the graph does not describe (`graph_batch_size`:
  prefill chunks, speculative drafts, LoRA adapters, a context past the bound), runs eagerly.
- Static buffers: the graph reads its inputs (token ids, positions, slot mapping, block tables
  at full width ceil(max_model_len / block_size), context lengths) from tensors allocated once
  for the largest size; each replay copies the step's rows into their first rows.
- Padding rows are dummy rows: token 0 at position 0, its K/V stored in the dummy block (one
  block past the pool's, which the block pool never hands out), attending to that block alone
  (context length 1). They never touch a real block, and every backend takes them: the Triton
  and C stores skip a negative slot, but the torch reference's `index_copy_` takes none, so a
  real slot that nobody reads is what all three accept.
- The context bound: the decode kernels take `max_context_len` as a Python int; Triton's sizes
  its grid by it (the number of splits of the keys), which a graph bakes in. Every step that
  replays passes max_model_len, which holds every context (splits past a sequence's length read
  nothing and weigh nothing in the merge), so one capture serves every step. The cost: a short
  context gets the splits sized for the longest (fewer programs busy than an eager step would
  use), and the torch reference's attention, which gathers keys up to the bound, reads
  max_model_len keys per sequence (the torch backend is the oracle, not for serving).

The graph itself is a `StepGraph`: on CUDA a `torch.cuda.CUDAGraph` (`CudaStepGraph`, all of
them in one memory pool, captured largest first so the smaller reuse its blocks); elsewhere
(`emulated`) a no-op capture whose replay runs the same forward eagerly on the same static
buffers (`EagerStepGraph`). So the CPU runs the very path CUDA does but the capture: padding,
dummy rows, static buffers and replay bookkeeping are tested without a GPU.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from pdserve.engine.scheduler_output import SchedulerOutput
from pdserve.kernels.attention_metadata import AttentionMetadata, DecodeMetadata

logger = logging.getLogger(__name__)

WARMUP_RUNS = 2  # before each capture: kernels compiled, workspaces allocated outside the graph
KVCaches = Sequence[tuple[torch.Tensor, ...]]
Forward = Callable[[], torch.Tensor]  # the model over the static buffers: [size, hidden]


def padded_batch_size(num_seqs: int, sizes: Sequence[int]) -> int | None:
    """The smallest of `sizes` (ascending) that holds `num_seqs` rows; None past the largest
    (or for an empty batch)."""
    if num_seqs < 1:
        return None
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


def graph_batch_size(plan: SchedulerOutput, sizes: Sequence[int], max_context_len: int
                     ) -> int | None:
    """The captured size `plan` replays at, or None: it runs eagerly. A graph describes a
    decode-only step (every request one token, hence no drafts), without LoRA adapters (the
    captured linears add none), every context within the bound it was captured with."""
    reqs = plan.requests
    if plan.num_decodes != len(reqs) or any(e.lora is not None for e in reqs):
        return None
    if any(e.num_computed_tokens >= max_context_len for e in reqs):
        return None
    return padded_batch_size(len(reqs), sizes)


class StepGraph(Protocol):
    """One batch size's forward pass, captured once and replayed each step."""

    def capture(self, forward: Forward) -> None: ...

    def replay(self) -> torch.Tensor: ...  # [size, hidden]: valid until the next replay


class CudaStepGraph:
    """A `torch.cuda.CUDAGraph` in `pool` (shared by a runner's graphs). The capture is
    thread-local: the KV transfer's threads may use the device meanwhile."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.graph = torch.cuda.CUDAGraph()
        self.output: torch.Tensor | None = None

    def capture(self, forward: Forward) -> None:
        with torch.cuda.graph(self.graph, pool=self.pool, capture_error_mode="thread_local"):
            self.output = forward()

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.output


class EagerStepGraph:
    """Off CUDA: nothing to capture; each replay runs the forward eagerly, on the same static
    buffers a CUDA graph would read."""

    def __init__(self) -> None:
        self.forward: Forward | None = None

    def capture(self, forward: Forward) -> None:
        self.forward = forward

    def replay(self) -> torch.Tensor:
        return self.forward()


def step_graph_factory(mode: str) -> Callable[[], StepGraph]:
    """`mode` "cuda": CUDA graphs sharing one new memory pool; "emulated": eager stand-ins."""
    if mode == "emulated":
        return EagerStepGraph
    if mode != "cuda":
        raise ValueError(f"CUDA graph mode must be 'cuda' or 'emulated', got {mode!r}")
    pool = torch.cuda.graph_pool_handle()
    return lambda: CudaStepGraph(pool)


def capturable(tp_size: int, group: Any) -> bool:
    """Whether a real capture can hold this TP group's collectives: NCCL's run on the stream
    and are captured; gloo's copy through the host, which a graph cannot."""
    if tp_size == 1:
        return True
    name = getattr(group, "name", None)
    return callable(name) and name() == "nccl"


class DecodeGraphs:
    """A model's decode steps replayed at a set of padded batch sizes (see the module doc).

    `model(input_ids, positions, kv_caches, meta, layer_hook)` is the runner's network;
    `kv_caches` are its caches including the dummy block (`dummy_block`, past the pool's).
    `replays` counts the steps replayed at each size."""

    def __init__(
        self, model: Callable[..., torch.Tensor], kv_caches: KVCaches, sizes: Sequence[int], *,
        block_size: int, max_model_len: int, dummy_block: int, device: torch.device,
        make_graph: Callable[[], StepGraph],
    ) -> None:
        if not sizes or list(sizes) != sorted(set(sizes)) or sizes[0] < 1:
            raise ValueError(f"capture sizes must be ascending positive integers, got {sizes}")
        self.model, self.kv_caches, self.sizes = model, kv_caches, tuple(sizes)
        self.block_size, self.max_context_len = block_size, max_model_len
        self.dummy_block, self.make_graph = dummy_block, make_graph
        self.width = -(-max_model_len // block_size)  # blocks of the longest context
        top = self.sizes[-1]
        new = lambda *shape, dtype: torch.zeros(shape, dtype=dtype, device=device)  # noqa: E731
        self.input_ids = new(top, dtype=torch.int64)
        self.positions = new(top, dtype=torch.int64)
        self.slot_mapping = new(top, dtype=torch.int64)
        self.block_tables = new(top, self.width, dtype=torch.int32)
        self.context_lens = new(top, dtype=torch.int32)
        self._graphs: dict[int, StepGraph] = {}
        self.replays: Counter[int] = Counter()

    def batch_size(self, plan: SchedulerOutput) -> int | None:
        """The captured size `plan` replays at; None: it runs eagerly."""
        return graph_batch_size(plan, self.sizes, self.max_context_len)

    @torch.inference_mode()
    def capture(self) -> None:
        """At start-up, largest first (the smaller graphs reuse the pool the largest left),
        each after warm-up runs on dummy rows only (the dummy block is all they write)."""
        started = time.perf_counter()
        self._load(SchedulerOutput(()), self.sizes[-1])
        for size in reversed(self.sizes):
            forward = self._forward(size)
            for _ in range(WARMUP_RUNS):
                forward()
            graph = self.make_graph()
            try:
                graph.capture(forward)
            except RuntimeError as e:
                raise RuntimeError(f"capturing the decode graph of batch size {size} failed "
                                   f"({e}); serve with enforce_eager=True (--enforce-eager)"
                                   ) from e
            self._graphs[size] = graph
        logger.info("decode graphs (%s) for batch sizes %s captured in %.1f s",
                    type(self._graphs[self.sizes[0]]).__name__, list(self.sizes),
                    time.perf_counter() - started)

    def replay(self, plan: SchedulerOutput, size: int) -> torch.Tensor:
        """`plan`'s rows into the static buffers, padded to `size` (`batch_size(plan)`) with
        dummy rows; the graph replayed. Returns the hidden states of the real rows: [n, H], a
        view of the graph's output, valid until the next replay."""
        self._load(plan, size)
        hidden = self._graphs[size].replay()
        self.replays[size] += 1
        return hidden[: len(plan.requests)]

    def _forward(self, size: int) -> Forward:
        """The model over the first `size` rows of the static buffers; what is captured."""
        meta = AttentionMetadata(
            self.slot_mapping[:size], size,
            DecodeMetadata(self.block_tables[:size], self.context_lens[:size],
                           self.max_context_len),
            None,
        )
        input_ids, positions = self.input_ids[:size], self.positions[:size]
        return lambda: self.model(input_ids, positions, self.kv_caches, meta, None)

    def _load(self, plan: SchedulerOutput, size: int) -> None:
        """The static buffers' first `size` rows: `plan`'s requests, then dummy rows (token 0
        at position 0, every block the dummy one: their slot is the dummy block's first)."""
        reqs, bs = plan.requests, self.block_size
        assert len(reqs) <= size <= self.sizes[-1], (len(reqs), size)
        input_ids = np.zeros(size, np.int64)
        positions = np.zeros(size, np.int64)
        tables = np.full((size, self.width), self.dummy_block, np.int32)
        for i, e in enumerate(reqs):
            input_ids[i], positions[i] = e.token_ids[0], e.num_computed_tokens
            used = e.num_computed_tokens // bs + 1  # the blocks up to its new token's
            tables[i, :used] = e.block_ids[:used]
        slots = tables[np.arange(size), positions // bs].astype(np.int64) * bs + positions % bs
        for static, rows in ((self.input_ids, input_ids), (self.positions, positions),
                             (self.slot_mapping, slots), (self.block_tables, tables),
                             (self.context_lens, (positions + 1).astype(np.int32))):
            static[:size].copy_(torch.from_numpy(rows))
