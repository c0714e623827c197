"""kernels/huge_pages.py: one mapping in huge pages, handed out as tensors that own it."""

from __future__ import annotations

import gc
import re
from pathlib import Path

import torch

from pdserve.kernels.cpu import packed_linear
from pdserve.kernels.cpu.huge_pages import ALIGN, HUGE_PAGE, Arena


def _mapping_of(address: int) -> tuple[int, int, str] | None:
    """(start, end, its smaps block) of this process's mapping holding `address`, or None."""
    for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", Path("/proc/self/smaps").read_text()):
        start, end = (int(v, 16) for v in block.split(" ", 1)[0].split("-"))
        if start <= address < end:
            return start, end, block
    return None


def _thp_mode() -> str:
    return re.search(r"\[(\w+)\]", Path("/sys/kernel/mm/transparent_hugepage/enabled")
                     .read_text()).group(1)


def test_tensors_taken_keep_their_values_apart_and_aligned():
    shapes = [(3, 1000), (5, 32), (1024, 1024)]  # bf16: 6000 B (not a whole line), 320 B, 2 MiB
    arena = Arena(s[0] * s[1] * 2 for s in shapes)
    sources = [torch.randn(s).bfloat16() for s in shapes]
    taken = [arena.take(s, torch.bfloat16).copy_(src) for s, src in zip(shapes, sources)]
    for tensor, src in zip(taken, sources):
        assert tensor.is_contiguous() and torch.equal(tensor, src)
        assert tensor.data_ptr() % ALIGN == 0
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * 2) for t in taken)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    assert _mapping_of(taken[0].data_ptr())[:2] == _mapping_of(taken[2].data_ptr())[:2]


def test_a_spent_arena_falls_back_to_torch():
    arena = Arena([64])
    inside = arena.take((32,), torch.bfloat16)
    outside = arena.take((32,), torch.bfloat16).fill_(1)
    assert inside.untyped_storage().data_ptr() != outside.untyped_storage().data_ptr()
    assert torch.equal(outside, torch.ones(32, dtype=torch.bfloat16))
    assert Arena([]).take((4, 4), torch.float32).shape == (4, 4)


def test_the_mapping_lives_as_long_as_its_tensors():
    arena = Arena([HUGE_PAGE])
    tensor = arena.take((HUGE_PAGE // 4,), torch.float32).fill_(3.0)
    address = tensor.data_ptr()
    del arena
    gc.collect()
    span = _mapping_of(address)[:2]
    assert tensor.sum().item() == 3.0 * tensor.numel()
    del tensor
    gc.collect()
    mapping = _mapping_of(address)  # reading smaps may map a buffer of its own there
    assert mapping is None or mapping[:2] != span  # unmapped with the last tensor


def test_the_memory_is_in_huge_pages_where_the_kernel_allows():
    arena = Arena([2 * HUGE_PAGE])
    tensor = arena.take((2 * HUGE_PAGE,), torch.uint8).fill_(1)  # touched after the advice
    block = _mapping_of(tensor.data_ptr())[2]
    huge_kb = int(re.search(r"AnonHugePages:\s+(\d+) kB", block).group(1))
    if _thp_mode() == "never":
        assert huge_kb == 0
    else:  # always / madvise: both 2 MiB-aligned pages of the tensor
        assert huge_kb >= 2 * HUGE_PAGE // 1024


def test_pack_into_an_arena_is_pack():
    weight = torch.randn(128, 96).bfloat16()
    arena = Arena([packed_linear.blocked_bytes(weight)])
    assert torch.equal(packed_linear.pack(weight, arena).packed, packed_linear.pack(weight).packed)
    assert packed_linear.blocked_bytes(torch.randn(128, 96)) == 0  # fp32 is never packed
