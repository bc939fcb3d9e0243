"""How the kernels' configuration and device figures are changed for what is traced.

:func:`override` changes them for what is traced inside it: the changes are
a jax user context (part of jit's cache key: a function called inside the
block is traced again), and each op traced there carries them as its static
``tuning`` parameter (``primitives._common``), a sorted tuple of
``(field, value)`` pairs. The op's lowering applies them with
:func:`lowering`, which pushes the op's configuration, with the figures of
the device of the platform being lowered (``device.for_platform``), on a
stack of this thread; the plans of ``config`` read the top of that stack
(:func:`triton`, :func:`mosaic_gpu`, :func:`mosaic_tpu`, :func:`device`),
else the :func:`override` blocks in force, else the defaults.

What may be changed: any field of ``backend_config.TritonConfig``,
``MosaicGpuConfig``, ``MosaicTpuConfig`` and ``device.Device``, by name, or
a whole configuration, by passing such a value (:data:`KEYS`: the names;
``interpret_programs``: the persistent programs of the interpreter).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from typing import Any, Iterator

import jax

from jax_normgrad.pallas import device as device_figures
from jax_normgrad.pallas.backend_config import (BACKENDS, MosaicGpuConfig, MosaicTpuConfig,
                                                TritonConfig, Tuning, field_names)
from jax_normgrad.pallas.device import Device

#: Persistent programs of the interpreter (CPU tests): few, to keep it fast,
#: more than one so that the partial sums and their reduction are exercised.
INTERPRET_PROGRAMS = 3

#: The owner of each field that can be changed: a part of :class:`Tuning`, or "device".
_OWNER = {name: part for part, cls in BACKENDS.items() for name in field_names(cls)}
_OWNER.update({name: "device" for name in field_names(Device)})
#: The names :func:`override` takes.
KEYS = frozenset(_OWNER) | {"interpret_programs"}
#: The values :func:`override` takes whole.
VALUES = (TritonConfig, MosaicGpuConfig, MosaicTpuConfig, Device)


@dataclasses.dataclass(frozen=True)
class _Context:
  tuning: Tuning = Tuning()
  device: Device = Device()
  interpret_programs: int = INTERPRET_PROGRAMS


#: The changes of the :func:`override` blocks in force: a jax user context, so part of jit's
#: cache keys (a function called inside a block is traced and lowered with its changes).
_OVERRIDES = jax.make_user_context(default_value=())
#: The contexts of the ops being lowered on this thread (:func:`lowering`).
_LOCAL = threading.local()


def _context() -> _Context:
  stack = getattr(_LOCAL, "stack", None)
  return stack[-1] if stack else _overridden(traced_overrides())


@functools.lru_cache(maxsize=64)
def _overridden(changes) -> _Context:
  return _with(_Context(), changes)


def current() -> Tuning:
  """The configuration in force: the defaults, or that of the op being lowered."""
  return _context().tuning


def triton() -> TritonConfig:
  return _context().tuning.triton


def mosaic_gpu() -> MosaicGpuConfig:
  return _context().tuning.mosaic_gpu


def mosaic_tpu() -> MosaicTpuConfig:
  return _context().tuning.mosaic_tpu


def device() -> Device:
  """The figures of the device the op being lowered compiles for (an H100's outside a lowering)."""
  return _context().device


def interpret_programs() -> int:
  return _context().interpret_programs


def _with(context: _Context, changes) -> _Context:
  by_owner: dict[str, dict[str, Any]] = {}
  programs = context.interpret_programs
  for key, value in changes:
    if key == "interpret_programs":
      programs = value
    elif key in _OWNER:
      by_owner.setdefault(_OWNER[key], {})[key] = value
    else:
      raise TypeError(f"config.override: no setting named {key!r}")
  tuning = dataclasses.replace(context.tuning, **{
      part: dataclasses.replace(getattr(context.tuning, part), **fields)
      for part, fields in by_owner.items() if part != "device"})
  device_ = dataclasses.replace(context.device, **by_owner.get("device", {}))
  return _Context(tuning, device_, programs)


def traced_overrides() -> tuple[tuple[str, Any], ...]:
  """The changes of the :func:`override` blocks in force, as a hashable value."""
  return _OVERRIDES.value


def changes_of(*values, **changes) -> dict[str, Any]:
  """The ``(field, value)`` changes of :func:`override`'s arguments: every field of each value
  (a ``TritonConfig``, ``MosaicGpuConfig``, ``MosaicTpuConfig`` or ``Device``), then ``changes``."""
  merged = {}
  for value in values:
    if not isinstance(value, VALUES):
      raise TypeError(f"config.override: expected a value of {[c.__name__ for c in VALUES]} "
                      f"or fields by name, got {value!r}")
    merged.update((f.name, getattr(value, f.name)) for f in dataclasses.fields(value))
  merged.update(changes)
  return merged


@contextlib.contextmanager
def override(*values, **changes) -> Iterator[Tuning]:
  """Changes the configuration, device figures or ``interpret_programs`` for what is traced inside.

  ``values``: whole configurations (``TritonConfig(...)``, ``MosaicGpuConfig(...)``,
  ``MosaicTpuConfig(...)``, ``Device(...)``), each setting every field of its
  kind; ``changes``: single fields by name, applied after them. Blocks nest,
  the inner one's changes over the outer's. The changes are part of jit's
  cache key (a function called inside the block is traced again), and the ops
  traced inside carry them as their static ``tuning`` parameter
  (``primitives._common``), which their lowering applies; :func:`current` and
  the plans read them inside the block too. Yields the configuration in force.
  """
  merged = tuple(sorted({**dict(traced_overrides()), **changes_of(*values, **changes)}.items()))
  context = _overridden(merged)  # checks the names
  with _OVERRIDES(merged):
    yield context.tuning


@contextlib.contextmanager
def lowering(changes, platform: str):
  """The plans of an op lowered for ``platform`` with its ``tuning`` parameter's ``changes``."""
  context = _with(_Context(device=device_figures.for_platform(platform)), tuple(changes))
  _LOCAL.stack = getattr(_LOCAL, "stack", ()) + (context,)
  try:
    yield
  finally:
    _LOCAL.stack = _LOCAL.stack[:-1]
