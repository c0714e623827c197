"""The prefill worker's gRPC service (proto/worker.proto `PrefillWorker`): typed messages only.

`start_prefill_service(spec)` binds the port first (its address is the worker's identity in
every transfer descriptor), builds the worker, then serves. Blocking RPCs run on the server's
thread pool; the engine itself runs on the worker's loop thread.

Every RPC needs the cluster secret (pdserve.worker_grpc), and so does every KV channel it
opens (`kv_connector`: on the spec's device, so NCCL carries a CUDA worker's KV); with the
spec's TLS files the port is mutual TLS as well. Prefill's status codes, as the router reads
them: INVALID_ARGUMENT a bad field (nothing was queued), ABORTED the KV
transfer failed on the decode side's account (refused, closed, timed out) or the request was
aborted, DEADLINE_EXCEEDED the descriptor's deadline (capped at now + max_reservation_s)
passed, INTERNAL this worker's step failed, UNAVAILABLE only when this worker is closing or
its loop died.
"""

from __future__ import annotations

import logging
import time
from concurrent import futures

import grpc

from pdserve.address import host_port
from pdserve.cluster_secret import ClusterSecret
from pdserve.kvtransfer.descriptor import Endpoint, TransferDescriptor
from pdserve.kvtransfer.rendezvous import GlooConnector
from pdserve.prefill_worker.prefix_events import PrefixIndexPublisher
from pdserve.prefill_worker.worker import (
    KVPushFailed,
    PrefillAborted,
    PrefillStepFailed,
    PrefillWorker,
)
from pdserve.proto import worker_pb2, worker_pb2_grpc
from pdserve.wire import logprobs_to_proto, lora_from_proto, sampling_from_proto
from pdserve.worker_grpc import bind, worker_server
from pdserve.worker_spec import WorkerSpec

logger = logging.getLogger(__name__)

MAX_RPC_THREADS = 64
MAX_WAIT_S = 60.0  # the longest a Prefill call waits, whatever deadline its descriptor names

# why a request failed -> what the router is told (see the module docstring)
_FAILURES = (
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),  # e.g. its request_id already in flight
    (KVPushFailed, grpc.StatusCode.ABORTED),
    (PrefillAborted, grpc.StatusCode.ABORTED),
    (PrefillStepFailed, grpc.StatusCode.INTERNAL),
)


class PrefillServicer(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, worker: PrefillWorker, worker_id: str,
                 max_wait_s: float = MAX_WAIT_S) -> None:
        self.worker, self.worker_id, self.max_wait_s = worker, worker_id, max_wait_s

    def Prefill(self, request, context):
        rid = request.request_id
        try:
            descriptor = TransferDescriptor.decode(request.descriptor)
            params = sampling_from_proto(request.sampling, default_max_tokens=1)
            future = self.worker.prefill(
                rid, list(request.prompt_token_ids), params, descriptor,
                request.num_output_tokens, lora_from_proto(request))
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except RuntimeError as exc:  # closed, or its loop died
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        if not context.add_callback(lambda: future.done() or self.worker.abort(rid)):
            self.worker.abort(rid)  # the call ended already: no callback would ever run
        wait_s = min(descriptor.deadline - time.time(), self.max_wait_s)
        try:
            result = future.result(timeout=max(wait_s, 0.0))
        except futures.TimeoutError:
            self.worker.abort(rid)
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"prefill of {rid} missed deadline")
        except Exception as exc:  # noqa: BLE001 - every failure becomes a status
            context.abort(_status_of(exc), f"prefill of {rid} failed: {exc}")
        response = worker_pb2.PrefillResponse(
            first_token_id=result.first_token, num_cached_tokens=result.num_cached_tokens,
            transfer_bytes=result.transfer_bytes, transfer_s=result.transfer_s,
            skipped_bytes=descriptor.skipped_nbytes(self.worker.layout),  # decode held them
            prompt_logprobs=[logprobs_to_proto(lp) for lp in result.prompt_logprobs],
        )
        if result.logprobs is not None:
            response.logprob.CopyFrom(logprobs_to_proto(result.logprobs))
        return response

    def Abort(self, request, context):
        try:
            self.worker.abort(request.request_id)
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return worker_pb2.WorkerAbortResponse(found=True)

    def GetLoad(self, request, context):
        s = self.worker.stats()
        return worker_pb2.WorkerLoad(
            worker_id=self.worker_id, num_blocks=s.num_blocks,
            num_free_blocks=s.num_free_blocks, num_used_blocks=s.num_used_blocks,
            num_running=s.num_running, num_waiting=s.num_waiting,
            num_cached_blocks=s.num_cached_blocks, max_num_seqs=s.max_num_seqs,
            block_size=s.block_size, tp_size=s.tp_size, quantization=s.quantization,
            weight_bytes=s.weight_bytes, lora_adapters=s.lora_adapters,
            num_computed_tokens=s.num_computed_tokens, **s.kv_tier_counts(), **s.step_counts(),
        )


def _status_of(exc: BaseException) -> grpc.StatusCode:
    for failure, status in _FAILURES:
        if isinstance(exc, failure):
            return status
    return grpc.StatusCode.UNAVAILABLE  # closed, or its loop died


def kv_connector(spec: WorkerSpec, port: int, secret: ClusterSecret) -> GlooConnector:
    """The worker's KV sender transport: its endpoint is the gRPC address (rank 0), and its
    data groups carry tensors of the spec's device (NCCL on CUDA, as the decode listeners)."""
    return GlooConnector(Endpoint(spec.host, port, 0), device=spec.device, secret=secret)


class PrefillService:
    """A PrefillWorker behind its gRPC server; `address` is what the router dials."""

    def __init__(self, spec: WorkerSpec, secret: ClusterSecret,
                 redis_password: str | None = None) -> None:
        self.server = worker_server(secret, MAX_RPC_THREADS, "prefill-rpc")
        self.port = bind(self.server, spec.host, spec.tls())  # mutual TLS when the spec says
        self.address = host_port(spec.host, self.port)
        self.publisher = None
        if spec.redis_url:
            self.publisher = PrefixIndexPublisher(
                spec.redis_url, redis_password, spec.redis_namespace, spec.worker_id
            )
        self.worker = PrefillWorker(spec.engine_config(), kv_connector(spec, self.port, secret),
                                    spec.model_name, self.publisher)
        worker_pb2_grpc.add_PrefillWorkerServicer_to_server(
            PrefillServicer(self.worker, spec.worker_id, spec.max_reservation_s), self.server
        )
        self.server.start()
        logger.info("prefill worker %s serving on %s", spec.worker_id, self.address)

    def stop(self) -> None:
        self.server.stop(grace=1.0).wait()
        self.worker.close()
        if self.publisher is not None:
            self.publisher.close()
