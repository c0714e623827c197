"""PrefillWorker: runs prompts in chunked batches and pushes their KV into decode blocks.

Each request runs as a one-token generation on the local engine (prefix cache included: only
uncached tokens are computed, yet every block the decode side reserved is sent). Its step is
the engine's own (`EngineCore.step`); the KV connector (kvtransfer.push_connector) pushes, in
the step where a request's last chunk runs, its blocks layer by layer while later layers
compute, and the step ends only once every byte has left: blocks are released (kept in the
prefix cache) after that. The first token is the result. After every loop iteration the
block pool's stored/evicted hashes go to the prefix index publisher (snapshots when it asks:
prefill_worker/prefix_events.py). All engine work happens on the worker's loop thread.

Every field a caller sends is checked before anything is queued (ValueError, naming it). A
request that fails says why by its exception type: `KVPushFailed` (its KV never reached the
decode side: the peer refused, closed or timed out), `PrefillAborted`, `PrefillStepFailed`
(this worker's forward pass raised), `PrefillWorkerClosed` (closed, or its loop died).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Sequence
from concurrent.futures import Future

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine_core import EngineCore
from pdserve.engine.input_processor import prepare_params
from pdserve.engine.loop import EngineLoop, LoopClosedError
from pdserve.engine.lora_request import LoRARequest
from pdserve.engine.request import Request, RequestStatus, check_num_prior_output_tokens
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler_output import EngineCoreOutput, TokenLogprobs
from pdserve.engine.worker_stats import WorkerStats
from pdserve.kvtransfer.connector import Connector
from pdserve.kvtransfer.descriptor import TransferDescriptor
from pdserve.kvtransfer.layout import KVLayout
from pdserve.kvtransfer.push_connector import KVPushConnector
from pdserve.prefill_worker.prefix_events import PrefixIndexPublisher
from pdserve.wire import check_prompt, check_request_id

logger = logging.getLogger(__name__)


class KVPushFailed(RuntimeError):
    """The request's KV did not reach the decode side (refused, peer lost, deadline)."""


class PrefillAborted(RuntimeError):
    """The request was aborted (Abort, or its caller went away)."""


class PrefillStepFailed(RuntimeError):
    """This worker's step raised while the request was in it."""


class PrefillWorkerClosed(RuntimeError):
    """The worker is closed, or its loop died: it serves nothing more."""


@dataclasses.dataclass(frozen=True)
class PrefillResult:
    first_token: int
    logprobs: TokenLogprobs | None  # of the first token, when asked
    num_cached_tokens: int  # prompt tokens served from this worker's prefix cache
    transfer_bytes: int
    transfer_s: float  # first layer pushed -> every byte acknowledged
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()  # positions 1.., when asked


