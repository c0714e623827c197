"""TransferDescriptor: JSON round trip, and refusal of every malformed encoding."""

from __future__ import annotations

import contextlib
import json
import random
import time

import pytest

from pdserve.kvtransfer.descriptor import DescriptorError, Endpoint, TransferDescriptor
from pdserve.kvtransfer.layout import KVLayout
from tests.kvtransfer.kvdata import TINY, descriptor, endpoints

SOURCES = endpoints(29500, 2, "prefill-0.local")
DESTS = endpoints(29600, 4, "10.0.0.7")


def make() -> TransferDescriptor:
    return descriptor(TINY, SOURCES, DESTS, [7, 3, 11], request_id="chat-42")


def doc() -> dict:
    return json.loads(make().encode())


def test_round_trip_keeps_everything() -> None:
    d = make()
    back = TransferDescriptor.decode(d.encode())
    assert back == d
    assert TransferDescriptor.decode(d.encode().decode()) == d  # str works too
    assert [(s.head_start, s.head_end) for s in back.destinations] == [(0, 1), (1, 2), (2, 3),
                                                                       (3, 4)]
    assert back.num_blocks == 3 and back.deadline > time.time()
    d.check_layout(TINY)


def test_a_latent_layout_gives_every_destination_the_whole_entry() -> None:
    latent = KVLayout("deepseek", "bfloat16", 16, 3, 1, 288, "latent")
    d = descriptor(latent, SOURCES, DESTS, [7, 3])
    back = TransferDescriptor.decode(d.encode())
    assert [(s.head_start, s.head_end) for s in back.destinations] == [(0, 1)] * 4
    back.check_layout(latent)
    document = json.loads(d.encode())  # a range that is neither a split nor all of the heads
    document["destinations"][1]["heads"] = [0, 2]
    with pytest.raises(DescriptorError, match="split the KV heads evenly"):
        TransferDescriptor.decode(json.dumps(document))


def test_transfer_ids_are_fresh() -> None:
    ids = {make().transfer_id for _ in range(1000)}
    assert len(ids) == 1000


def _bad(mutate) -> None:
    d = doc()
    mutate(d)
    with pytest.raises(DescriptorError):
        TransferDescriptor.decode(json.dumps(d))


@pytest.mark.parametrize("mutate", [
    lambda d: d.pop("deadline"),
    lambda d: d.update(extra=1),
    lambda d: d.update(v=d["v"] + 1),
    lambda d: d.update(v=1),  # before first_block: an older release's descriptor
    lambda d: d.update(v=True),
    lambda d: d.update(transfer_id="00" * 16),
    lambda d: d.update(transfer_id=d["transfer_id"].upper()),
    lambda d: d.update(transfer_id=d["transfer_id"][:-2]),
    lambda d: d.update(layout_id=7),
    lambda d: d.update(request_id=""),
    lambda d: d.update(request_id=["x"]),
    lambda d: d.update(deadline="soon"),
    lambda d: d.update(deadline=1e308 * 10),
    lambda d: d.update(deadline=-1.0),
    lambda d: d.update(sources=[]),
    lambda d: d.update(sources=[["h", 1, 1]]),  # rank must equal its index
    lambda d: d["sources"][0].__setitem__(1, 70000),
    lambda d: d["sources"][0].__setitem__(1, True),
    lambda d: d["sources"][0].__setitem__(0, "bad host"),
    lambda d: d["destinations"][0]["block_ids"].append(7),  # repeated block
    lambda d: d["destinations"][0]["block_ids"].__setitem__(0, -1),
    lambda d: d["destinations"][0]["block_ids"].__setitem__(0, 2.0),
    lambda d: d["destinations"][0]["block_ids"].__setitem__(0, 1 << 40),
    lambda d: d["destinations"][1].update(block_ids=[1, 2]),  # ranks disagree on the count
    lambda d: d["destinations"][1].update(heads=[1, 3]),
    lambda d: d["destinations"][1].update(heads=[2, 3]),  # not rank-ordered
    lambda d: d["destinations"][0].update(heads=[0]),
    lambda d: d["destinations"][0].pop("heads"),
    lambda d: d["destinations"].reverse(),
    lambda d: d.update(destinations=[]),
    lambda d: d.update(destinations={"0": 1}),
])
def test_rejects_bad_fields(mutate) -> None:
    _bad(mutate)


@pytest.mark.parametrize("raw", [
    b"", b"null", b"[]", b"{", b"\xff\xfe", b"{}", b'{"v": NaN}', b'{"v": Infinity}',
    b"[" * 100_000 + b"]" * 100_000,  # deep nesting
    b'{"v": 1' + b"9" * 5000 + b"}",  # an int past Python's digit limit
    b" " * ((1 << 20) + 1),
])
def test_rejects_bad_documents(raw: bytes) -> None:
    with pytest.raises(DescriptorError):
        TransferDescriptor.decode(raw)


def test_rejects_duplicate_keys() -> None:
    raw = make().encode().decode()
    with pytest.raises(DescriptorError, match="duplicate"):
        TransferDescriptor.decode(raw[:-1] + ',"v":1}')


def test_rejects_non_bytes() -> None:
    with pytest.raises(DescriptorError):
        TransferDescriptor.decode(12)  # type: ignore[arg-type]


def test_fuzzed_encodings_decode_or_raise_descriptor_error() -> None:
    rng = random.Random(0)
    good = make().encode()
    for _ in range(3000):
        raw = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        with contextlib.suppress(DescriptorError):  # anything else fails the test
            TransferDescriptor.decode(bytes(raw))


def test_check_layout_names_the_mismatch() -> None:
    other = TINY.__class__("other-model", "float32", 4, 3, 4, 8)
    with pytest.raises(ValueError, match="layout id"):
        make().check_layout(other)


def test_endpoint_key() -> None:
    assert Endpoint("h", 5, 1).key == "h:5/1"
    with pytest.raises(ValueError):
        Endpoint("h", 0, 0)
