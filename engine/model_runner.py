"""ModelRunner: turns a SchedulerOutput into tensors, runs the network, samples.

It owns the model, the KV cache tensors, the per-request sampling generators, the LoRA
adapters' slots (`engine.lora_slots`) and the decode graphs (`engine.cuda_graphs`); it keeps
no other state between steps (the plan carries tokens, positions and block tables). With a KV
connector it brackets each forward pass with the connector's worker side: the layers are saved
as they are computed, and the step returns only once every save is done.

With CUDA graphs (`EngineConfig.cuda_graph_mode`) the cache holds one block more than the pool
hands out, the graphs' dummy block; `kv_caches` are views of the pool's blocks alone, what the
connector and everything else see. A step that replays a graph runs its layers as one launch,
so a connector's `save_kv_layer` is called for every layer once the replay is queued.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.cuda_graphs import (
    DecodeGraphs,
    capturable,
    step_graph_factory,
)
from pdserve.engine.kv_connector import KVConnector
from pdserve.engine.kv_layer_loads import LayerLoads
from pdserve.engine.kv_offload import KVOffload
from pdserve.engine.loader import load_weights
from pdserve.engine.logits_processors import LogitsRow, apply_logits_processors
from pdserve.engine.lora_slots import LoRASlots
from pdserve.engine.models import model_class
from pdserve.engine.models.parallel import TensorParallel, prepare_weights, weight_bytes
from pdserve.engine.prompt_logprobs import compute_prompt_logprobs
from pdserve.engine.sampler import (
    MIN_TEMPERATURE,
    Sampler,
    SamplerOutput,
    SamplingBatch,
    make_generator,
)
from pdserve.engine.scheduler_output import (
    RunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
    TokenLogprobs,
)
from pdserve.engine.spec.verify import Group, verify
from pdserve.engine.structured_output import allocate_bitmask
from pdserve.kernels.attention_metadata import AttentionMetadata, DecodeMetadata, PrefillMetadata
from pdserve.kernels.backend import get_backend
from pdserve.kernels.kv_quant import allocate_kv_cache

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self, config: EngineConfig, tp: TensorParallel | None = None,
        connector: KVConnector | None = None,
    ) -> None:
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.tp = tp or TensorParallel()
        self.device = torch.device(config.device)
        self.dtype = getattr(torch, config.model.dtype)
        self.block_size = config.cache.block_size
        self.ops = get_backend(self.device, config.kernel_backend)
        cfg = config.model
        self.model = model_class(cfg.architecture)(cfg, self.tp, self.ops, self.dtype, self.device)
        load_weights(self.model, cfg.path, cfg.quantization)
        # the linears' adapter slots, before the layers are bound to their weights
        self.loras = None if config.lora is None else LoRASlots(
            self.model, config.lora, cfg, self.ops, self.dtype, self.device)
        prepare_weights(self.model, self.ops, self.dtype)  # each linear in the backend's form
        self.weight_bytes = weight_bytes(self.model)
        self.model.eval()
        self.graphs: DecodeGraphs | None = None
        graph_mode = self._graph_mode()
        caches = self._allocate_kv_caches(extra_blocks=1 if graph_mode else 0)
        num_blocks = config.cache.num_blocks
        self.kv_caches = caches if not graph_mode else [  # the pool's blocks: no dummy block
            tuple(t[:num_blocks] for t in layer) for layer in caches]
        self.sampler = Sampler(seed=config.seed)
        self._generators: dict[str, torch.Generator] = {}
        self.connector = connector
        if connector is not None:
            connector.register_kv_caches(self.kv_caches)
        self.offload = self._make_offload()
        if graph_mode:
            self.graphs = self._capture_graphs(graph_mode, caches)
        logger.info(
            "model %s (%s, quantization %s, weights %.1f MB) on %s, kernels=%s, threads=%d",
            cfg.architecture, cfg.dtype, cfg.quantization.method if cfg.quantization else None,
            self.weight_bytes / 1e6, self.device, self.ops.name, torch.get_num_threads(),
        )

    def _make_offload(self) -> KVOffload | None:
        """The KV tiers' copier (engine.kv_offload), when the cache has tiers."""
        cache, model = self.config.cache, self.config.model
        if not cache.tiered:
            return None
        layout = {"model": str(model.path), "architecture": model.architecture,
                  "dtype": model.dtype, "cache_dtype": cache.cache_dtype,
                  "quantization": model.quantization.method if model.quantization else None,
                  "block_size": self.block_size, "shapes": [
                      [str(t.dtype), *t.shape[1:]] for t in self.kv_caches[0]],
                  "num_layers": len(self.kv_caches), "tp": [self.tp.rank, self.tp.size]}
        return KVOffload(self.kv_caches, cache.kv_host_bytes, cache.kv_disk_path,
                         cache.kv_disk_bytes, layout,
                         self.tp.all_reduce_host if self.tp.size > 1 else None)

    def _graph_mode(self) -> str | None:
        """The config's CUDA graph mode, but eager where a capture could not hold the TP
        group's collectives (gloo's)."""
        mode = self.config.cuda_graph_mode
        group = self.tp.device_group or self.tp.group  # what carries device tensors
        if mode == "cuda" and not capturable(self.tp.size, group):
            logger.warning("CUDA graphs off: the TP group's collectives (%s) cannot be "
                           "captured; decode steps run eagerly", group)
            return None
        return mode

    def _capture_graphs(self, mode: str, caches: list[tuple[torch.Tensor, ...]]
                        ) -> DecodeGraphs:
        """The decode graphs over `caches` (the pool's blocks and the dummy one after them),
        captured now: at start-up, before any request."""
        num_blocks = self.config.cache.num_blocks
        graphs = DecodeGraphs(
            self.model, caches, self.config.capture_sizes, block_size=self.block_size,
            max_model_len=self.config.model.max_model_len, dummy_block=num_blocks,
            device=self.device, make_graph=step_graph_factory(mode))
        graphs.capture()
        return graphs

    def _allocate_kv_caches(self, extra_blocks: int = 0) -> list[tuple[torch.Tensor, ...]]:
        """Per layer (k, v), or (k, v, k_scale, v_scale) for an int8 cache, or (latent,) for
        latent attention; zero-filled. `extra_blocks` past the pool's (the decode graphs' dummy
        block)."""
        cfg, cache = self.config.model, self.config.cache
        assert cache.num_blocks is not None, "size the cache with config.with_num_blocks first"
        num_blocks = cache.num_blocks + extra_blocks
        if cfg.latent_dim:  # one entry per token, whole on every TP rank
            return [(torch.zeros(num_blocks, self.block_size, cfg.latent_dim, dtype=self.dtype,
                                 device=self.device),) for _ in range(cfg.num_layers)]
        num_kv_heads = self.tp.split(cfg.num_kv_heads, "num_key_value_heads")
        dtype = torch.int8 if cache.cache_dtype == "int8" else self.dtype
        return [
            allocate_kv_cache(num_blocks, self.block_size, num_kv_heads,
                              cfg.head_dim, dtype, self.device)
            for _ in range(cfg.num_layers)
        ]

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        """Run one step; with a connector, each layer is saved as soon as its K/V are stored.
        With KV tiers, the plan's loads land layer by layer beside the forward (each layer
        waits for its own) and its other copies run beside it; the result reports the copies
        finished by then (all, if it computed nothing)."""
        for request_id in plan.finished_request_ids:
            self._generators.pop(request_id, None)
        if self.offload is None:
            return self._execute(plan, None)
        loads = self.offload.start(plan.kv_tiers)
        try:
            result = self._execute(plan, loads)
        finally:  # however the step ended, its loads no longer write its blocks after it
            if loads is not None:
                loads.settle()
        return replace(result, kv_tiers=self.offload.results(wait=not plan.requests))

    def _execute(self, plan: SchedulerOutput, loads: LayerLoads | None) -> RunnerOutput:
        if not plan.requests:
            return RunnerOutput({}, {})
        if self.connector is None:
            return self._forward(plan, None, loads)
        self.connector.start_save(plan)
        try:
            result = self._forward(plan, self.connector.save_kv_layer, loads)
        except BaseException:
            self.connector.abort_save()
            raise
        return replace(result, kv_saves=self.connector.wait_for_save())

    def _forward(
        self, plan: SchedulerOutput, layer_hook: Callable[[int], None] | None,
        loads: LayerLoads | None,
    ) -> RunnerOutput:
        """`layer_hook(i)` is called as soon as layer i's K/V are stored (after a graph's
        replay, for every layer at once); layer i waits for its `loads` first (a graph's
        replay, for all of them)."""
        size = self.graphs.batch_size(plan) if self.graphs is not None else None
        if size is None:
            input_ids, positions, meta, sample_rows = self._prepare(plan)
            if loads is not None:
                meta = replace(meta, kv_ready=loads.wait)
            hidden = self.model(input_ids, positions, self.kv_caches, meta, layer_hook)  # [T, H]
        else:
            if loads is not None:
                loads.wait_all()
            hidden = self.graphs.replay(plan, size)  # [num_decodes, H]
            if layer_hook is not None:  # the replay stored every layer's K/V
                for layer in range(self.config.model.num_layers):
                    layer_hook(layer)
            sample_rows = _sample_rows(plan, np.arange(1, len(plan.requests) + 1), self.device)
        prompt = compute_prompt_logprobs(self.model.compute_logits, hidden, plan.requests)
        result = self._sample(plan, hidden, sample_rows)
        return replace(result, prompt_logprobs=prompt) if prompt and self.tp.rank == 0 else result

    def _sample(
        self, plan: SchedulerOutput, hidden: torch.Tensor, sample_rows: torch.Tensor
    ) -> RunnerOutput:
        sampling = [e for e in plan.requests if e.sampling_params is not None]
        if not sampling:
            return RunnerOutput({}, {})
        logits = self.model.compute_logits(hidden[sample_rows])  # [num_sampling, vocab]
        if self.tp.rank != 0:  # followers took part in the gather; rank 0 samples
            return RunnerOutput({}, {})
        processed = self._process_logits(sampling, logits)
        if any(e.num_spec_tokens for e in sampling):
            return self._verify(sampling, processed, logits)
        batch = SamplingBatch.from_params(
            [e.sampling_params for e in sampling],
            [self._generator(e) for e in sampling],
            self.config.model.vocab_size,
            self.device,
        )
        out = self.sampler(processed, batch, raw=logits)
        return _runner_output(sampling, [[t] for t in out.token_ids.tolist()], out)

    def _process_logits(
        self, sampling: list[ScheduledRequest], logits: torch.Tensor
    ) -> torch.Tensor:
        """The logits to draw from: each request's grammar mask, then its logits processors
        (a copy; `logits` stays raw for logprobs). A request's rows are its position before
        the drafts and one per draft, each seeing the drafts ahead of it as generated."""
        if all(e.request is None for e in sampling):
            return logits
        x = logits.float().clone()
        rows: list[LogitsRow | None] = []
        bitmask = None
        for e in sampling:
            request, first = e.request, len(rows)
            if request is None:
                rows += [None] * (e.num_spec_tokens + 1)
                continue
            drafts = e.token_ids[e.num_tokens - e.num_spec_tokens:]
            tokens = request.all_token_ids
            stops = (*(() if e.sampling_params.ignore_eos else request.eos_token_ids),
                     *e.sampling_params.stop_token_ids)
            rows += [LogitsRow(e.sampling_params, tokens + list(drafts[:j]),
                               request.num_sampled_tokens + j,
                               len(request.output_token_ids) + j, stops)
                     for j in range(len(drafts) + 1)]
            if request.grammar is not None:
                if bitmask is None:  # all allowed; on the CPU, where xgrammar fills it
                    bitmask = allocate_bitmask(len(logits), x.shape[1])
                request.grammar.fill_draft_bitmasks(bitmask, first, drafts)
        if bitmask is not None:
            self.ops.apply_token_bitmask(x, bitmask)
        apply_logits_processors(x, rows)
        if bitmask is not None:  # the grammar wins where bad words or min_tokens left nothing
            dead = torch.isneginf(x).all(dim=1).nonzero().flatten()
            if len(dead):
                restored = logits[dead].float()
                self.ops.apply_token_bitmask(restored, bitmask[dead.cpu()])
                x[dead] = restored
        return x

    def _verify(self, sampling: list[ScheduledRequest], logits: torch.Tensor,
                raw: torch.Tensor) -> RunnerOutput:
        """A step with drafts: each request's logits rows (one per draft and one before)
        decide how many of its drafts hold (engine.spec.verify)."""
        params, groups = [], []
        for e in sampling:
            p = e.sampling_params
            seeded = p.seed is not None and p.temperature >= MIN_TEMPERATURE
            drafts = e.token_ids[e.num_tokens - e.num_spec_tokens:]
            groups.append(Group(len(params), drafts, self._generator(e) if seeded else None))
            params += [p] * (e.num_spec_tokens + 1)
        batch = SamplingBatch.from_params(
            params, [None] * len(params), self.config.model.vocab_size, self.device
        )
        emitted, out = verify(self.sampler, logits, batch, groups, raw)
        return _runner_output(sampling, emitted, out)

    def _generator(self, entry: ScheduledRequest) -> torch.Generator | None:
        if entry.request_id not in self._generators:
            seed = entry.sampling_params.seed
            self._generators[entry.request_id] = make_generator(
                seed, self.device, entry.num_output_tokens, self.config.model.vocab_size
            )
        return self._generators[entry.request_id]

    def _prepare(self, plan: SchedulerOutput):
        """Flat tokens, positions, slots, per-part block tables; all built with numpy."""
        reqs = plan.requests
        bs = self.block_size
        num_new = np.fromiter((e.num_tokens for e in reqs), np.int64, len(reqs))
        starts = np.fromiter((e.num_computed_tokens for e in reqs), np.int64, len(reqs))
        ends = np.cumsum(num_new)
        total = int(ends[-1])
        token_ids = np.fromiter((t for e in reqs for t in e.token_ids), np.int64, total)
        offsets = np.arange(total) - np.repeat(ends - num_new, num_new)
        positions = np.repeat(starts, num_new) + offsets
        max_blocks = max(len(e.block_ids) for e in reqs)
        tables = np.zeros((len(reqs), max_blocks), np.int32)
        for i, e in enumerate(reqs):
            tables[i, : len(e.block_ids)] = e.block_ids
        seq_of_token = np.repeat(np.arange(len(reqs)), num_new)
        slots = tables[seq_of_token, positions // bs].astype(np.int64) * bs + positions % bs
        context_lens = (starts + num_new).astype(np.int32)

        num_decodes = plan.num_decodes
        t = lambda a: torch.from_numpy(a).to(self.device)  # noqa: E731
        decode = prefill = None
        if num_decodes:
            ctx = context_lens[:num_decodes]
            decode = DecodeMetadata(t(tables[:num_decodes]), t(ctx), int(ctx.max()))
        if num_decodes < len(reqs):
            q_lens = num_new[num_decodes:]
            ctx = context_lens[num_decodes:]
            qsl = np.concatenate(([0], np.cumsum(q_lens))).astype(np.int32)
            prefill = PrefillMetadata(
                t(tables[num_decodes:]), t(qsl), t(ctx), int(q_lens.max()), int(ctx.max())
            )
        lora = self.loras.mapping(plan) if self.loras is not None else None
        meta = AttentionMetadata(t(slots), num_decodes, decode, prefill, lora)
        return t(token_ids), t(positions), meta, _sample_rows(plan, ends, self.device)


def _sample_rows(plan: SchedulerOutput, ends: np.ndarray, device: torch.device) -> torch.Tensor:
    """The rows of the step's hidden states to sample from: each sampling request's last
    token's, and with drafts every draft's and the one before. `ends`: each request's end."""
    rows = [
        row for i, e in enumerate(plan.requests) if e.sampling_params
        for row in range(int(ends[i]) - 1 - e.num_spec_tokens, int(ends[i]))
    ]
    return torch.tensor(rows, device=device)


def _runner_output(
    sampling: list[ScheduledRequest], emitted: list[list[int]], out: SamplerOutput
) -> RunnerOutput:
    """Each request's tokens, and their logprobs when asked; `out` has one row per token."""
    sampled = {e.request_id: tuple(tokens) for e, tokens in zip(sampling, emitted)}
    logprobs: dict[str, tuple[TokenLogprobs, ...]] = {}
    if out.logprobs is None:
        return RunnerOutput(sampled, logprobs)
    chosen = out.logprobs.tolist()
    top_ids = out.top_logprob_ids.tolist() if out.top_logprob_ids is not None else None
    top_vals = out.top_logprobs.tolist() if out.top_logprobs is not None else None
    row = 0
    for e, tokens in zip(sampling, emitted):
        n = e.sampling_params.logprobs
        if n is not None:
            logprobs[e.request_id] = tuple(
                TokenLogprobs(
                    token, chosen[r],
                    tuple(zip(top_ids[r][:n], top_vals[r][:n])) if n and top_ids else (),
                )
                for r, token in enumerate(tokens, row)
            )
        row += len(tokens)
    return RunnerOutput(sampled, logprobs)
