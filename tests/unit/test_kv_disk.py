from __future__ import annotations

import hashlib
import os
import shutil

import pytest

from pdserve.engine.block_hash import hash_block, hash_blocks
from pdserve.engine.kv_disk import DiskKVStore

BLOCK_SIZE = 4
PAYLOAD_NBYTES = 64
LAYOUT = hashlib.blake2b(b"layout-a", digest_size=16).digest()
OTHER_LAYOUT = hashlib.blake2b(b"layout-b", digest_size=16).digest()
# Header fields before the token ids: magic+version, layout, hash, num_tokens, nbytes, checksum.
FIXED_NBYTES = 8 + 16 + 16 + 4 + 8 + 16
HEADER_NBYTES = FIXED_NBYTES + 4 * BLOCK_SIZE + 16


def _block(i: int) -> tuple[bytes, list[int], bytes]:
    tokens = [100 * i + j for j in range(BLOCK_SIZE)]
    payload = bytes((i * 7 + j) % 256 for j in range(PAYLOAD_NBYTES))
    return hash_block(None, tokens), tokens, payload


def _store(tmp_path, layout: bytes = LAYOUT) -> DiskKVStore:
    return DiskKVStore(tmp_path, layout, BLOCK_SIZE, PAYLOAD_NBYTES)


def _path(store: DiskKVStore, block_hash: bytes):
    return store.dir / (block_hash.hex() + ".kv")


