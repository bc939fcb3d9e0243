"""Drop-in ``equinox.nn`` LayerNorm, GroupNorm and RMSNorm (subclasses of equinox's) whose backward runs the jax_normgrad kernels."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from jax_normgrad import _layers

# Subclassing equinox's classes keeps their ``__init__`` (arguments, defaults, checks),
# fields and leaves (``weight``, ``bias``), so ``eqx.tree_serialise_leaves`` checkpoints
# load unchanged; ``implementation`` is one more static field. Needs the ``equinox``
# extra; ``import jax_normgrad`` does not import this module.
__all__ = ["AddLayerNorm", "AddRMSNorm", "GroupNorm", "LayerNorm", "RMSNorm", "patch"]

# equinox's classes, bound once at import: ``patch()`` replaces ``equinox.nn.LayerNorm``
# and the others, so a drop-in reaches the class it subclasses through these, never
# through the module attribute at call time (that would call itself).
_LayerNorm, _RMSNorm, _GroupNorm = eqx.nn.LayerNorm, eqx.nn.RMSNorm, eqx.nn.GroupNorm

# Tells "no state passed" from any state (equinox's own marker is private).
_NO_STATE = object()

_FALLBACK_CASES = [
    "an x dtype other than float32, float16, bfloat16 (equinox computes in "
    "``result_type(x, float32)``: float64 under ``jax_enable_x64``, for example)",
    "a 0-d or zero-sized x",
]


def _fallback_reason(x):
  """Why the kernels cannot compute equinox's numbers for ``x``, else None."""
  reason = _layers.unsupported_dtypes(x=x.dtype)
  if reason is None and x.ndim == 0:
    reason = "a 0-d x (no axis to normalize)"
  elif reason is None and x.size == 0:
    reason = "a zero-sized x"
  return reason


def _with_state(out, state):
  return out if state is _NO_STATE else (out, state)


def _f32(p):
  """equinox casts its parameters to the compute dtype, float32 for every supported x."""
  return None if p is None else p.astype(jnp.float32)


def _call(mdl, original, x, state, key, *, centered: bool):
  """LayerNorm / RMSNorm ``__call__``: the kernels, or ``original``'s own code."""
  x = jnp.asarray(x)  # as equinox's jnp code sees it
  if x.shape != mdl.shape:
    return original.__call__(mdl, x, *(() if state is _NO_STATE else (state,)), key=key)
  reason = _fallback_reason(x)
  if reason is not None:
    _layers.warn_fallback(f"jax_normgrad.equinox.{original.__name__}", reason,
                          f"equinox.nn.{original.__name__}")
    return original.__call__(mdl, x, *(() if state is _NO_STATE else (state,)), key=key)
  with jax.named_scope(f"jax_normgrad.equinox.{original.__name__}"):
    out = _layers.norm(x, _f32(mdl.weight) if mdl.use_weight else None,
                       _f32(mdl.bias) if mdl.use_bias else None, begin=0, eps=mdl.eps,
                       centered=centered, out_dtype=x.dtype,
                       implementation=mdl.implementation, forward=mdl.forward)
  return _with_state(out, state)


class LayerNorm(_LayerNorm):
  __doc__ = f"""``equinox.nn.LayerNorm`` whose backward runs the jax_normgrad kernels.

  ``LayerNorm(shape, eps=1e-5, use_weight=True, use_bias=True, dtype=None, *,
  elementwise_affine=None, implementation=None)``: equinox's arguments and
  defaults, plus ``implementation`` and ``forward``. Normalizes the whole of ``x`` (shape
  ``shape``; ``jax.vmap`` over a batch), statistics in float32, parameters
  cast to float32, the output in x's dtype::

      y = (x - mean(x)) / sqrt(var(x) + eps) * weight + bias

  Call: ``layer(x, state=..., *, key=None)`` -> y, or ``(y, state)`` when a
  state is passed (equinox's BatchNorm-compatible form).
  {_layers.fallback_doc("equinox.nn.LayerNorm", _FALLBACK_CASES)}
  Raises: equinox's ``ValueError`` when ``x.shape != shape``.
  """

  implementation: str | None = eqx.field(static=True, default=None)
  forward: str | None = eqx.field(static=True, default=None)

  __init__ = _layers.init_with_implementation(_LayerNorm)

  def __call__(self, x, state=_NO_STATE, *, key=None):
    return _call(self, _LayerNorm, x, state, key, centered=True)


