"""Hand the pages under a range of memory back to the kernel without changing a value in it (Linux).

    hand_back(address, nbytes)    # the whole pages inside [address, address + nbytes)
    hand_back(address, nbytes, around=FAULT_AROUND)   # and the file pages near it a read mapped back

A page of a file's memory map that was never written (a checkpoint's blocks) holds the file's bytes:
the process drops it (madvise MADV_DONTNEED) and a later read faults it back in from the page cache
or the file. MADV_PAGEOUT, asked first, also evicts it from the page cache, but the kernel skips a
page another process maps too (a second `gen` on the same file): those stayed resident, so the
pages still mapped afterwards are dropped. Which ones are a file's, and which anonymous (copies, a
private map's written pages: values no file holds), /proc/self/pagemap says per page; anonymous pages
are only paged out (to swap, where there is any), never dropped.
"""
from __future__ import annotations

import ctypes
import mmap
import sys
import threading

PAGE = mmap.PAGESIZE
_LINUX = sys.platform.startswith("linux")
MADV_PAGEOUT = getattr(mmap, "MADV_PAGEOUT", 21 if _LINUX else None)    # 21: Linux's value (5.4+)
MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", 4 if _LINUX else None)
# /proc/PID/pagemap, one u64 per page (Documentation/admin-guide/mm/pagemap.rst)
PRESENT_BIT, FILE_BIT = 63, 61   # the page is present; it is a file page or shared memory


def file_page_runs(start: int, end: int) -> list[tuple[int, int]]:
    """(address, length) of each run of present pages in [start, end) (page-aligned) that map a file's
    page (or shared memory), read from /proc/self/pagemap; [] where that cannot be read."""
    try:
        with open("/proc/self/pagemap", "rb") as f:
            f.seek(start // PAGE * 8)
            raw = f.read((end - start) // PAGE * 8)
    except OSError:
        return []
    if not raw:
        return []
    flags = (1 << PRESENT_BIT) | (1 << FILE_BIT)
    edges, inside = [], False
    for i, e in enumerate(memoryview(raw).cast("Q")):
        if ((e & flags) == flags) != inside:
            inside = not inside
            edges.append(i)
    if inside:
        edges.append(len(raw) // 8)
    return [(start + a * PAGE, (b - a) * PAGE) for a, b in zip(edges[::2], edges[1::2])]


FAULT_AROUND = 1 << 16   # a read fault of a file's page maps the page-cache pages of the 64 KB around it


def mapping_of(address: int) -> tuple[int, int] | None:
    """[start, end) of the mapping (/proc/self/maps) that holds `address`; None where none does."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                lo, _, rest = line.partition("-")
                hi = rest.split(" ", 1)[0]
                if int(lo, 16) <= address < int(hi, 16):
                    return int(lo, 16), int(hi, 16)
    except OSError:
        pass
    return None


def hand_back(address: int, nbytes: int, around: int = 0) -> bool:
    """Give back the whole pages inside [address, address + nbytes): paged out, then the ones still
    mapped that hold a file's bytes dropped (see the module docstring). No value ever changes.
    False where the platform cannot (not Linux, or no whole page inside and no `around`)."""
    if MADV_PAGEOUT is None or MADV_DONTNEED is None:
        return False
    start = -(-address // PAGE) * PAGE
    end = (address + nbytes) // PAGE * PAGE
    if end <= start and not around:
        return False
    libc = ctypes.CDLL(None, use_errno=True)

    def advise(at: int, n: int, advice: int) -> bool:
        return libc.madvise(ctypes.c_void_p(at), ctypes.c_size_t(n), ctypes.c_int(advice)) == 0

    ok = end > start and advise(start, end - start, MADV_PAGEOUT)
    lo, hi = start, max(start, end)
    if around:   # and the file pages next to it that a read of it mapped back (fault-around): dropped,
        where = mapping_of(address)   # even where no whole page lies inside (a norm's 2 KB)
        if where is not None:
            lo = min(lo, max(where[0], (start - around) // PAGE * PAGE))
            hi = max(hi, min(where[1], -(-(end + around) // PAGE) * PAGE))
    for at, n in file_page_runs(lo, hi):
        ok = advise(at, n, MADV_DONTNEED) or ok
    return ok


def resident_file_bytes(address: int, nbytes: int) -> int:
    """Bytes of the whole pages inside [address, address + nbytes) that are mapped and hold a file's
    bytes (what `hand_back` drops)."""
    start, end = -(-address // PAGE) * PAGE, (address + nbytes) // PAGE * PAGE
    return sum(n for _, n in file_page_runs(start, end)) if end > start else 0


def trim_heap(when_freed: bool = False) -> bool:
    """Return the C heap's free memory to the kernel (glibc's malloc_trim(0): the free pages inside
    the heap too, not only its top), after a load or copies made once leave freed temporaries behind.
    False where the C library has no malloc_trim (not glibc). `when_freed`: a trim because something
    was just freed (a prompt plan's scratch), skipped in a thread that `defer_trims()`: a trim costs
    1-6 ms, and a server's loop trims once per idle spell instead of once per admitted request."""
    global _malloc_trim
    if when_freed and getattr(_thread, "trims_deferred", False):
        return False
    if _malloc_trim is None:
        try:
            _malloc_trim = ctypes.CDLL(None).malloc_trim
        except (AttributeError, OSError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)   # (its result says whether any memory went back)
    return bool(_malloc_trim)


def defer_trims(on: bool = True) -> None:
    """In the calling thread, skip the trims made when something is freed (`trim_heap(when_freed=True)`)."""
    _thread.trims_deferred = on


_thread = threading.local()
_malloc_trim = None
