"""EngineCore: scheduler + model runner over token ids. The step is three lines."""

from __future__ import annotations

import logging
import time
from typing import Any

from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.kv_connector import KVConnector
from pdserve.engine.lora_request import LoRARequest
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.models.parallel import TensorParallel
from pdserve.engine.plan_broadcast import publish, publish_plan
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.scheduler_output import EngineCoreOutput, RunnerOutput, SchedulerOutput
from pdserve.engine.spec.make import make_speculator, sized
from pdserve.engine.structured_output import GrammarCompiler, GrammarState
from pdserve.engine.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


class EngineCore:
    """On a tensor-parallel group this runs on rank 0; the others run `follow_plans`.

    `connector` (engine.kv_connector) moves KV to or from other workers: the scheduler asks
    it about reserved requests, the runner has it push each layer as it is computed.
    """

    def __init__(
        self, config: EngineConfig, tp: TensorParallel | None = None,
        connector: KVConnector | None = None, tokenizer: Any | None = None,
    ) -> None:
        """`tokenizer`: the one structured outputs compile against (default: the one beside
        the weights, loaded by the first request that has a grammar)."""
        self.tp = tp or TensorParallel()
        self.config = sized(config)
        cache = self.config.cache
        self.runner = ModelRunner(self.config, self.tp, connector)
        offload = self.runner.offload
        self.kv_cache = KVCacheManager(
            cache.num_blocks, cache.block_size, cache.enable_prefix_caching,
            offload.num_host_slots if offload else 0, offload.num_disk_blocks if offload else 0,
        )
        if offload is not None and offload.disk is not None:  # what an earlier run left there
            self.kv_cache.tiers.adopt_disk(offload.disk.scan())
        self.connector = connector
        self.scheduler = Scheduler(
            self.config.scheduler, self.kv_cache, config.model.max_model_len, connector,
            config.lora.max_loras if config.lora is not None else None,
        )
        self.speculator = make_speculator(self.config, self.kv_cache)
        self._tokenizer = tokenizer
        self._grammars: GrammarCompiler | None = None

    def add_request(self, request: Request) -> None:
        self.add_lora(request.lora)
        self._attach_grammar(request)
        self.scheduler.add_request(request)

    def reserve_remote(self, request: Request) -> object | None:
        """Hold blocks for a prompt whose KV the connector brings in; its descriptor, or None
        (nothing held) when the engine cannot take it now."""
        self.add_lora(request.lora)
        self._attach_grammar(request)
        return self.scheduler.reserve_remote(request)

    def add_lora(self, lora: LoRARequest | None) -> None:
        """Have the adapter in host memory (read and checked now: ValueError naming what is
        wrong with it, before the request holds anything)."""
        if lora is None:
            return
        if self.runner.loras is None:
            raise ValueError(f"lora_request: adapter {lora.lora_name!r} asked for, but LoRA is "
                             "not enabled (enable_lora=True, --enable-lora)")
        self.runner.loras.add(lora)

    def _attach_grammar(self, request: Request) -> None:
        """Start compiling the request's structured output (cached per schema, on the
        compiler's thread: the scheduler holds the request until it is ready)."""
        spec = request.sampling_params.structured_outputs
        if spec is None:
            return
        if self._grammars is None:
            model = self.config.model
            tokenizer = self._tokenizer or load_tokenizer(model.path)
            self._grammars = GrammarCompiler(tokenizer, model.vocab_size, model.eos_token_ids)
        request.grammar = GrammarState(self._grammars.submit(spec),
                                       replay=request.generated_token_ids)

    def finish_request(self, request_id: str, status: RequestStatus) -> bool:
        """Abort or stop a request now, freeing its blocks; False if it is not in flight."""
        return self.scheduler.finish_request(request_id, status)

    def has_unfinished_requests(self) -> bool:
        """Requests in flight, or the KV tiers' copies (an abort between steps can leave
        some): the owner's loop steps until both are done."""
        tiers = self.kv_cache.tiers
        return self.scheduler.has_unfinished_requests() or (tiers is not None and tiers.busy)

    def step(self) -> list[EngineCoreOutput]:
        plan = self.scheduler.schedule()
        start = time.perf_counter()
        result = self._execute(plan)
        seconds = time.perf_counter() - start
        self.scheduler.observe_step(plan.total_num_tokens, seconds, plan.num_decodes)
        outputs = self.scheduler.update(plan, result)
        if self.speculator is not None:
            self.speculator.after_step(plan, seconds, self.scheduler)
        tiers = self.kv_cache.tiers
        if tiers is not None and tiers.busy and not self.scheduler.has_unfinished_requests():
            self._flush_tiers()
        return outputs

    def _flush_tiers(self) -> None:
        """Nothing left to overlap the tiers' copies with: finish them now, so an idle engine
        holds no device block for a copy."""
        plan = SchedulerOutput(requests=(), kv_tiers=self.kv_cache.take_tier_ops())
        self.scheduler.update(plan, self._execute(plan))

    def abort_step(self, reason: str) -> list[EngineCoreOutput]:
        """After `step` raised: end the requests of the step that never completed."""
        return self.scheduler.abort_step(reason)

    def shutdown(self) -> None:
        """Release the follower ranks of a tensor-parallel group, then the connector."""
        if self.tp.size > 1:
            publish(self.tp, "stop")
        if self.connector is not None:
            self.connector.close()
        if self.runner.offload is not None:
            self.runner.offload.close()
        if self._grammars is not None:
            self._grammars.close()

    def _execute(self, plan: SchedulerOutput) -> RunnerOutput:
        # An empty plan (only reserved requests, waiting for KV) is not worth a broadcast; one
        # with KV tier copies, or while copies are outstanding, is: every rank copies its
        # shard, and they agree on which copies landed (engine.kv_offload)
        offload = self.runner.offload
        if self.tp.size > 1 and (plan.requests or plan.finished_request_ids or plan.kv_tiers
                                 or offload is not None and offload.busy):
            publish_plan(self.tp, plan)
        return self.runner.execute(plan)
