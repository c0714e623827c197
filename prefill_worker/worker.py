"""PrefillWorker: runs prompts in chunked batches and pushes their KV into decode blocks.

Each request runs as a one-token generation on the local engine (prefix cache included: only
uncached tokens are computed, yet every block the decode side reserved is sent). In the step
where a request's last chunk runs, its blocks are pushed layer by layer while later layers
compute: all requests of the step going to one decode rank travel as one message per layer.
The first token is the result. Blocks are released (kept in the prefix cache) only after
their bytes have left. After every loop iteration the block pool's stored/evicted hashes go
to the prefix index publisher (snapshots when it asks: prefill_worker/prefix_events.py). All
engine work happens on the worker's loop thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine_core import EngineCore
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler_output import TokenLogprobs
from pdserve.kvtransfer.connector import Connector
from pdserve.kvtransfer.descriptor import TransferDescriptor
from pdserve.kvtransfer.errors import ErrorCode, TransferError
from pdserve.kvtransfer.layout import KVLayout
from pdserve.kvtransfer.sender import KVSender, PushHandle, PushPlan
from pdserve.prefill_worker.prefix_events import PrefixIndexPublisher

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.005

@dataclasses.dataclass(frozen=True)
class PrefillResult:
    first_token: int
    logprobs: TokenLogprobs | None  # of the first token, when asked
    num_cached_tokens: int  # prompt tokens served from this worker's prefix cache
    transfer_bytes: int
    transfer_s: float  # first layer pushed -> every byte acknowledged


class PrefillWorker:
    def __init__(
        self,
        config: EngineConfig,
        connector: Connector,
        model_name: str,
        publisher: PrefixIndexPublisher | None = None,
    ) -> None:
        self.core = EngineCore(config)
        self.config = self.core.config
        self.layout = KVLayout.from_model_config(
            self.config.model, self.config.cache.block_size, model_name
        )
        kv_caches = [kv[:2] for kv in self.core.runner.kv_caches]
        self.sender = KVSender(self.layout, connector, 1, kv_caches)
        self.endpoint = connector.source
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._descriptors: dict[str, TransferDescriptor] = {}
        self._results: dict[str, Future[PrefillResult]] = {}
        self.publisher = publisher
        if publisher is not None:
            self.core.kv_cache.pool.enable_events()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="prefill-loop", daemon=True)
        self._thread.start()

    def prefill(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        descriptor: TransferDescriptor,
    ) -> Future[PrefillResult]:
        """Queue a prompt; the future gives its first token once its KV has been pushed."""
        if self._stop.is_set():
            raise RuntimeError("prefill worker is closed")
        descriptor.check_layout(self.layout)
        num_blocks = -(-len(prompt_token_ids) // self.layout.block_size)
        if descriptor.num_blocks != num_blocks:
            raise ValueError(
                f"descriptor reserves {descriptor.num_blocks} blocks, the prompt needs {num_blocks}"
            )
        result: Future[PrefillResult] = Future()
        first_token_only = dataclasses.replace(params, max_tokens=1, stop=())
        request = Request(request_id, tuple(prompt_token_ids), first_token_only,
                          self.config.model.eos_token_ids)

        def add() -> None:
            self.core.add_request(request)
            self._descriptors[request_id] = descriptor
            self._results[request_id] = result

        self._commands.put(add)
        return result

    def abort(self, request_id: str) -> None:
        """Drop a queued or half-prefilled prompt; its future fails. Unknown ids are ignored."""
        self._commands.put(
            lambda: self._fail([request_id], RuntimeError(f"request {request_id} aborted"))
        )

    def is_alive(self) -> bool:
        """Whether the engine loop still runs (a dead loop serves nothing)."""
        return self._thread.is_alive()

    def stats(self) -> dict[str, int]:
        kv, scheduler = self.core.kv_cache, self.core.scheduler
        return {"num_blocks": kv.pool.num_blocks, "num_free_blocks": kv.num_free_blocks,
                "num_used_blocks": kv.pool.num_blocks - kv.num_free_blocks,
                "num_cached_blocks": kv.pool.num_cached_blocks,
                "num_running": len(scheduler.running), "num_waiting": len(scheduler.waiting),
                "num_computed_tokens": scheduler.stats.num_computed_tokens}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self.sender.close()

    def _loop(self) -> None:
        try:
            self._serve()
        except Exception as exc:  # fail every waiting caller rather than leave it hanging
            logger.exception("prefill loop failed")
            self._stop.set()
            for future in self._results.values():
                future.set_exception(RuntimeError(f"prefill worker died: {exc}"))

    def _serve(self) -> None:
        while not self._stop.is_set():
            while True:
                try:
                    self._commands.get_nowait()()
                except queue.Empty:
                    break
            if self.core.has_unfinished_requests():
                self._step()
            else:
                with contextlib.suppress(queue.Empty):
                    self._commands.get(timeout=IDLE_WAIT_S)()
            self._publish_cache_events()

    def _step(self) -> None:
        plan = self.core.scheduler.schedule()
        finals = [e for e in plan.requests if e.sampling_params is not None]
        pushes = self.sender.plan(
            [(self._descriptors[e.request_id], e.block_ids) for e in finals]
        )
        handles: list[PushHandle] = []
        first_push: list[float] = []

        def push(layer: int) -> None:
            first_push.append(time.perf_counter())
            handles.extend(self.sender.push_layer(layer, p) for p in pushes)

        try:
            result = self.core.runner.execute(plan, push)
        except Exception as exc:  # the worker survives a failed batch; its requests fail
            logger.exception("prefill step failed")
            self.sender.abort(pushes, ErrorCode.PREFILL_FAILED)
            self._fail([e.request_id for e in plan.requests], exc)
            return
        failed = self._complete(pushes, handles)
        transfer_s = time.perf_counter() - first_push[0] if first_push else 0.0
        for out in self.core.scheduler.update(plan, result):
            future = self._results.pop(out.request_id, None)
            descriptor = self._descriptors.pop(out.request_id, None)
            if future is None:
                continue
            if out.request_id in failed:
                future.set_exception(failed[out.request_id])
            else:
                layout = self.layout
                nbytes = descriptor.num_blocks * layout.num_layers * layout.block_nbytes(
                    layout.num_kv_heads)
                future.set_result(PrefillResult(
                    out.new_token_ids[0], out.new_logprobs[0] if out.new_logprobs else None,
                    max(out.num_cached_tokens, 0), nbytes, transfer_s,
                ))

    def _publish_cache_events(self) -> None:
        if self.publisher is None:
            return
        pool = self.core.kv_cache.pool
        stored, evicted = pool.drain_events()
        if stored or evicted:
            self.publisher.publish(stored, evicted)
        if self.publisher.needs_snapshot:
            self.publisher.snapshot(pool.cached_hashes())

    def _complete(
        self, pushes: list[PushPlan], handles: list[PushHandle]
    ) -> dict[str, TransferError]:
        """Wait until every pushed byte has left, then tell each receiver its transfer is done.

        Returns the requests whose transfer failed, by request id.
        """
        failed: dict[bytes, TransferError] = {}
        for handle in handles:
            try:
                handle.wait()
            except TransferError as exc:
                failed.update((t, exc) for t in handle.plan.transfer_ids)
        for push in pushes:
            if any(t in failed for t in push.transfer_ids):
                continue
            try:
                self.sender.finish(push).wait()
            except TransferError as exc:
                failed.update((t, exc) for t in push.transfer_ids)
        by_id = {d.transfer_id: rid for rid, d in self._descriptors.items()}
        return {by_id[t]: exc for t, exc in failed.items() if t in by_id}

    def _fail(self, request_ids: list[str], exc: BaseException) -> None:
        for rid in request_ids:
            self.core.finish_request(rid, RequestStatus.FINISHED_ABORTED)
            self._descriptors.pop(rid, None)
            future = self._results.pop(rid, None)
            if future is not None:
                future.set_exception(exc)
