"""The package's ``FallbackWarning``: no fallback is silent.

Below every module that falls back (the implementation choice, the Pallas
backend choice, the drop-in layers), so that each can announce it without
importing the others. ``jax_normgrad.FallbackWarning`` is this class.
"""

from __future__ import annotations

import functools
import warnings


class FallbackWarning(UserWarning):
  """Emitted when the default kernel cannot run a problem and another implementation runs it,
  once per message (``warn_once``): the message names the op, the platform and why."""


@functools.lru_cache(maxsize=None)
def warn_once(message: str) -> None:
  """A ``FallbackWarning``, once per message (``warn_once.cache_clear()`` forgets them)."""
  warnings.warn(message, FallbackWarning, stacklevel=3)
