"""The process-wide settings: two environment variables, read once and fixed from the first trace.

``JAX_NORMGRAD_FORWARD`` ("kernel" or "xla"; unset: ``LAYER_FORWARD_DEFAULT``)
is what a layer's ``forward=None`` runs, so that models built from the
drop-ins or ``patch()`` switch forwards without a change to their code.
``JAX_NORMGRAD_GPU_BACKEND`` ("triton" or "mosaic_gpu"; unset: "triton") is
the Pallas GPU backend that ``implementation=None`` and ``"pallas"`` prefer
on CUDA (``_dispatch``).

Both change what a primitive lowers to, and jit's cache does not see the
environment: a function traced before a change would keep the old choice
while a new trace took the new one. So the first trace of any op of this
package reads them (``current``), and every later trace and lowering checks
that they still read the same, raising :class:`SettingsChangedError` where
they do not. Per call, the same choices are static arguments of the traced
call: ``forward=`` and ``implementation=`` of every op and layer.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import types

#: What a layer's ``forward=None`` (with ``implementation=None``) runs, per platform: "kernel"
#: (the forward kernel, as ``forward="kernel"``) or "xla" (the jnp forward, which XLA fuses with
#: the ops around it, as ``forward="xla"``). The backward is the kernel either way. Chosen by the
#: in-model benchmarks (BENCHMARKS.md, "norms inside models").
LAYER_FORWARD_DEFAULT = types.MappingProxyType(
    {"cpu": "kernel", "cuda": "kernel", "rocm": "kernel", "tpu": "kernel"})

#: The environment variable that replaces ``LAYER_FORWARD_DEFAULT`` on every platform.
FORWARD_ENV = "JAX_NORMGRAD_FORWARD"
#: The environment variable naming the Pallas GPU backend preferred on CUDA.
GPU_BACKEND_ENV = "JAX_NORMGRAD_GPU_BACKEND"
#: The values of each variable (unset or empty: the default).
CHOICES = {FORWARD_ENV: ("kernel", "xla"), GPU_BACKEND_ENV: ("triton", "mosaic_gpu")}


class SettingsChangedError(ValueError):
  """A setting of :mod:`jax_normgrad._settings` changed after the first trace."""


@dataclasses.dataclass(frozen=True)
class Settings:
  """The environment's choices; None where a variable is unset."""

  forward: str | None = None
  gpu_backend: str | None = None

  def layer_forward(self, platform: str) -> str:
    """What a layer's ``forward=None`` runs on ``platform``: "kernel" or "xla"."""
    return self.forward or LAYER_FORWARD_DEFAULT.get(platform, "kernel")

  def describe(self) -> str:
    return ", ".join(f"{name}={value!r}" for name, value in self.variables().items())

  def variables(self) -> dict[str, str | None]:
    return {FORWARD_ENV: self.forward, GPU_BACKEND_ENV: self.gpu_backend}


def read() -> Settings:
  """The settings as the environment says now (ValueError for a value not in ``CHOICES``)."""
  values = {}
  for name, choices in CHOICES.items():
    value = os.environ.get(name, "") or None
    if value is not None and value not in choices:
      raise ValueError(f"{name}: expected one of {choices} (or unset), got {value!r}")
    values[name] = value
  return Settings(forward=values[FORWARD_ENV], gpu_backend=values[GPU_BACKEND_ENV])


_LOCK = threading.Lock()
_fixed: Settings | None = None


def current() -> Settings:
  """The settings fixed at the first trace; raises if the environment has changed since."""
  global _fixed  # pylint: disable=global-statement
  now = read()
  with _LOCK:
    if _fixed is None:
      _fixed = now
    fixed = _fixed
  if now != fixed:
    changed = [f"{name} from {old!r} to {new!r}"
               for (name, old), new in zip(fixed.variables().items(),
                                           now.variables().values()) if old != new]
    raise SettingsChangedError(
        f"jax_normgrad: {', '.join(changed)} after the first trace of this process: functions "
        f"traced before keep {fixed.describe()} while new ones would not. Set these variables "
        f"before the first call, or pass forward= / implementation= to the ops and layers.")
  return fixed


def reset() -> None:
  """Forgets the fixed settings, and jax's compiled functions with them (tests)."""
  global _fixed  # pylint: disable=global-statement
  import jax  # pylint: disable=g-import-not-at-top
  with _LOCK:
    _fixed = None
  jax.clear_caches()
