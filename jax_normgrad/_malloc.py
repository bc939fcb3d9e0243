"""Opt-in glibc malloc setting that keeps freed memory for reuse: large buffers without fresh page faults."""

from __future__ import annotations

import ctypes
import platform
import sys

# mallopt parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8


def keep_freed_memory() -> bool:
  """Makes glibc's malloc reuse freed memory instead of returning it to the OS.

  XLA allocates a fresh buffer for every output and temporary. glibc serves
  blocks of 32 MiB or more with their own ``mmap`` and unmaps them on
  ``free``, so each call of a jitted step touches new pages: the kernel
  zeroes them on first touch, and on the 2-core benchmark machine that costs
  more than the normalization kernels themselves (an 8192x1024 float32
  LayerNorm backward: 8.9 ms against 3.3 ms, see BENCHMARKS.md). This call
  sets ``M_MMAP_MAX = 0`` (no per-block ``mmap``), ``M_TRIM_THRESHOLD =
  2 GiB`` (free memory at the top of the heap is kept) and ``M_ARENA_MAX =
  1`` (XLA's worker threads allocate from the main heap too: a thread
  arena's heap is unmapped whenever it empties, whatever the trim
  threshold), the in-process equivalent of ``GLIBC_TUNABLES=
  glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647:glibc.malloc.arena_max=1``.

  It changes the allocator of the whole process (NumPy, PyTorch and
  everything else too), from the next allocation on, for the rest of the
  process. The price: the process keeps its peak heap size instead of
  giving memory back, and threads that allocate concurrently share one
  heap lock. Nothing in jax_normgrad calls it: it is the user's choice.

  Returns:
    True when applied; False where the C library is not glibc (Linux with
    musl, macOS, Windows): nothing is changed there.
  """
  if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
    return False
  libc = ctypes.CDLL(None)
  mallopt = libc.mallopt
  mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
  mallopt.restype = ctypes.c_int
  # mallopt returns 1 on success.
  return all([mallopt(_M_MMAP_MAX, 0), mallopt(_M_TRIM_THRESHOLD, 2**31 - 1),
              mallopt(_M_ARENA_MAX, 1)])
