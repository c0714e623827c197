"""The decode worker's gRPC service (proto/worker.proto `DecodeWorker`), served by TP rank 0.

`Outputs` is one long-lived stream per router (its subscription, by `router_id`; several
routers share a worker): each message is one engine step's news for every request of that
router, so a batch of 64 costs one message per step, not 64; steps a slow router has not read
yet go out merged into one message (decode_worker.coalesce). The router_id a Reserve or Submit
carries owns the request; decode_worker.subscriptions sorts the steps and aborts the requests
of a router that has had no stream for `orphan_after_s`. With no step news for KEEPALIVE_S a
stream sends an empty message, but only while the engine loop is alive and came round within
`stall_timeout_s`: a wedged loop goes silent (the router ends such a stream after its own
silence limit) and a dead one ends every stream, UNAVAILABLE, after its last error deltas. A
newer stream of the same router ends the older one, ABORTED.

Every RPC needs the cluster secret (pdserve.worker_grpc), and a client certificate too when
`tls` is given (worker-plane mutual TLS; the spec's `tls()`). Status codes the router acts on:
INVALID_ARGUMENT a bad field (nothing was queued), NOT_FOUND a Start with no live reservation
or a PushPrefix for blocks no longer cached here, ABORTED a PushPrefix whose KV did not reach
the puller, UNAVAILABLE only when this worker is closing or its loop died.
"""

from __future__ import annotations

import json
import logging
import math
import time

import grpc

from pdserve.address import host_port
from pdserve.cluster_secret import ClusterSecret
from pdserve.decode_worker.coalesce import coalesce
from pdserve.decode_worker.outputs import DecodeOutput
from pdserve.decode_worker.subscriptions import (
    ORPHAN_AFTER_S,
    End,
    OutputFanout,
    Subscription,
    check_router_id,
)
from pdserve.decode_worker.worker import (
    DecodeWorker,
    PrefixGone,
    PushFailed,
    ReservationNotFound,
)
from pdserve.kvtransfer.descriptor import Endpoint, TransferDescriptor
from pdserve.proto import worker_pb2, worker_pb2_grpc
from pdserve.tls import TLSFiles
from pdserve.wire import (
    logprobs_from_proto,
    logprobs_to_proto,
    lora_from_proto,
    sampling_from_proto,
)
from pdserve.worker_grpc import bind, worker_server

logger = logging.getLogger(__name__)

MAX_RPC_THREADS = 32
POLL_S = 0.1  # how often an idle Outputs stream checks that its reader is still there
KEEPALIVE_S = 1.0  # an Outputs stream is never silent longer while the loop is healthy
STALL_TIMEOUT_S = 30.0


def delta_to_proto(out: DecodeOutput) -> worker_pb2.RequestDelta:
    return worker_pb2.RequestDelta(
        request_id=out.request_id, token_ids=list(out.token_ids),
        logprobs=[logprobs_to_proto(lp) for lp in out.logprobs],
        finish_reason=out.finish_reason or "", error=out.error or "",
        stop_reason="" if out.stop_reason is None else str(out.stop_reason),
        num_cached_tokens=out.num_cached_tokens,
        prompt_logprobs=[logprobs_to_proto(lp) for lp in out.prompt_logprobs],
    )