class RMSNorm(_RMSNorm):
  __doc__ = f"""``equinox.nn.RMSNorm`` whose backward runs the jax_normgrad kernels.

  ``RMSNorm(shape, eps=1e-5, use_weight=True, use_bias=True, dtype=None, *,
  implementation=None)``: equinox's arguments and defaults (a bias
  included), plus ``implementation`` and ``forward``. Over the whole of ``x`` (shape
  ``shape``), in float32, the output in x's dtype::

      y = x / sqrt(mean(x^2) + eps) * weight + bias

  With a bias and a 16-bit x the kernel writes a float32 y (``out_dtype``)
  and the bias is added in float32 (the RMSNorm kernel has no bias; so y is
  still rounded once).
  {_layers.fallback_doc("equinox.nn.RMSNorm", _FALLBACK_CASES)}
  Raises: equinox's ``ValueError`` when ``x.shape != shape``.
  """

  implementation: str | None = eqx.field(static=True, default=None)
  forward: str | None = eqx.field(static=True, default=None)

  __init__ = _layers.init_with_implementation(_RMSNorm)

  def __call__(self, x, state=_NO_STATE, *, key=None):
    return _call(self, _RMSNorm, x, state, key, centered=False)


class GroupNorm(_GroupNorm):
  __doc__ = f"""``equinox.nn.GroupNorm`` whose backward runs the jax_normgrad kernels.

  ``GroupNorm(groups, channels=None, eps=1e-5, channelwise_affine=True,
  dtype=None, *, implementation=None, activation=None)``: equinox's
  arguments, defaults and checks, plus ``implementation``, ``forward`` and ``activation``
  (None, "silu", "gelu" or "relu", fused into the kernels:
  ``jax.nn.silu(GroupNorm(...)(x))`` as one layer). Channels first, no batch axis: x is
  ``(channels, ...)`` (``jax.vmap`` over a batch); statistics per group of
  ``channels/groups`` channels over all their elements, in float32;
  ``weight``/``bias`` per channel, the output in x's dtype::

      y = (x - mean_group) / sqrt(var_group + eps) * weight[c] + bias[c]

  Runs :func:`jax_normgrad.group_norm` on x viewed as ``(1, C, HxW)`` (no
  transpose; under ``vmap`` the batch becomes N).
  {_layers.fallback_doc("equinox.nn.GroupNorm", _FALLBACK_CASES)}
  Raises: what ``equinox.nn.GroupNorm`` raises (``groups`` not dividing the
  channels, parameters of another length than x's channels).
  """

  implementation: str | None = eqx.field(static=True, default=None)
  forward: str | None = eqx.field(static=True, default=None)
  activation: str | None = eqx.field(static=True, default=None)

  __init__ = _layers.init_with_implementation(_GroupNorm, extra=("activation",))

  def _theirs(self, x, args, key):
    """equinox's GroupNorm (its result or error), then the activation."""
    out = _GroupNorm.__call__(self, x, *args, key=key)
    if isinstance(out, tuple):
      return (_layers.activate(out[0], self.activation),) + out[1:]
    return _layers.activate(out, self.activation)

  def __call__(self, x, state=_NO_STATE, *, key=None):
    x = jnp.asarray(x)  # as equinox's jnp code sees it
    args = () if state is _NO_STATE else (state,)
    channels = x.shape[0] if x.ndim else 0
    if (not channels or channels % self.groups
        or (self.channelwise_affine and self.weight.shape != (channels,))):
      return self._theirs(x, args, key)
    reason = _fallback_reason(x)
    if reason is not None:
      _layers.warn_fallback("jax_normgrad.equinox.GroupNorm", reason, "equinox.nn.GroupNorm")
      return self._theirs(x, args, key)
    affine = self.channelwise_affine
    with jax.named_scope("jax_normgrad.equinox.GroupNorm"):
      out = _layers.group_norm(x, self.groups, _f32(self.weight) if affine else None,
                               _f32(self.bias) if affine else None, batch_ndim=0,
                               channels_last=False, eps=self.eps, out_dtype=x.dtype,
                               implementation=self.implementation, forward=self.forward,
                               activation=self.activation)
    return _with_state(out, state)


