"""K/V in host memory that costs resident pages only for the rows a slot has held.

`torch.zeros` writes every byte of a buffer, so a slot's whole context (360 MiB for the bundled model's 8192
tokens in float32) was resident from the start. An anonymous memory map is zero-filled by the kernel page by page
on first write instead: K/V costs RSS in proportion to the tokens the slots have held. Zeroing a slot gives its
whole pages back to the kernel (`MADV_DONTNEED`; a private anonymous page then reads as zero again) and writes
zeros only into the partial pages at the edges. Where `madvise` is missing (Windows), it falls back to writing
zeros and to `torch.zeros`.
"""

from __future__ import annotations

import math
import mmap
from typing import Any

import torch

PAGE = mmap.PAGESIZE
_CAN_DROP = all(hasattr(mmap, n) for n in ("MADV_DONTNEED", "MAP_PRIVATE", "MAP_ANONYMOUS")) and hasattr(mmap.mmap, "madvise")


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, mmap.mmap | None]:
    """A zeroed CPU tensor backed by an anonymous map (and the map), or by `torch.zeros` (and None)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if not _CAN_DROP or nbytes < 16 * PAGE:
        return torch.zeros(shape, dtype=dtype), None
    # private: a page never written reads as the shared zero page (a shared map would allocate it on read),
    # and MADV_DONTNEED really frees a written one
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # The tensor holds the buffer (and so the map) alive; writes go straight to the mapped pages.
    tensor = torch.frombuffer(region, dtype=torch.uint8).view(dtype).view(shape)
    return tensor, region


def zero_span(tensor: torch.Tensor, region: mmap.mmap | None, view: torch.Tensor) -> None:
    """Zero `view`, a contiguous piece of `tensor`: whole pages are dropped from the map, edges written."""
    assert view.is_contiguous() and view.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()
    if region is None:
        view.zero_()
        return
    size = tensor.element_size()
    start = view.storage_offset() * size
    end = start + view.numel() * size
    first, last = -(-start // PAGE) * PAGE, end // PAGE * PAGE
    flat = tensor.view(-1).view(torch.uint8)
    if last <= first:
        flat[start:end].zero_()
        return
    flat[start:first].zero_()
    flat[last:end].zero_()
    region.madvise(mmap.MADV_DONTNEED, first, last - first)


MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault pages in, writable, without changing what they hold
_libc_madvise = None
_can_populate = _CAN_DROP and hasattr(mmap, "MADV_HUGEPAGE")  # Linux: the only madvise with POPULATE_WRITE


def populate(view: torch.Tensor) -> bool:
    """Make the whole pages of `view` (contiguous, in a lazy_zeros map) resident, so a later copy into them pays
    no page faults (on this machine they made a 114 MiB copy take 354 ms instead of 66 ms). Their content is
    unchanged (still zeros, or what was written). Any thread: the call releases the GIL (ctypes). False where
    the kernel has no MADV_POPULATE_WRITE (nothing is done; the copy then faults the pages in as before)."""
    global _libc_madvise, _can_populate
    assert view.is_contiguous()
    if not _can_populate:
        return False
    if _libc_madvise is None:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).madvise
        fn.argtypes, fn.restype = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int
        _libc_madvise = fn
    start = view.data_ptr()
    end = start + view.numel() * view.element_size()
    first, last = -(-start // PAGE) * PAGE, end // PAGE * PAGE
    if last <= first:
        return True
    if _libc_madvise(first, last - first, MADV_POPULATE_WRITE) != 0:
        _can_populate = False  # an older kernel (EINVAL): stop asking
        return False
    return True


_malloc_trim: Any = None  # glibc's malloc_trim once looked up, False where there is none


def return_free_memory() -> bool:
    """Give the C heap's free pages back to the system (glibc's malloc_trim). A parked copy freed after its disk
    write otherwise stays in the engine's RSS: glibc raises its mmap threshold after large frees, so such copies
    come from the heap, whose free pages it keeps. False where there is no glibc (Windows, musl, macOS)."""
    global _malloc_trim
    if _malloc_trim is None:
        import ctypes

        try:
            fn = ctypes.CDLL(None).malloc_trim
            fn.argtypes, fn.restype = (ctypes.c_size_t,), ctypes.c_int
            _malloc_trim = fn
        except (AttributeError, OSError, TypeError):  # no such symbol; no C library handle (Windows)
            _malloc_trim = False
    if _malloc_trim is False:
        return False
    _malloc_trim(0)
    return True