class DecodeServicer(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, worker: DecodeWorker, worker_id: str,
                 stall_timeout_s: float = STALL_TIMEOUT_S,
                 orphan_after_s: float = ORPHAN_AFTER_S) -> None:
        self.worker, self.worker_id = worker, worker_id
        self.stall_timeout_s = stall_timeout_s
        self.fanout = OutputFanout(worker, worker_id, orphan_after_s)

    def Reserve(self, request, context):
        descriptor = self._owned(context, request, lambda: self.worker.reserve(
            request.request_id, list(request.prompt_token_ids),
            sampling_from_proto(request.sampling, default_max_tokens=1),
            [Endpoint(s.host, s.port, s.rank) for s in request.sources], request.deadline,
            request.num_output_tokens, lora_from_proto(request),
        ))
        if descriptor is None:
            return worker_pb2.ReserveResponse(granted=False)
        return worker_pb2.ReserveResponse(granted=True, descriptor=descriptor.encode(),
                                          num_cached_blocks=descriptor.first_block)

    def Start(self, request, context):
        logprobs = logprobs_from_proto(request.logprob) if request.HasField("logprob") else None
        self._checked(context, lambda: self.worker.start(
            request.request_id, request.first_token_id, logprobs))
        return worker_pb2.StartResponse()

    def Submit(self, request, context):
        def fields() -> dict:  # read inside the call: a bad field is INVALID_ARGUMENT
            return {"request_id": request.request_id,
                    "prompt_token_ids": list(request.prompt_token_ids),
                    "params": sampling_from_proto(request.sampling, default_max_tokens=1),
                    "num_output_tokens": request.num_output_tokens,
                    "lora": lora_from_proto(request)}

        if not request.pull_sources and not request.num_pull_tokens:
            granted = self._owned(context, request, lambda: self.worker.submit(**fields()))
            return worker_pb2.SubmitResponse(granted=granted)
        granted, descriptor = self._owned(context, request, lambda: self.worker.submit_pulling(
            sources=[Endpoint(s.host, s.port, s.rank) for s in request.pull_sources],
            num_pull_tokens=request.num_pull_tokens, deadline=request.pull_deadline,
            **fields()))
        return worker_pb2.SubmitResponse(
            granted=granted, pull_descriptor=descriptor.encode() if descriptor else b"")

    def PushPrefix(self, request, context):
        descriptor = self._checked(context, lambda: TransferDescriptor.decode(request.descriptor))
        seconds = self._checked(context, lambda: self.worker.push_prefix(
            request.request_id, list(request.prompt_token_ids), lora_from_proto(request),
            descriptor))
        return worker_pb2.PushPrefixResponse(
            transfer_bytes=descriptor.pushed_nbytes(self.worker.layout), transfer_s=seconds)

    def _owned(self, context, request, call):
        """Reserve / Submit's `call` with the request's owner recorded first (its first delta
        may come before the call returns); forgotten again when nothing was queued."""
        router_id = self._checked(context, lambda: check_router_id(request.router_id))
        claimed = self.fanout.claim(request.request_id, router_id)
        accepted = None
        try:
            accepted = self._checked(context, call)
            return accepted
        finally:
            granted = accepted[0] if isinstance(accepted, tuple) else accepted
            if claimed and (granted is None or granted is False):  # refused or raised
                self.fanout.release(request.request_id)

    def Outputs(self, request, context):
        router_id = self._checked(context, lambda: check_router_id(request.router_id))
        subscription = self.fanout.subscribe(router_id)
        context.send_initial_metadata(())  # the reader knows it is subscribed before any step
        # the stream may end without this generator being resumed: the lease starts either way
        if not context.add_callback(lambda: self.fanout.unsubscribe(subscription)):
            self.fanout.unsubscribe(subscription)  # the call ended already
        try:
            yield from self._stream(subscription, context)
        finally:
            self.fanout.unsubscribe(subscription)

    def _stream(self, subscription: Subscription, context):
        # the first keepalive goes at once: the router takes the worker as up from a fresh
        # stream's first message, so a started (or restarted) worker is in rotation ~1 s sooner
        last_sent, stalled = -math.inf, False
        while context.is_active():
            batches = subscription.next(POLL_S)
            if isinstance(batches, End):
                self._end(subscription, batches, context)
            if batches:
                yield coalesce([worker_pb2.StepOutputs(deltas=[delta_to_proto(out) for out in b])
                                for b in batches])
                last_sent = time.monotonic()
            elif time.monotonic() - last_sent >= KEEPALIVE_S and self.worker.is_alive():
                stalled = self._stalled(stalled)
                if not stalled:
                    yield worker_pb2.StepOutputs()
                    last_sent = time.monotonic()

    def _end(self, subscription: Subscription, end: End, context) -> None:
        if end.replaced:
            context.abort(grpc.StatusCode.ABORTED,
                          f"decode worker {self.worker_id}: a newer Outputs stream of router "
                          f"{subscription.router_id!r} replaced this one")
        context.abort(grpc.StatusCode.UNAVAILABLE,  # after its last error deltas went out
                      f"decode worker {self.worker_id}: engine loop has stopped")

    def _stalled(self, was_stalled: bool) -> bool:
        """Whether the loop is wedged (no iteration within stall_timeout_s); logs the change."""
        silent = self.worker.seconds_since_beat()
        stalled = silent > self.stall_timeout_s
        if stalled and not was_stalled:
            logger.error("decode worker %s: engine loop stuck for %.0f s (limit %g s); "
                         "Outputs keepalives stop", self.worker_id, silent, self.stall_timeout_s)
        elif was_stalled and not stalled:
            logger.warning("decode worker %s: engine loop moving again", self.worker_id)
        return stalled

    def Abort(self, request, context):
        found = self._checked(context, lambda: self.worker.abort(request.request_id))
        return worker_pb2.WorkerAbortResponse(found=found)

    def GetLoad(self, request, context):
        if not self.worker.is_alive():  # a dead worker's load would invite requests
            context.abort(grpc.StatusCode.UNAVAILABLE,
                          f"decode worker {self.worker_id}: engine loop has stopped")
        s = self._checked(context, self.worker.stats)
        return worker_pb2.WorkerLoad(
            worker_id=self.worker_id, num_blocks=s.num_blocks,
            num_free_blocks=s.num_free_blocks, num_used_blocks=s.num_used_blocks,
            num_running=s.num_running, num_waiting=s.num_waiting + s.num_reserved,
            num_cached_blocks=s.num_cached_blocks, max_num_seqs=s.max_num_seqs,
            block_size=s.block_size, tp_size=s.tp_size, quantization=s.quantization,
            weight_bytes=s.weight_bytes, lora_adapters=s.lora_adapters,
            num_spec_verifications=s.num_spec_verifications,
            num_draft_tokens=s.num_draft_tokens, num_accepted_tokens=s.num_accepted_tokens,
            num_computed_tokens=s.num_computed_tokens, **s.kv_tier_counts(), **s.step_counts(),
            kv_source=_endpoint(self.worker.pusher.source) if self.worker.pusher else None,
            num_pulled_tokens=s.num_pulled_tokens,
            num_failed_pull_tokens=s.num_failed_pull_tokens,
        )

    @staticmethod
    def _checked(context, call):
        try:
            return call()
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except (ReservationNotFound, PrefixGone) as exc:
            context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        except PushFailed as exc:
            context.abort(grpc.StatusCode.ABORTED, str(exc))
        except RuntimeError as exc:  # the worker is closed or its loop died
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))


