"""The C++ CPU kernels: loads the nanobind extension and registers its XLA FFI targets."""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

try:
  from jax_normgrad import _jax_normgrad as _ext
except ImportError as e:  # pragma: no cover - only in a broken install
  _ext = None
  _IMPORT_ERROR = e
else:
  _IMPORT_ERROR = None
  for _name, _capsule in _ext.registrations().items():
    jax.ffi.register_ffi_target(_name, _capsule, platform="cpu")

#: The custom-call targets this package registers (all CPU).
TARGETS = (
    "jax_normgrad_layer_norm_fwd",
    "jax_normgrad_layer_norm_bwd",
    "jax_normgrad_group_norm_fwd",
    "jax_normgrad_group_norm_apply",
    "jax_normgrad_group_norm_bwd",
)

EMPTY_F32 = np.zeros((0,), np.float32)

#: GroupNorm's fused activations as the handlers' ``activation`` attribute
#: (csrc/activation.h).
ACTIVATION_CODES = {None: 0, "silu": 1, "gelu": 2, "relu": 3}


def export_safety_checks() -> list:
  """The ``jax.export`` safety checks to disable for a function that runs these kernels.

  ``jax.export`` refuses custom calls it does not know to be stable; these
  targets are this package's own (CPU), registered again by
  ``import jax_normgrad`` in the process that deserializes and calls::

      exported = jax.export.export(jax.jit(f),
                                   disabled_checks=jax_normgrad.export_safety_checks())(*args)
      blob = exported.serialize()
      # later, after `import jax_normgrad`:
      jax.export.deserialize(blob).call(*args)

  Returns:
    ``[jax.export.DisabledSafetyCheck.custom_call(t) for t in TARGETS]``.
  """
  return [jax.export.DisabledSafetyCheck.custom_call(t) for t in TARGETS]


def available() -> bool:
  return _ext is not None


def import_error() -> ImportError | None:
  """Why the extension did not import (None where it did)."""
  return _IMPORT_ERROR


def isa() -> str | None:
  """The instruction set of the registered CPU kernels: "avx512bf16", "avx2" or "generic".

  The best build the CPU runs is chosen at import: "avx512bf16" (the AVX2
  kernels with AVX-512 BF16's bfloat16 rounding instruction), "avx2"
  (AVX2+FMA+F16C), "generic" (the baseline ISA). A source install has the
  generic build and the best one the building CPU runs; a wheel built with
  ``JAX_NORMGRAD_ISAS=all`` has all three (docs/development.md).
  ``JAX_NORMGRAD_ISA=avx2`` or ``=generic`` in the environment before import
  selects that build instead (for tests and comparisons); where the install
  has no such build or the CPU does not run it, the import raises ValueError.
  """
  return _ext.isa() if _ext is not None else None


def call(target: str, out_types: Sequence[jax.ShapeDtypeStruct], *operands, **attrs):
  """Calls an FFI target; attribute types are made exact here.

  The handlers bind float attributes as f32 and integers as i64, so Python
  floats/ints are converted (a Python float would arrive as f64 and fail).
  """
  if _ext is None:
    raise RuntimeError(f"jax_normgrad's C++ extension failed to import: {_IMPORT_ERROR}")
  exact = {}
  for k, v in attrs.items():
    if isinstance(v, (bool, np.bool_)):
      exact[k] = bool(v)
    elif isinstance(v, float):
      exact[k] = np.float32(v)
    elif isinstance(v, int):
      exact[k] = np.int64(v)
    else:
      exact[k] = v
  operands = [EMPTY_F32 if o is None else o for o in operands]
  return jax.ffi.ffi_call(target, list(out_types), vmap_method=None)(*operands, **exact)
