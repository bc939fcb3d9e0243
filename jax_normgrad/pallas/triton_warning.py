"""jax's Pallas Triton DeprecationWarning, ignored around the package's own GPU lowerings.

From jax 0.11 each lowering of a Pallas Triton kernel warns that the
backend is deprecated; the package chose the backend, so its users have
nothing to act on. :func:`quiet_lowering` wraps a CUDA or ROCm lowering
rule in :func:`triton_deprecation_ignored`, one ``warnings.filters`` entry
shared by the lowerings of all threads (reference-counted).
"""

from __future__ import annotations

import contextlib
import functools
import re
import threading
import warnings
from typing import Callable

from jax_normgrad import _platforms


#: The start of jax's DeprecationWarning at each lowering of a Pallas Triton kernel
#: (jax 0.11+, ``jax/_src/pallas/pallas_call.py``, deprecation "jax-pallas-triton"):
#: "The Pallas Triton backend is deprecated and will be removed in a future JAX version. ..."
TRITON_DEPRECATION = "The Pallas Triton backend is deprecated"

#: Our filter's pattern: that text, tagged (a regex comment) so that the entry is
#: ours alone, never equal to one a user added (jax's own tests add that text).
_FILTER_PATTERN = re.escape(TRITON_DEPRECATION) + "(?# jax_normgrad)"
_FILTER_LOCK = threading.Lock()
_filter_users = 0


@contextlib.contextmanager
def triton_deprecation_ignored():
  """Ignores jax's Pallas Triton DeprecationWarning (``TRITON_DEPRECATION``) inside the block.

  Around the package's own GPU lowerings (``quiet_lowering``): the package
  chose the backend, so its users have nothing to act on. Only that message
  and category; other warnings, and that one outside the block, are shown
  as before. One filter entry is shared by the blocks of all threads, put
  first in ``warnings.filters`` when the first block starts and removed when
  the last ends: ``warnings.catch_warnings`` saves and restores the whole
  list, so two lowerings overlapping in two threads could leave the filter
  behind, or drop one a user added meanwhile. (An ignored warning is not
  recorded in any ``__warningregistry__``, so removing the entry leaves no
  trace.)
  """
  global _filter_users  # pylint: disable=global-statement
  with _FILTER_LOCK:
    if _filter_users == 0:
      warnings.filterwarnings("ignore", message=_FILTER_PATTERN, category=DeprecationWarning)
    _filter_users += 1
  try:
    yield
  finally:
    with _FILTER_LOCK:
      _filter_users -= 1
      if _filter_users == 0:  # list.remove: one step, whatever other threads do to the list
        for entry in [f for f in warnings.filters if _is_ours(f)]:
          with contextlib.suppress(ValueError):
            warnings.filters.remove(entry)


def _is_ours(entry) -> bool:
  message = entry[1]
  return message is not None and message.pattern == _FILTER_PATTERN


def quiet_lowering(rule: Callable, platform: str) -> Callable:
  """The lowering rule ``rule``, on CUDA and ROCm run with ``triton_deprecation_ignored``.

  The Pallas Triton lowering, where jax 0.11+ warns, runs inside the rule
  (``mlir.lower_fun`` traces and lowers the kernels there).
  """
  if platform not in _platforms.GPUS:
    return rule

  @functools.wraps(rule)
  def quiet(*args, **kwargs):
    with triton_deprecation_ignored():
      return rule(*args, **kwargs)

  return quiet
