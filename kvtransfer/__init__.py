"""KV data plane between prefill and decode workers: layout, descriptors, headers, channels.

    layout.py       KVLayout (+ layout_id), head_ranges, reshard_routes: TP=p -> TP=d math
    descriptor.py   TransferDescriptor / Endpoint: what decode reserved, strict JSON codec
    header.py       the fixed 4096-byte data-plane header and its hostile-input validation
    channel.py      PairChannel: 2-rank control + data groups, deadlines, prompt close
    handshake.py    the signed connect handshake (cluster secret, layout checked before any KV)
    connector.py    the two roles: Connector (sender side), Listener (receiver side)
    rendezvous.py   GlooConnector / GlooListener: channels from a TCPStore, no global world
                    (gloo control groups; data groups gloo on CPU, NCCL on CUDA)
    device_groups.py  which backend carries a device's tensors; the one-GPU NCCL refusal
    sender.py       KVSender: plan a batch per destination rank, push layer by layer
    receiver.py     KVReceiver: expect / poll / wait / cancel
    push_connector.py     KVPushConnector: the prefill side of engine.kv_connector (KVSender)
    receive_connector.py  KVReceiveConnector: the decode side (KVReceiver), TP follower handlers
    inbox.py        per channel: the header reader and the payload lander threads
    landing.py      claims, recv targets (straight into the cache when possible), unpacking
    reservation.py  one expected transfer: which (layer, head, block) cells have landed
    staging.py      reused transfer buffers; packing into one
    loopback.py     LoopbackHub: the same sender/receiver in one process, for worker tests
    errors.py       TransferError + ErrorCode, raised on both ends of a failed transfer
"""

from pdserve.engine.kv_connector import RemotePrefill
from pdserve.kvtransfer.descriptor import (
    DescriptorError,
    DestinationShard,
    Endpoint,
    TransferDescriptor,
)
from pdserve.kvtransfer.errors import ErrorCode, TransferError
from pdserve.kvtransfer.header import HeaderError, LayoutMismatchError, MessageHeader
from pdserve.kvtransfer.layout import KVLayout, ShardRoute, reshard_routes, routes_from, routes_to
from pdserve.kvtransfer.loopback import LoopbackHub
from pdserve.kvtransfer.push_connector import KVPushConnector
from pdserve.kvtransfer.receive_connector import KVReceiveConnector
from pdserve.kvtransfer.receiver import KVReceiver, ReceiverEvents
from pdserve.kvtransfer.rendezvous import GlooConnector, GlooListener
from pdserve.kvtransfer.sender import KVSender, PushHandle, PushPlan

__all__ = [
    "DescriptorError", "DestinationShard", "Endpoint", "ErrorCode", "GlooConnector",
    "GlooListener", "HeaderError", "KVLayout", "KVPushConnector", "KVReceiveConnector",
    "KVReceiver", "KVSender", "LayoutMismatchError", "LoopbackHub", "MessageHeader",
    "PushHandle", "PushPlan", "ReceiverEvents", "RemotePrefill", "ShardRoute",
    "TransferDescriptor", "TransferError", "reshard_routes", "routes_from", "routes_to",
]
