"""Argument checks and dtype rules shared by every public entry point.

Every check runs at trace time (shapes and dtypes are static), names the
argument and gives the expected and the actual value: ``ValueError`` for shapes
and values, ``TypeError`` for dtypes and wrong kinds of argument.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

#: The dtypes the kernels compute on (always accumulating in float32).
SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
F32 = jnp.dtype(jnp.float32)

#: Implementation names accepted by every public function's ``implementation``.
IMPLEMENTATIONS = (None, "xla", "ffi", "pallas", "triton", "mosaic_gpu", "mosaic_tpu")


def _dtype_names(dtypes: Sequence[Any]) -> str:
  return ", ".join(str(jnp.dtype(d)) for d in dtypes)


def as_array(name: str, value: Any) -> jax.Array:
  """Returns ``value`` as a JAX array; ``TypeError`` for None or non-arrays."""
  if value is None:
    raise TypeError(f"{name}: expected an array, got None")
  if isinstance(value, (jax.Array, np.ndarray, np.generic, numbers.Number)) or hasattr(value, "__jax_array__"):
    # Refuse float64 before jnp.asarray would silently narrow it (x64 off).
    if getattr(value, "dtype", None) == np.float64:
      raise TypeError(f"{name}: expected dtype in ({_dtype_names(SUPPORTED_DTYPES)}), got float64 "
                      "(float64 is not supported by the kernels: cast to float32)")
    return jnp.asarray(value)
  raise TypeError(f"{name}: expected an array, got {type(value).__name__}")


def optional_array(name: str, value: Any) -> jax.Array | None:
  return None if value is None else as_array(name, value)


def check_float_dtype(name: str, arr: jax.Array) -> None:
  """The kernels take float32, float16 and bfloat16."""
  if arr.dtype not in SUPPORTED_DTYPES:
    hint = " (float64 is not supported by the kernels: cast to float32)" if arr.dtype == np.float64 else ""
    raise TypeError(
        f"{name}: expected dtype in ({_dtype_names(SUPPORTED_DTYPES)}), got {arr.dtype}{hint}")


def check_same_dtype(name: str, arr: jax.Array, ref_name: str, ref: jax.Array) -> None:
  if arr.dtype != ref.dtype:
    raise TypeError(f"{name}: expected dtype {ref.dtype} (the dtype of {ref_name}), got {arr.dtype}")


def check_stats_dtype(name: str, stats: jax.Array, x: jax.Array) -> None:
  """Statistics are float32 or x's dtype; never narrower than x."""
  allowed = {F32, x.dtype}
  if stats.dtype not in allowed:
    raise TypeError(
        f"{name}: expected dtype float32 or {x.dtype} (x's dtype; statistics may not be narrower "
        f"than x), got {stats.dtype}")


def check_param_dtype(name: str, param: jax.Array, x: jax.Array) -> None:
  """Parameters are in x's dtype or float32 (mixed precision)."""
  if param.dtype not in {F32, x.dtype}:
    raise TypeError(f"{name}: expected dtype {x.dtype} (x's dtype) or float32, got {param.dtype}")


def check_out_dtype(out_dtype: Any, x: jax.Array, name: str = "out_dtype", *,
                    narrowing: bool = False) -> Any:
  """A layer's result dtype: None or x's dtype (returned as None), or float32.

  float32 with a 16-bit x is the mixed precision of a float32 model with
  16-bit activations: y in float32, rounded once, and x never copied to
  float32. ``narrowing`` (LayerNorm, RMSNorm): also bfloat16 or float16
  with a float32 x, the norm of a float32 residual stream feeding 16-bit
  matmuls: y computed in float32 and rounded once to the 16-bit dtype by
  the kernel, no float32 y written. Other combinations would round twice or
  need another kernel. ``name``: the argument checked (``residual_dtype`` of
  the residual form takes the same values, without narrowing).
  """
  allowed = f"None, {x.dtype} (x's dtype) or float32" + (
      ", or with a float32 x bfloat16 or float16" if narrowing else "")
  if out_dtype is None:
    return None
  try:
    dt = jnp.dtype(out_dtype)
  except TypeError:
    raise TypeError(f"{name}: expected {allowed}, got {out_dtype!r}") from None
  if dt == x.dtype:
    return None
  if dt == F32 or (narrowing and x.dtype == F32 and dt in (jnp.dtype(jnp.bfloat16),
                                                           jnp.dtype(jnp.float16))):
    return dt
  raise TypeError(f"{name}: expected {allowed}, got {dt}")


