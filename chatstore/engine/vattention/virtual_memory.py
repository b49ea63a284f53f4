"""Reserve address space, commit pages on demand, give them back: the OS as vAttention's driver.

    reserve   mmap(PROT_READ|PROT_WRITE, MAP_PRIVATE|MAP_ANONYMOUS|MAP_NORESERVE): no memory yet
    commit    madvise(MADV_POPULATE_WRITE) on a page-aligned range (touching on old kernels)
    release   madvise(MADV_DONTNEED): the pages go back to the OS; the range reads as zeros
    mapped    mincore(): which 4 KB base pages have a page table entry
    rss       /proc/self/smaps `Rss` of the mapping: the memory it holds. Unlike mincore this
              leaves out pages only read and never written, which map the shared zero page

With `huge=True` the range is advised MADV_HUGEPAGE; whether the kernel grants 2 MB pages shows
in /proc/self/smaps (`AnonHugePages` of the mapping), which `huge_page_bytes` reads.

This is the CPU implementation. On CUDA the same calls map onto the driver's virtual memory API
(cuMemAddressReserve / cuMemCreate / cuMemMap + cuMemSetAccess / cuMemUnmap + cuMemRelease);
that backend is not implemented here (no GPU on the build machine): `VirtualRegion` refuses any
device but the CPU.
"""

from __future__ import annotations

import ctypes
import mmap
import os

import torch

PROT_NONE, PROT_READ, PROT_WRITE = 0x0, 0x1, 0x2
MAP_PRIVATE, MAP_ANONYMOUS, MAP_NORESERVE = 0x02, 0x20, 0x4000
MADV_DONTNEED, MADV_HUGEPAGE, MADV_POPULATE_WRITE = 4, 14, 23
BASE_PAGE = mmap.PAGESIZE
HUGE_PAGE = 2 << 20
_MAP_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


class VirtualRegion:
    """One reserved range of address space, committed and released in page-aligned pieces."""

    def __init__(self, nbytes: int, page_size: int = BASE_PAGE, huge: bool = False) -> None:
        if page_size % BASE_PAGE:
            raise ValueError(f"page_size must be a multiple of {BASE_PAGE}, got {page_size}")
        self.page_size = page_size
        self.nbytes = -(-nbytes // page_size) * page_size
        flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE
        # Over-reserve so the base can be aligned to page_size (2 MB for huge pages) with at
        # least one PROT_NONE guard page either side: the kernel then never merges this mapping
        # with a neighbouring one, so its smaps entries are its own.
        self._raw_len = self.nbytes + page_size + BASE_PAGE
        raw = _libc.mmap(None, self._raw_len, PROT_READ | PROT_WRITE, flags, -1, 0)
        if raw in (None, _MAP_FAILED):
            err = ctypes.get_errno()
            raise OSError(err, f"mmap of {self._raw_len} bytes: {os.strerror(err)}")
        self._raw = raw
        self.address = -(-(raw + BASE_PAGE) // page_size) * page_size
        end = self.address + self.nbytes
        _check(_libc.mprotect(raw, self.address - raw, PROT_NONE), "mprotect")
        _check(_libc.mprotect(end, raw + self._raw_len - end, PROT_NONE), "mprotect")
        self.huge = huge
        if huge:
            _check(_libc.madvise(self.address, self.nbytes, MADV_HUGEPAGE), "madvise(HUGEPAGE)")
        self._populate = True  # MADV_POPULATE_WRITE until the kernel says it has none

    def tensor(self, dtype: torch.dtype) -> torch.Tensor:
        """A flat zero-copy tensor over the whole region (creating it commits nothing)."""
        buf = (ctypes.c_char * self.nbytes).from_address(self.address)
        return torch.frombuffer(buf, dtype=dtype)

    def commit(self, offset: int, length: int) -> None:
        """Make [offset, offset + length) resident (page-aligned, in bytes from the base)."""
        self._check_range(offset, length)
        if length == 0:
            return
        if self._populate:
            rc = _libc.madvise(self.address + offset, length, MADV_POPULATE_WRITE)
            if rc == 0:
                return
            if ctypes.get_errno() != 22:  # EINVAL: a kernel before 5.14
                _check(rc, "madvise(POPULATE_WRITE)")
            self._populate = False
        # Writing a zero byte per base page faults it in; the caller only commits pages that
        # hold no live KV yet, so the write clobbers nothing.
        ctypes.memset(self.address + offset, 0, 1)
        for p in range(offset + BASE_PAGE, offset + length, BASE_PAGE):
            ctypes.memset(self.address + p, 0, 1)

    def release(self, offset: int, length: int) -> None:
        """Give [offset, offset + length) back to the OS; it reads as zeros afterwards."""
        self._check_range(offset, length)
        if length:
            _check(_libc.madvise(self.address + offset, length, MADV_DONTNEED), "madvise")

    def mapped_bytes(self, offset: int = 0, length: int | None = None) -> int:
        """Bytes of [offset, offset + length) with a page mapped (mincore, 4 KB granular); a
        page only read maps the zero page and counts here, though it holds no memory."""
        length = self.nbytes - offset if length is None else length
        self._check_range(offset, length, BASE_PAGE)
        pages = length // BASE_PAGE
        if pages == 0:
            return 0
        vec = ctypes.create_string_buffer(pages)
        _check(_libc.mincore(self.address + offset, length, vec), "mincore")
        return sum(b & 1 for b in vec.raw) * BASE_PAGE

    def rss_bytes(self) -> int:
        """Memory the mapping holds (smaps Rss): what the committed pages really cost."""
        return self._smaps("Rss:")

    def huge_page_bytes(self) -> int:
        """AnonHugePages of this mapping in /proc/self/smaps: the 2 MB pages the kernel granted."""
        return self._smaps("AnonHugePages:")

    def _smaps(self, key: str) -> int:
        # madvise may split the mapping into several VMAs: sum those inside the usable range.
        lo, hi = self.address, self.address + self.nbytes
        total, inside = 0, False
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(" ", 1)[0]
                if "-" in head and not head.endswith(":"):
                    start, end = (int(x, 16) for x in head.split("-"))
                    inside = start < hi and end > lo
                elif inside and head == key:
                    total += int(line.split()[1]) * 1024
        return total

    def close(self) -> None:
        if self._raw is not None:
            _check(_libc.munmap(self._raw, self._raw_len), "munmap")
            self._raw = None

    def _check_range(self, offset: int, length: int, align: int | None = None) -> None:
        align = align or self.page_size
        if offset % align or length % align or offset < 0 or offset + length > self.nbytes:
            raise ValueError(
                f"range [{offset}, {offset + length}) is not {align}-aligned inside "
                f"[0, {self.nbytes})"
            )
