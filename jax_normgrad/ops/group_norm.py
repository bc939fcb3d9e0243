"""GroupNorm: the differentiable layer, the forward with statistics and the backward op."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jax_normgrad import _outputs, _sharding, _validation as v
from jax_normgrad._operands import GroupNormBwd, GroupNormFwd, pack
from jax_normgrad._outputs import GroupNormBwdOut, GroupNormFwdOut
from jax_normgrad.ops._common import as_f32
from jax_normgrad.primitives.group_norm import group_norm_bwd_p, group_norm_fwd_p


def _canonical_shape(n, c, hw, channels_last):
  return (n, hw, c) if channels_last else (n, c, hw)


def _check_sizes(x, n, c, hw, group):
  """Checks N, C, HxW, group against each other and x (aclnn PARAM_INVALID 6-8)."""
  n = v.check_int("N", n, 0)
  c = v.check_int("C", c, 1)
  hw = v.check_int("HxW", hw, 0)
  group = v.check_int("group", group, 1)
  if c % group != 0:
    raise ValueError(f"group: C={c} must be divisible by group={group} (C % group = {c % group})")
  if x.size != n * c * hw:
    raise ValueError(
        f"x: expected N*C*HxW = {n}*{c}*{hw} = {n * c * hw} elements, got {x.size} "
        f"(shape {tuple(x.shape)})")
  return n, c, hw, group


def _check_params(weight, bias, x, c, weight_name="weight", bias_name="bias"):
  weight = v.optional_array(weight_name, weight)
  bias = v.optional_array(bias_name, bias)
  for name, p in ((weight_name, weight), (bias_name, bias)):
    if p is not None:
      v.check_param_dtype(name, p, x)
      v.check_size(name, p, c, "C, one per channel")
  v.check_params_share_dtype(weight_name, weight, bias_name, bias)
  return weight, bias


def _fwd(x, weight, bias, n, c, hw, group, eps, channels_last, implementation, y_dtype=None,
         activation=None, forward="kernel"):
  """Canonical forward: the ``GroupNormFwdOut`` y with x's shape in ``y_dtype`` (None: x's),
  float32 (N, G) mean and rstd.

  ``forward``: what lowers it (see ``_dispatch.choose``).
  """
  shape = _canonical_shape(n, c, hw, channels_last)
  args, operands = pack(GroupNormFwd(_sharding.reshape(x, shape), as_f32(weight, (1, c)),
                                     as_f32(bias, (1, c))))
  params = dict(operands=operands, eps=eps, group=group, channels_last=channels_last,
                param_groups=1, y_dtype=y_dtype, activation=activation,
                implementation=implementation, forward=forward)
  outs = _outputs.unpack(GroupNormFwdOut, _sharding.bind(group_norm_fwd_p, *args, **params),
                         _outputs.group_norm_fwd_names(**params))
  return outs._replace(y=outs.y.reshape(x.shape))


def _bwd(dy, x, mean, rstd, gamma, n, c, hw, group, output_mask, channels_last, implementation,
         param_shape, beta=None, activation=None):
  """Canonical backward: the ``GroupNormBwdOut`` of ``output_mask`` (dx in x's shape and dtype,
  float32 dweight and dbias in ``param_shape``), None where not computed.

  With an ``activation``, dy is the cotangent of ``act(z)`` and ``beta`` (if
  any) is read to recompute z; without one beta is not an operand.
  """
  shape = _canonical_shape(n, c, hw, channels_last)
  beta = beta if activation is not None else None
  args, operands = pack(GroupNormBwd(_sharding.reshape(dy, shape), _sharding.reshape(x, shape),
                                     as_f32(mean, (n, group)), as_f32(rstd, (n, group)),
                                     as_f32(gamma, (1, c)), as_f32(beta, (1, c))))
  params = dict(operands=operands, group=group, channels_last=channels_last,
                activation=activation, output_mask=_outputs.output_mask(output_mask),
                param_groups=1, implementation=implementation)
  outs = _outputs.unpack(GroupNormBwdOut, _sharding.bind(group_norm_bwd_p, *args, **params),
                         _outputs.group_norm_bwd_names(**params))
  to_param = lambda a: None if a is None else a.reshape(param_shape)
  return GroupNormBwdOut(None if outs.dx is None else outs.dx.reshape(x.shape),
                         to_param(outs.dweight), to_param(outs.dbias))


def group_norm_fwd(x, weight, bias, N, C, HxW, group, eps=1e-5, *, channels_last=False,
                   implementation=None):
  """GroupNorm forward that also returns the statistics the backward needs.

  ``x`` is read as ``(N, C, HxW)`` (or ``(N, HxW, C)`` with ``channels_last``);
  per ``(n, g)`` block of ``C/group * HxW`` elements, in float32::

      mean = mean(x),  rstd = 1 / sqrt(mean((x - mean)^2) + eps)
      y = (x - mean) * rstd * weight[c] + bias[c]

  Args:
    x: float32, float16 or bfloat16, any shape with ``N*C*HxW`` elements.
    weight, bias: optional, ``C`` elements, x's dtype or float32 (the same
      dtype when both are given).
    N, C, HxW, group: ints; ``group > 0`` divides ``C``; ``HxW > 0``.
    eps: float >= 0.
    channels_last: read x as ``(N, HxW, C)``.
    implementation: None (the platform's first that can run it: docs/dispatch.md), "xla",
      "ffi", "pallas", "triton", "mosaic_gpu" or "mosaic_tpu".

  Returns:
    ``(y, mean, rstd)``: ``y`` with x's shape and dtype; ``mean``, ``rstd``
    float32 of shape ``(N, group)``.

  Raises:
    ValueError: bad shapes or values. TypeError: bad dtypes or argument kinds.
  """
  x = v.as_array("x", x)
  v.check_float_dtype("x", x)
  n, c, hw, group = _check_sizes(x, N, C, HxW, group)
  v.check_positive_size("HxW", hw, "spatial size for the forward")
  weight, bias = _check_params(weight, bias, x, c)
  eps = v.check_eps(eps)
  implementation = v.check_implementation(implementation)
  return tuple(_fwd(x, weight, bias, n, c, hw, group, eps, bool(channels_last), implementation))


def group_norm_backward(grad_out, x, mean, rstd, gamma, N, C, HxW, group,
                        output_mask=(True, True, True), *, channels_last=False,
                        implementation=None):
  """GroupNorm backward (aclnnGroupNormBackward semantics).

  Per ``(n, g)`` block (means over its ``C/group * HxW`` elements), with
  ``xhat = (x - mean) * rstd`` and ``g = grad_out * gamma[c]``::

      grad_input     = rstd * (g - mean(g) - xhat * mean(g * xhat))
      grad_gamma[c]  = sum over n, hw of grad_out * xhat
      grad_beta[c]   = sum over n, hw of grad_out

  accumulated in float32 and cast once at the end. No limit on ``C/group``.

  Args:
    grad_out: the cotangent of y; x's shape and dtype.
    x: float32, float16 or bfloat16, any shape with ``N*C*HxW`` elements,
      read as ``(N, C, HxW)`` or, with ``channels_last``, ``(N, HxW, C)``.
    mean, rstd: ``N*group`` elements, float32 or x's dtype, the same dtype.
    gamma: optional (None: ones), ``C`` elements, x's dtype or float32.
    N, C, HxW, group: ints; ``group > 0`` divides ``C``.
    output_mask: three bools for (grad_input, grad_gamma, grad_beta); masked
      outputs are None and not computed.
    channels_last: read x and grad_out as ``(N, HxW, C)``.
    implementation: None (the platform's first that can run it: docs/dispatch.md), "xla",
      "ffi", "pallas", "triton", "mosaic_gpu" or "mosaic_tpu".

  Returns:
    ``(grad_input, grad_gamma, grad_beta)``: grad_input with x's shape and
    dtype; grad_gamma/grad_beta with gamma's shape (``(C,)`` when None) and
    gamma's dtype (x's when None). None where masked.

  Raises:
    ValueError: bad shapes or values. TypeError: bad dtypes or argument kinds.
  """
  grad_out = v.as_array("grad_out", grad_out)
  x = v.as_array("x", x)
  mean = v.as_array("mean", mean)
  rstd = v.as_array("rstd", rstd)
  v.check_float_dtype("grad_out", grad_out)
  v.check_same_dtype("x", x, "grad_out", grad_out)
  v.check_shape("grad_out", grad_out, x.shape, "x.shape")
  n, c, hw, group = _check_sizes(x, N, C, HxW, group)
  for name, s in (("mean", mean), ("rstd", rstd)):
    v.check_stats_dtype(name, s, x)
    v.check_size(name, s, n * group, "N * group")
  v.check_same_dtype("rstd", rstd, "mean", mean)
  gamma, _ = _check_params(gamma, None, x, c, weight_name="gamma")
  mask = v.check_output_mask(output_mask)
  implementation = v.check_implementation(implementation)
  if not any(mask):
    return (None, None, None)
  param_shape = gamma.shape if gamma is not None else (c,)
  pdtype = gamma.dtype if gamma is not None else x.dtype
  g = _bwd(grad_out, x, mean, rstd, gamma, n, c, hw, group, mask, bool(channels_last),
           implementation, param_shape)
  cast = lambda a: None if a is None else a.astype(pdtype)
  return g.dx, cast(g.dweight), cast(g.dbias)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7, 8, 9, 10))
def _group_norm(x, weight, bias, layout, group, eps, channels_last, implementation, out_dtype,
                activation, forward):
  return _fwd(x, weight, bias, *layout, group, eps, channels_last, implementation, out_dtype,
              activation, forward).y


def _group_norm_vjp_fwd(x, weight, bias, layout, group, eps, channels_last, implementation,
                        out_dtype, activation, forward):
  f = _fwd(x, weight, bias, *layout, group, eps, channels_last, implementation, out_dtype,
           activation, forward)
  return f.y, (x, f.mean, f.rstd, weight, bias)


def _group_norm_vjp_bwd(layout, group, eps, channels_last, implementation, out_dtype, activation,
                        forward, res, dy):
  del eps, out_dtype, forward  # dy arrives in y's dtype; dx is in x's.
  x, mean, rstd, weight, bias = res
  mask = (True, weight is not None, bias is not None)
  n, c, hw = layout
  g = _bwd(dy, x, mean, rstd, weight, n, c, hw, group, mask, channels_last, implementation, (c,),
           beta=bias, activation=activation)
  dw = None if g.dweight is None else g.dweight.astype(weight.dtype)
  db = None if g.dbias is None else g.dbias.astype(bias.dtype)
  # Under shard_map a replicated weight's gradient is the psum of the local ones.
  return (_sharding.cotangent_like(g.dx, x), _sharding.cotangent_like(dw, weight),
          _sharding.cotangent_like(db, bias))


_group_norm.defvjp(_group_norm_vjp_fwd, _group_norm_vjp_bwd)


def group_norm(x, num_groups, weight=None, bias=None, *, eps=1e-5, channel_axis=1,
               out_dtype=None, activation=None, forward=None, implementation=None):
  """Differentiable GroupNorm whose backward runs the backward kernel.

  ``x`` has the batch at axis 0 and channels at ``channel_axis``: ``1`` is
  NCHW (PyTorch), ``-1`` is NHWC (Flax); any number of spatial dims,
  including none. Both layouts run in place; any other ``channel_axis >= 1``
  is moved to axis 1 first (a transpose of x in and of y out). On CPU the
  channels-last forward is two kernel calls, the statistics then y, so that
  XLA drops y's pass where y is unused (as it does for jnp code). Statistics
  are over each ``(n, group)`` block of ``C/num_groups * prod(spatial)``
  elements (see :func:`group_norm_fwd`); backward: :func:`group_norm_backward`.

  Args:
    x: float32, float16 or bfloat16, at least 2-D.
    num_groups: int > 0 that divides the channel count.
    weight, bias: optional, shape ``(C,)``, x's dtype or float32.
    eps: float >= 0.
    channel_axis: the channel axis; the batch axis 0 is refused.
    out_dtype: y's dtype: None (x's dtype) or float32 (a 16-bit x with float32
      parameters, as Flax promotes: y rounded once, x never copied to float32
      on CPU; see :func:`jax_normgrad.layer_norm`).
    activation: None, "silu" (swish), "gelu" (tanh approximation, as
      ``jax.nn.gelu``'s default) or "relu": ``y = act(group_norm(x))``
      fused into the kernels. The forward applies it before y is rounded
      and written; the backward recomputes the pre-activation value from x
      and the statistics, so it is never stored or read: one pass over
      memory less each way than ``jax.nn.silu(group_norm(x))``, and one
      activation fewer kept for the backward.
    forward: None (the platform's default), ``"kernel"`` or ``"xla"``: the
      jnp forward (and activation), which XLA fuses with the ops around it;
      the backward kernel still recomputes the pre-activation value. See
      :func:`jax_normgrad.layer_norm`.
    implementation: None (the platform's first that can run it: docs/dispatch.md), "xla",
      "ffi", "pallas", "triton", "mosaic_gpu" or "mosaic_tpu".

  Returns:
    ``y`` with x's shape, in ``out_dtype`` (None: x's dtype).

  Raises:
    ValueError: bad shapes or values. TypeError: bad dtypes or argument kinds.
  """
  x = v.as_array("x", x)
  v.check_float_dtype("x", x)
  if x.ndim < 2:
    raise ValueError(f"x: expected at least 2 dimensions (N, C, ...), got shape {tuple(x.shape)}")
  axis = v.check_int("channel_axis", channel_axis, -x.ndim)
  if axis >= x.ndim:
    raise ValueError(f"channel_axis: expected in [-{x.ndim}, {x.ndim - 1}], got {channel_axis}")
  axis %= x.ndim
  if axis == 0:
    raise ValueError("channel_axis: axis 0 is the batch axis; expected a channel axis >= 1, got "
                     f"{channel_axis}")
  implementation = v.check_implementation(implementation)
  eps = v.check_eps(eps)
  out_dtype = v.check_out_dtype(out_dtype, x)
  activation = v.check_activation(activation)
  forward = v.check_forward(forward)
  moved = 1 < axis < x.ndim - 1
  xc = jnp.moveaxis(x, axis, 1) if moved else x
  channels_last = axis == x.ndim - 1 and x.ndim > 2
  n, c = x.shape[0], x.shape[axis]
  hw = math.prod(s for i, s in enumerate(x.shape) if i not in (0, axis))
  _, _, _, group = _check_sizes(xc, n, c, hw, num_groups)
  v.check_positive_size("x", hw, "spatial size (product of the non-batch, non-channel dims)")
  weight, bias = _check_params(weight, bias, x, c)
  if weight is not None:
    v.check_shape("weight", weight, (c,), "(C,)")
  if bias is not None:
    v.check_shape("bias", bias, (c,), "(C,)")
  y = _group_norm(xc, weight, bias, (n, c, hw), group, eps, channels_last, implementation,
                  out_dtype, activation, forward)
  return jnp.moveaxis(y, 1, axis) if moved else y