def check_params_share_dtype(weight_name: str, weight, bias_name: str, bias) -> None:
  if weight is not None and bias is not None and weight.dtype != bias.dtype:
    raise TypeError(
        f"{bias_name}: expected dtype {weight.dtype} (the dtype of {weight_name}), got {bias.dtype}")


def param_grad_dtype(weight, bias, x) -> jnp.dtype:
  """dtype of grad_weight/grad_bias: weight's, else bias's, else x's."""
  for p in (weight, bias):
    if p is not None:
      return p.dtype
  return x.dtype


def check_shape(name: str, arr: jax.Array, expected: Sequence[int], what: str = "") -> None:
  if tuple(arr.shape) != tuple(expected):
    suffix = f" ({what})" if what else ""
    raise ValueError(f"{name}: expected shape {tuple(expected)}{suffix}, got {tuple(arr.shape)}")


def check_size(name: str, arr: jax.Array, expected: int, what: str) -> None:
  if arr.size != expected:
    raise ValueError(
        f"{name}: expected {expected} elements ({what}), got {arr.size} (shape {tuple(arr.shape)})")


def check_int(name: str, value: Any, minimum: int) -> int:
  if isinstance(value, bool) or not isinstance(value, (numbers.Integral, np.integer)):
    raise TypeError(f"{name}: expected a Python int, got {type(value).__name__}")
  value = int(value)
  if value < minimum:
    raise ValueError(f"{name}: expected an integer >= {minimum}, got {value}")
  return value


def _static_float(name: str, value: Any) -> float:
  if isinstance(value, jax.core.Tracer):
    raise TypeError(f"{name}: expected a static Python float, got a traced value")
  if isinstance(value, bool) or not isinstance(value, (numbers.Real, np.floating, np.integer)):
    raise TypeError(f"{name}: expected a float, got {type(value).__name__}")
  return float(value)


def check_eps(eps: Any, name: str = "eps") -> float:
  eps = _static_float(name, eps)
  if not math.isfinite(eps) or eps < 0:
    raise ValueError(f"{name}: expected a finite float >= 0, got {eps}")
  return eps


def check_scale_offset(scale_offset: Any, weight: jax.Array | None) -> float:
  """A static finite float; non-zero only with a weight (it shifts the weight)."""
  offset = _static_float("scale_offset", scale_offset)
  if not math.isfinite(offset):
    raise ValueError(f"scale_offset: expected a finite float, got {offset}")
  if offset != 0.0 and weight is None:
    raise ValueError(
        f"scale_offset: expected 0.0 without a weight (the offset is added to the weight), "
        f"got {offset} with weight=None")
  return offset


#: What the differentiable LayerNorm may save for its backward.
SAVE_MODES = ("input", "normalized")


def check_save(save: Any) -> str:
  if save not in SAVE_MODES:
    raise ValueError(f"save: expected one of {SAVE_MODES}, got {save!r}")
  return save


def check_output_mask(output_mask: Any, length: int = 3) -> tuple[bool, ...]:
  if output_mask is None or isinstance(output_mask, (str, bytes)) or not isinstance(
      output_mask, (Sequence, np.ndarray)):
    raise TypeError(f"output_mask: expected a sequence of {length} bools, got {output_mask!r}")
  mask = tuple(output_mask)
  if len(mask) != length:
    raise ValueError(f"output_mask: expected length {length}, got length {len(mask)}")
  for i, m in enumerate(mask):
    if not isinstance(m, (bool, np.bool_)):
      raise TypeError(f"output_mask[{i}]: expected a bool, got {type(m).__name__}")
  return tuple(bool(m) for m in mask)


