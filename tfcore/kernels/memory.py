"""The C library's malloc settings that a training process may choose (glibc only)."""
from __future__ import annotations


def set_malloc_thresholds(mmap_bytes: int, trim_bytes: int) -> bool:
    """glibc's malloc: blocks of mmap_bytes or more are mapped on their own and handed back
    at once when freed (M_MMAP_THRESHOLD, which also stops its own adjustment), and the heap
    is trimmed when trim_bytes lie free at its top (M_TRIM_THRESHOLD). The whole process's
    setting; True when set, False where there is no glibc."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(libc.mallopt(m_mmap_threshold, mmap_bytes)
                and libc.mallopt(m_trim_threshold, trim_bytes))


def keep_freed_memory() -> bool:
    """Ask the C library's malloc (glibc) to keep freed memory for reuse rather than hand it
    back to the system: blocks up to 32 MiB come from the heap and the heap is never trimmed
    (set_malloc_thresholds).

    A training step frees and allocates the same arrays every step. Handed back, their pages
    are faulted in again at the next step: on a quiet 2-core virtual machine that was a
    quarter of the tiny benchmark model's step (21 ms against 16 ms at 1 thread). Resident
    memory then stays at its high-water mark. The setting is the whole process's: the
    training and benchmark commands (python -m tfcore.train, tfcore.bench, tfcore.parallel)
    call this at their start; a program of your own may too. Returns True when set, False
    where there is no glibc."""
    return set_malloc_thresholds(32 * 2 ** 20, 2 ** 31 - 1)