def _add_call(mdl, plain, x, residual, state, key, *, centered: bool):
  """AddLayerNorm / AddRMSNorm ``__call__``: the fused kernels, or the add before the plain drop-in."""
  x = jnp.asarray(x)
  reason = None
  if x.shape != mdl.shape:
    # The plain layer raises equinox's error for the shape.
    return plain.__call__(mdl, x + jnp.asarray(residual), key=key)
  reason = _fallback_reason(x)
  if reason is None and not centered and mdl.use_bias and x.dtype != jnp.float32:
    # The RMSNorm kernels have no bias: with a 16-bit y, adding it after would round y twice.
    reason = f"a bias with a {x.dtype} x (the fused RMSNorm has no bias term)"
  weight = _f32(mdl.weight) if mdl.use_weight else None
  bias = _f32(mdl.bias) if mdl.use_bias else None
  name = f"jax_normgrad.equinox.{type(mdl).__name__}"
  with jax.named_scope(name):
    y, h = _layers.add_norm(name, x, residual, weight, bias if centered else None, begin=0,
                            eps=mdl.eps, centered=centered, residual_dtype=mdl.residual_dtype,
                            implementation=mdl.implementation, forward=mdl.forward, reason=reason,
                            plain=lambda h: plain.__call__(mdl, h, key=key).astype(x.dtype))
  if not centered and reason is None and bias is not None:
    y = y + bias  # float32 x and y: one float32 add, as equinox's
  return _with_state((y, h), state)


_ADD_DOC = _layers.ADD_NORM_INTRO + """
      y, h = self.norm(attn_out, h)   # was: h = h + attn_out; y = self.norm(h)

  ``{cls}(shape, *args, residual_dtype=None, implementation=None, **kwargs)``:
  the plain drop-in's (``equinox.nn.{base}``'s) arguments, leaves and
  checkpoints, plus ``residual_dtype``. Call ``layer(x, residual, state=...,
  *, key=None)`` -> ``(y, h)``, or ``((y, h), state)`` when a state is passed;
  x and residual have the layer's ``shape`` (``jax.vmap`` over a batch).
  Where the fused kernels do not apply ({extra}a dtype other than float32,
  float16, bfloat16; a zero-sized x) a one-time ``FallbackWarning`` says so
  and the add runs before the plain drop-in (y then normalizes the rounded h).
"""


class AddLayerNorm(LayerNorm):
  __doc__ = "Residual add + :class:`LayerNorm` fused (equinox)." + _ADD_DOC.format(
      fn="add_layer_norm", cls="AddLayerNorm", base="LayerNorm", extra="")

  residual_dtype: Any = eqx.field(static=True, default=None)

  def __init__(self, *args, residual_dtype=None, **kwargs):
    super().__init__(*args, **kwargs)
    self.residual_dtype = residual_dtype

  def __call__(self, x, residual, state=_NO_STATE, *, key=None):  # pylint: disable=arguments-differ
    return _add_call(self, LayerNorm, x, residual, state, key, centered=True)


class AddRMSNorm(RMSNorm):
  __doc__ = "Residual add + :class:`RMSNorm` fused (equinox)." + _ADD_DOC.format(
      fn="add_rms_norm", cls="AddRMSNorm", base="RMSNorm",
      extra="a bias, equinox's default, with a 16-bit x: the fused RMSNorm has no bias term; ")

  residual_dtype: Any = eqx.field(static=True, default=None)

  def __init__(self, *args, residual_dtype=None, **kwargs):
    super().__init__(*args, **kwargs)
    self.residual_dtype = residual_dtype

  def __call__(self, x, residual, state=_NO_STATE, *, key=None):  # pylint: disable=arguments-differ
    return _add_call(self, RMSNorm, x, residual, state, key, centered=False)


def patch() -> _layers.Patch:
  """Replaces equinox.nn's LayerNorm, RMSNorm and GroupNorm with these drop-ins, process-wide.

  ``equinox.nn.X`` (and equinox's own module of them) then refers to the
  drop-in. Idempotent. Returns an undo callable that is also a context
  manager. Patch before the model's code is imported: ``from equinox.nn
  import LayerNorm`` done earlier keeps equinox's class.
  """
  return _layers.Patch("equinox", (LayerNorm, RMSNorm, GroupNorm))