def check_implementation(implementation: Any) -> str | None:
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(
        f"implementation: expected one of {IMPLEMENTATIONS}, got {implementation!r}")
  return implementation


#: The layers' ``forward`` option: None (the platform's default), the kernel, or XLA's jnp forward.
FORWARD_MODES = (None, "kernel", "xla")


def check_forward(forward: Any) -> str:
  """A layer's ``forward`` option as its primitive parameter: "kernel", "xla" or "auto" (None)."""
  if forward not in FORWARD_MODES:
    raise ValueError(f"forward: expected one of {FORWARD_MODES}, got {forward!r}")
  return "auto" if forward is None else forward


def check_activation(activation: Any) -> str | None:
  """None or the name of a fusable activation (``_activations.ACTIVATIONS``)."""
  from jax_normgrad._activations import ACTIVATIONS  # pylint: disable=g-import-not-at-top
  if activation is not None and not isinstance(activation, str):
    raise TypeError(f"activation: expected None or a str, one of {ACTIVATIONS}, got "
                    f"{type(activation).__name__} {activation!r}")
  if activation is not None and activation not in ACTIVATIONS:
    raise ValueError(f"activation: expected None or one of {ACTIVATIONS}, got {activation!r}")
  return activation


def normalized_shape_of(normalized_shape: Any, x: jax.Array, name: str = "normalized_shape",
                        x_name: str = "x") -> tuple[int, ...]:
  """Checks ``normalized_shape`` against x: non-empty, trailing dims of x.

  ``None`` means ``x.shape[-1:]``; an int means ``(int,)``. ``x_name`` names
  x in the messages.
  """
  if normalized_shape is None:
    if x.ndim < 1:
      raise ValueError(f"{x_name}: expected at least 1 dimension, got shape {tuple(x.shape)}")
    return tuple(x.shape[-1:])
  if isinstance(normalized_shape, (numbers.Integral, np.integer)) and not isinstance(normalized_shape, bool):
    shape = (int(normalized_shape),)
  elif isinstance(normalized_shape, (Sequence, np.ndarray)) and not isinstance(normalized_shape, (str, bytes)):
    shape = tuple(normalized_shape)
    for i, d in enumerate(shape):
      if isinstance(d, bool) or not isinstance(d, (numbers.Integral, np.integer)):
        raise TypeError(f"{name}[{i}]: expected an int, got {type(d).__name__}")
    shape = tuple(int(d) for d in shape)
  else:
    raise TypeError(f"{name}: expected an int or a tuple of ints, got {type(normalized_shape).__name__}")
  if len(shape) < 1:
    raise ValueError(f"{name}: expected at least 1 dimension, got {shape}")
  if x.ndim < len(shape):
    raise ValueError(
        f"{x_name}: expected at least {len(shape)} dimensions (len({name})), got shape "
        f"{tuple(x.shape)}")
  if tuple(x.shape[x.ndim - len(shape):]) != shape:
    raise ValueError(
        f"{x_name}: trailing dimensions {tuple(x.shape[x.ndim - len(shape):])} do not match "
        f"{name} {shape}")
  return shape


def check_row_stats_shape(name: str, stats: jax.Array, x_name: str, x: jax.Array) -> None:
  """Per-row statistics over x's last axis: shape ``x.shape[:-1]`` or ``x.shape[:-1] + (1,)``."""
  lead = tuple(x.shape[:-1])
  if tuple(stats.shape) not in (lead, lead + (1,)):
    raise ValueError(
        f"{name}: expected shape {lead} or {lead + (1,)} ({x_name}.shape[:-1], one per row), "
        f"got {tuple(stats.shape)}")


def check_same_shape(name: str, arr: jax.Array, ref_name: str, ref: jax.Array) -> None:
  if arr.shape != ref.shape:
    raise ValueError(
        f"{name}: expected shape {tuple(ref.shape)} (the shape of {ref_name}), got {tuple(arr.shape)}")


def check_positive_size(name: str, size: int, what: str) -> None:
  if size <= 0:
    raise ValueError(f"{name}: expected a positive {what}, got {size}")