def _endpoint(endpoint: Endpoint) -> worker_pb2.Endpoint:
    return worker_pb2.Endpoint(host=endpoint.host, port=endpoint.port, rank=endpoint.rank)


class DecodeService:
    """Rank 0's DecodeWorker behind its gRPC server; `address` is what the router dials."""

    def __init__(self, worker: DecodeWorker, worker_id: str, host: str,
                 secret: ClusterSecret, stall_timeout_s: float = STALL_TIMEOUT_S,
                 tls: TLSFiles | None = None, orphan_after_s: float = ORPHAN_AFTER_S) -> None:
        self.worker = worker
        self.server = worker_server(secret, MAX_RPC_THREADS, "decode-rpc")
        self.port = bind(self.server, host, tls)
        self.address = host_port(host, self.port)
        worker_pb2_grpc.add_DecodeWorkerServicer_to_server(
            DecodeServicer(worker, worker_id, stall_timeout_s, orphan_after_s), self.server
        )
        self.server.start()
        speculative = worker.config.speculative
        logger.info("decode worker %s serving on %s; speculative decoding: %s", worker_id,
                    self.address, "off" if speculative is None else json.dumps(
                        speculative.to_dict(), sort_keys=True))

    def stop(self) -> None:
        self.server.stop(grace=1.0).wait()
        self.worker.close()