def _flip_bit(path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(data)


def test_round_trip_and_file_size(tmp_path):
    store = _store(tmp_path)
    h, tokens, payload = _block(1)
    store.write(h, tokens, memoryview(bytearray(payload)))
    assert store.read(h, tokens) == payload
    assert store.dir == tmp_path / LAYOUT.hex()
    assert _path(store, h).stat().st_size == store.file_nbytes
    assert store.file_nbytes == HEADER_NBYTES + PAYLOAD_NBYTES
    assert store.num_corrupt == 0


def test_constructor_validates(tmp_path):
    with pytest.raises(ValueError, match="layout_id"):
        DiskKVStore(tmp_path, b"short", BLOCK_SIZE, PAYLOAD_NBYTES)
    with pytest.raises(ValueError, match="block_size"):
        DiskKVStore(tmp_path, LAYOUT, 0, PAYLOAD_NBYTES)
    with pytest.raises(ValueError, match="payload_nbytes"):
        DiskKVStore(tmp_path, LAYOUT, BLOCK_SIZE, 0)


def test_missing_block_is_a_miss_not_corrupt(tmp_path):
    store = _store(tmp_path)
    h, tokens, _ = _block(1)
    assert store.read(h, tokens) is None
    assert store.num_corrupt == 0
    store.delete(h)  # missing is fine


@pytest.mark.parametrize("cut", [3, FIXED_NBYTES - 1, FIXED_NBYTES + 5, HEADER_NBYTES - 1,
                                 HEADER_NBYTES, HEADER_NBYTES + PAYLOAD_NBYTES // 2,
                                 HEADER_NBYTES + PAYLOAD_NBYTES - 1])
def test_truncated_file_is_deleted_and_counted(tmp_path, cut):
    store = _store(tmp_path)
    h, tokens, payload = _block(1)
    store.write(h, tokens, payload)
    path = _path(store, h)
    path.write_bytes(path.read_bytes()[:cut])
    assert store.read(h, tokens) is None
    assert not path.exists()
    assert store.num_corrupt == 1


def test_trailing_bytes_are_rejected(tmp_path):
    store = _store(tmp_path)
    h, tokens, payload = _block(1)
    store.write(h, tokens, payload)
    with open(_path(store, h), "ab") as f:
        f.write(b"\0")
    assert store.read(h, tokens) is None
    assert store.num_corrupt == 1


@pytest.mark.parametrize("offset", [
    HEADER_NBYTES + 10,  # payload
    FIXED_NBYTES + 4,  # second token id
    HEADER_NBYTES - 3,  # header checksum
    20,  # layout id
])
def test_flipped_bit_is_rejected(tmp_path, offset):
    store = _store(tmp_path)
    h, tokens, payload = _block(1)
    store.write(h, tokens, payload)
    _flip_bit(_path(store, h), offset)
    assert store.read(h, tokens) is None
    assert not _path(store, h).exists()
    assert store.num_corrupt == 1


def test_foreign_layout_file_is_rejected(tmp_path):
    store, other = _store(tmp_path), _store(tmp_path, OTHER_LAYOUT)
    h, tokens, payload = _block(1)
    other.write(h, tokens, payload)
    assert other.read(h, tokens) == payload
    shutil.copy(_path(other, h), _path(store, h))
    assert store.read(h, tokens) is None
    assert store.num_corrupt == 1


def test_file_under_another_hash_name_is_rejected(tmp_path):
    store = _store(tmp_path)
    (h1, tokens1, payload1), (h2, tokens2, payload2) = _block(1), _block(2)
    store.write(h1, tokens1, payload1)
    os.replace(_path(store, h1), _path(store, h2))
    assert store.read(h2, tokens1) is None  # the tokens match; only the hash inside does not
    assert not _path(store, h2).exists()
    assert store.num_corrupt == 1
    store.write(h2, tokens2, payload2)
    os.replace(_path(store, h2), _path(store, h1))
    assert store.scan() == []
    assert not _path(store, h1).exists()
    assert store.num_corrupt == 2


def test_other_token_ids_are_rejected(tmp_path):
    store = _store(tmp_path)
    h, tokens, payload = _block(1)
    store.write(h, tokens, payload)
    assert store.read(h, tokens[:-1] + [tokens[-1] + 1]) is None
    assert store.num_corrupt == 1


def test_write_validates_lengths(tmp_path):
    store = _store(tmp_path)
    h, tokens, payload = _block(1)
    with pytest.raises(ValueError, match="payload"):
        store.write(h, tokens, payload[:-1])
    with pytest.raises(ValueError, match="block_hash"):
        store.write(h[:8], tokens, payload)
    store.write(h, tokens, payload)
    with pytest.raises(ValueError, match="tokens"):
        store.write(h, tokens + [1], payload)
    assert list(store.dir.iterdir()) == [_path(store, h)]


def test_leftover_tmp_is_not_read_and_scan_removes_it(tmp_path):
    store = _store(tmp_path)
    h, tokens, payload = _block(1)
    store.write(h, tokens, payload)
    tmp = _path(store, h).with_name(_path(store, h).name + ".1234.tmp")
    os.replace(_path(store, h), tmp)  # a write that died before its os.replace
    assert store.read(h, tokens) is None
    assert tmp.exists() and store.num_corrupt == 0
    assert store.scan() == []
    assert not tmp.exists()
    assert store.num_corrupt == 1


def test_scan_lists_valid_headers_oldest_first(tmp_path):
    store = _store(tmp_path)
    tokens = list(range(3 * BLOCK_SIZE))
    hashes = hash_blocks(tokens, BLOCK_SIZE)
    for i, h in enumerate(hashes):
        store.write(h, tokens[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE], _block(i)[2])
    bad_header, _, bad_payload = _block(7)
    store.write(bad_header, _block(7)[1], bad_payload)
    _flip_bit(_path(store, bad_header), 30)  # inside the block hash field
    _flip_bit(_path(store, hashes[2]), HEADER_NBYTES + 1)  # payload only
    mtimes = {hashes[0]: 3000, hashes[1]: 1000, hashes[2]: 2000}
    for h, t in mtimes.items():
        os.utime(_path(store, h), (t, t))

    listed = store.scan()
    assert listed == [(hashes[1], tuple(tokens[4:8])), (hashes[2], tuple(tokens[8:12])),
                      (hashes[0], tuple(tokens[0:4]))]
    assert not _path(store, bad_header).exists()
    assert store.num_corrupt == 1
    assert store.read(hashes[2], tokens[8:12]) is None  # read() checks what scan() did not
    assert store.num_corrupt == 2


def test_new_store_sees_earlier_files(tmp_path):
    h, tokens, payload = _block(1)
    _store(tmp_path).write(h, tokens, payload)
    restarted = _store(tmp_path)
    assert restarted.scan() == [(h, tuple(tokens))]
    assert restarted.file_nbytes == HEADER_NBYTES + PAYLOAD_NBYTES
    assert restarted.read(h, tokens) == payload
    restarted.delete(h)
    assert restarted.read(h, tokens) is None
    assert restarted.num_corrupt == 0