class PrefillWorker:
    def __init__(
        self,
        config: EngineConfig,
        transport: Connector,
        model_name: str,
        publisher: PrefixIndexPublisher | None = None,
    ) -> None:
        """`transport` opens the KV channels; its source endpoint is this worker's identity
        in every transfer descriptor."""
        self.layout = KVLayout.from_model_config(config.model, config.cache.block_size,
                                                 model_name)
        self.connector = KVPushConnector(self.layout, transport)
        self.core = EngineCore(config, connector=self.connector)
        self.config = self.core.config
        self.endpoint = self.connector.endpoint
        self._results: dict[str, Future[PrefillResult]] = {}  # the callers' handles
        self.publisher = publisher
        if publisher is not None:
            self.core.kv_cache.pool.enable_events()
            if self.core.kv_cache.tiers is not None:
                self.core.kv_cache.tiers.enable_events()
        self._loop = EngineLoop("prefill-loop", self._step, self._fail_all)

    def prefill(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        descriptor: TransferDescriptor,
        num_output_tokens: int = 0,
        lora: LoRARequest | None = None,
    ) -> Future[PrefillResult]:
        """Queue a prompt; the future gives its first token once its KV has been pushed.
        `num_output_tokens`: the prompt's tail a migrated request generated elsewhere (its
        seeded sampling continues after it); `lora`: the adapter its KV is computed with.
        ValueError (now, or from the future for a request_id already in flight) names a bad
        field; the future's other failures are the exception types above."""
        check_request_id(request_id)
        model = self.config.model
        prompt = check_prompt(prompt_token_ids, model.vocab_size, model.max_model_len)
        params = prepare_params(params, None, model.vocab_size)
        num_output_tokens = check_num_prior_output_tokens(num_output_tokens, len(prompt))
        if descriptor.request_id != request_id:
            raise ValueError(f"descriptor is for request {descriptor.request_id!r}, "
                             f"not {request_id!r}")
        descriptor.check_layout(self.layout)
        if tuple(descriptor.sources) != (self.endpoint,):
            raise ValueError(f"descriptor of {request_id!r} names sources "
                             f"{[s.key for s in descriptor.sources]}; this prefill worker is "
                             f"{self.endpoint.key}")
        num_blocks = -(-len(prompt) // self.layout.block_size)
        if descriptor.num_blocks != num_blocks:
            raise ValueError(
                f"descriptor reserves {descriptor.num_blocks} blocks, the prompt needs {num_blocks}"
            )
        first_token_only = dataclasses.replace(params, max_tokens=1, stop=(),
                                               min_tokens=min(params.min_tokens, 1))
        request = Request(request_id, prompt, first_token_only,
                          self.config.model.eos_token_ids, kv_transfer=descriptor,
                          num_prior_output_tokens=num_output_tokens, lora=lora)
        result: Future[PrefillResult] = Future()
        try:
            added = self._loop.submit(lambda: self._add(request, result))
        except LoopClosedError as exc:
            raise PrefillWorkerClosed(f"prefill worker is closed ({exc})") from None
        added.add_done_callback(lambda f: _fail_if_raised(f, result))
        return result

    def abort(self, request_id: str) -> None:
        """Drop a queued or half-prefilled prompt; its future fails. Unknown ids are ignored."""
        check_request_id(request_id)
        with contextlib.suppress(LoopClosedError):  # a closed worker holds nothing
            self._loop.submit(lambda: self._abort(request_id))

    def is_alive(self) -> bool:
        """Whether the engine loop still runs (a dead loop serves nothing)."""
        return self._loop.is_alive()

    def stats(self) -> WorkerStats:
        """Read from the caller's thread: a load snapshot must not wait for a long step."""
        return WorkerStats.from_core(self.core)

    def close(self) -> None:
        if not self._loop.stop(self.core.shutdown):  # it had died: release the transport here
            self.connector.close()

    # ---- loop thread ----

    def _add(self, request: Request, result: Future[PrefillResult]) -> None:
        self.core.add_request(request)
        self._results[request.request_id] = result

    def _abort(self, request_id: str) -> None:
        self.core.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        future = self._results.pop(request_id, None)
        if future is not None:
            future.set_exception(PrefillAborted(f"request {request_id} aborted"))

    def _step(self) -> bool:
        busy = self.core.has_unfinished_requests()
        if busy:
            failure: type[RuntimeError] = KVPushFailed  # the only error of a step that returns
            try:
                outputs = self.core.step()
            except Exception as exc:  # the worker survives a failed batch; its requests fail
                logger.exception("prefill step failed")
                outputs = self.core.abort_step(f"prefill step failed: {exc}")
                failure = PrefillStepFailed
                if not outputs:  # not a step's failure: nothing to pin it on
                    raise
            for out in outputs:
                self._resolve(out, failure)
        self._publish_cache_events()
        return busy

    def _resolve(self, out: EngineCoreOutput, failure: type[RuntimeError]) -> None:
        future = self._results.pop(out.request_id, None)
        if future is None:
            return
        if out.finish_reason == RequestStatus.FINISHED_ERROR.value:
            future.set_exception(failure(out.error))
            return
        assert out.kv_save is not None, "a prefill request's last chunk pushes its KV"
        future.set_result(PrefillResult(
            out.new_token_ids[0], out.new_logprobs[0] if out.new_logprobs else None,
            max(out.num_cached_tokens, 0), out.kv_save.num_bytes, out.kv_save.seconds,
            out.prompt_logprobs or (),
        ))

    def _publish_cache_events(self) -> None:
        if self.publisher is None:
            return
        pool, tiers = self.core.kv_cache.pool, self.core.kv_cache.tiers
        stored, evicted = pool.drain_events()
        if stored or evicted:
            self.publisher.publish(stored, evicted)
        for tier, (stored, evicted) in (tiers.drain_events() if tiers else {}).items():
            self.publisher.publish(stored, evicted, tier)
        if self.publisher.needs_snapshot:
            self.publisher.snapshot(pool.cached_hashes(), tiers.hashes() if tiers else None)

    def _fail_all(self, exc: BaseException) -> None:
        """The loop died: fail every waiting caller rather than leave it hanging."""
        results, self._results = self._results, {}
        for future in results.values():
            future.set_exception(PrefillWorkerClosed(f"prefill worker died: {exc}"))


def _fail_if_raised(added: Future, result: Future) -> None:
    """The request never reached the engine (bad id, or the loop closed first)."""
    exc = added.exception()
    if exc is not None and not result.done():
        result.set_exception(exc)
