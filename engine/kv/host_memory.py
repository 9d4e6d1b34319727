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
