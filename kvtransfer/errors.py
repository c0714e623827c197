"""The one failure every transfer path raises: `TransferError`, with a machine-readable code.

Both ends of a transfer raise it (the sender from `PushHandle.wait`, the receiver from
`KVReceiver.wait` / `poll`), so a worker frees the request's blocks and tells the router on
one exception type. The code says why, so the router can decide between retry and fail.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import IntEnum


class ErrorCode(IntEnum):
    """Why a transfer failed. Values travel in ERROR headers: never renumber, only append."""

    NONE = 0
    CANCELLED = 1  # a side gave the request up (client cancel, decode abort)
    PREFILL_FAILED = 2  # the prefill leg failed; decode must not wait for it
    DEADLINE = 3  # the transfer's absolute deadline passed
    LAYOUT_MISMATCH = 4  # the two ends disagree on the KV layout: no bytes were moved
    PROTOCOL = 5  # a malformed or unexpected message; the channel was closed
    PEER_LOST = 6  # the other process died or closed the channel
    SHUTDOWN = 7  # this end is shutting down
    UNAUTHENTICATED = 8  # the peer does not hold this cluster's secret (kvtransfer.handshake)
    DEVICE_CONFLICT = 9  # the pair's devices can't be joined (two ends on one GPU under NCCL)


class TransferError(RuntimeError):
    """A KV transfer failed; the blocks it was writing or reading must be freed."""

    def __init__(
        self, message: str, code: ErrorCode = ErrorCode.PROTOCOL,
        transfer_ids: Iterable[bytes] = (),
    ) -> None:
        super().__init__(f"[{code.name}] {message}")
        self.code = ErrorCode(code)
        self.transfer_ids = tuple(transfer_ids)

    def for_transfers(self, transfer_ids: Iterable[bytes]) -> TransferError:
        """The same failure, naming the transfers it broke (message and code kept)."""
        err = TransferError.__new__(TransferError)
        RuntimeError.__init__(err, *self.args)
        err.code, err.transfer_ids = self.code, tuple(transfer_ids)
        return err
