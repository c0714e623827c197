"""Memory in transparent huge pages (2 MiB) for the weights the CPU kernels stream.

A decode step of a few rows reads every packed weight once, front to back: in 4 KiB pages
that is a TLB miss every 4 KiB and a stop for the hardware's prefetchers at each page's end.
In 2 MiB pages the bf16 linears of SmolLM2's 30 layers (212 MB, AVX2 host, 2 threads, the
same weights in both kinds of page, alternated in one process) streamed at 19-20 GB/s where
they had 17-18: 1.08-1.11x at 1-6 rows, the same at 16-32 (bound by the FMAs there).

Linux gives a private anonymous mapping huge pages when it is advised MADV_HUGEPAGE before it
is touched, where THP is `always` or `madvise` (/sys/kernel/mm/transparent_hugepage/enabled,
`madvise` on most distributions). Where it is `never`, the kernel has no THP, or the OS no
MADV_HUGEPAGE, the memory is ordinary pages and nothing else changes.
"""

from __future__ import annotations

import contextlib
import math
import mmap
from collections.abc import Iterable

import torch

HUGE_PAGE = 2 << 20
ALIGN = 64  # bytes: each tensor starts on a cache line


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class Arena:
    """One mapping with room for tensors of the given sizes (bytes), handed out front to back
    (`take`). Each tensor taken holds the mapping: it is unmapped when the last of them is
    freed, not with the arena."""

    def __init__(self, sizes: Iterable[int]) -> None:
        nbytes = sum(_aligned(size) for size in sizes)
        self._free = torch.empty(0, dtype=torch.uint8)
        if nbytes > 0 and hasattr(mmap, "MADV_HUGEPAGE"):
            mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            with contextlib.suppress(OSError):  # EINVAL: a kernel built without THP
                mapping.madvise(mmap.MADV_HUGEPAGE)
            raw = torch.frombuffer(mapping, dtype=torch.uint8)
            start = -raw.data_ptr() % HUGE_PAGE  # huge pages lie on 2 MiB boundaries
            self._free = raw[start:start + nbytes]

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized contiguous tensor from the arena, or from torch's allocator once the
        arena is spent."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes > self._free.numel():
            return torch.empty(shape, dtype=dtype)
        out = self._free[:nbytes].view(dtype).view(shape)
        self._free = self._free[min(_aligned(nbytes), self._free.numel()):]
        return out
