"""A worker client closed under a request (its worker was replaced by a restart, or removed):
calls on it fail as WorkerLost (the request ends UNAVAILABLE or is placed again), and an
Abort on it is a miss, never an unexpected error that ends the call with UNKNOWN."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.cluster_secret import ClusterSecret
from pdserve.proto import worker_pb2
from pdserve.router.decode_client import DecodeClient
from pdserve.router.workers import PrefillClient, WorkerLost


def test_calls_on_a_closed_client_are_worker_lost_and_aborts_miss() -> None:
    async def run() -> None:
        secret = ClusterSecret.generate()
        decode = DecodeClient("decode-0", "127.0.0.1:9", secret)
        prefill = PrefillClient("prefill-0", "127.0.0.1:9", secret)
        await decode.close()
        await prefill.close()
        assert await decode.abort("r~1") is False
        await prefill.abort("r~1")  # no exception
        with pytest.raises(WorkerLost, match="replaced or removed"):
            await decode.submit(worker_pb2.SubmitRequest(request_id="r~1"))
        with pytest.raises(WorkerLost, match="replaced or removed"):
            await decode.reserve(worker_pb2.ReserveRequest(request_id="r~1"))

    asyncio.run(run())
