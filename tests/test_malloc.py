"""jax_normgrad.keep_freed_memory: the opt-in malloc setting really stops fresh-page faults."""

from __future__ import annotations

import platform
import subprocess
import sys
import textwrap

import pytest

import jax_normgrad as jn

_GLIBC = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"

# Faults of 20 allocate-touch-free cycles of a 64 MiB block (16,384 pages),
# after a first cycle, in a fresh interpreter.
_CHILD = textwrap.dedent("""
    import resource, sys
    import numpy as np
    import jax_normgrad as jn
    if sys.argv[1] == "1":
        assert jn.keep_freed_memory() is True
    def cycle():
        a = np.empty(1 << 24, np.float32)
        a.fill(1.0)
        del a
    cycle()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        cycle()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


def _faults(keep: bool) -> int:
  out = subprocess.run([sys.executable, "-c", _CHILD, "1" if keep else "0"], check=True,
                       capture_output=True, text=True, timeout=120)
  return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not _GLIBC, reason="glibc only")
def test_keep_freed_memory_stops_fresh_page_faults():
  # Without it every cycle maps fresh pages: at least 16,384 faults each
  # (fewer with transparent huge pages, so only the contrast is asserted).
  default, kept = _faults(False), _faults(True)
  assert kept < 1000, (default, kept)
  assert default > 10 * max(kept, 1), (default, kept)


def test_keep_freed_memory_reports_where_it_cannot_apply(monkeypatch):
  monkeypatch.setattr(sys, "platform", "darwin")
  assert jn.keep_freed_memory() is False
