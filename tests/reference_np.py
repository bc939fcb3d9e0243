"""Float64 NumPy reference written from docs/spec.md#math: the oracle of every kernel test."""

from __future__ import annotations

import numpy as np


def f64(a):
  return None if a is None else np.asarray(a, dtype=np.float64)


def stored_sum(x, residual, dtype):
  """The residual form's h as it is stored and normalized (docs/spec.md#the-residual-form):
  ``x + residual`` summed in float32 (exactly rounded, as the kernels' float32 add) and
  rounded once to ``dtype``, returned as float64."""
  h = np.asarray(x).astype(np.float32) + np.asarray(residual).astype(np.float32)
  return h.astype(dtype).astype(np.float64)


def ln_stats(x, norm_ndim, eps, centered=True):
  x = f64(x)
  axes = tuple(range(x.ndim - norm_ndim, x.ndim))
  mean = x.mean(axis=axes, keepdims=True) if centered else np.zeros_like(x.sum(axis=axes, keepdims=True))
  var = ((x - mean) ** 2).mean(axis=axes, keepdims=True)
  return mean, 1.0 / np.sqrt(var + eps)


def ln_fwd(x, norm_ndim, weight=None, bias=None, eps=1e-5):
  """y = (x - mean) * rstd * weight + bias; mean, rstd of shape A + (1,)*len(R)."""
  mean, rstd = ln_stats(x, norm_ndim, eps)
  y = (f64(x) - mean) * rstd
  if weight is not None:
    y = y * f64(weight)
  if bias is not None:
    y = y + f64(bias)
  return y, mean, rstd


def ln_bwd(dy, x, norm_ndim, mean, rstd, weight=None):
  """dx = rstd (g - mean(g) - xhat mean(g xhat)); dw = sum dy xhat; db = sum dy."""
  dy, x = f64(dy), f64(x)
  lead = x.shape[:x.ndim - norm_ndim]
  shape = lead + (1,) * norm_ndim
  mean = f64(mean).reshape(shape)
  rstd = f64(rstd).reshape(shape)
  axes = tuple(range(x.ndim - norm_ndim, x.ndim))
  lead_axes = tuple(range(x.ndim - norm_ndim))
  xhat = (x - mean) * rstd
  g = dy * f64(weight) if weight is not None else dy
  if x.size:
    dx = rstd * (g - g.mean(axis=axes, keepdims=True) - xhat * (g * xhat).mean(axis=axes, keepdims=True))
  else:
    dx = np.zeros_like(x)
  return dx, (dy * xhat).sum(axis=lead_axes), dy.sum(axis=lead_axes)


def _gn_view(a, n, c, hw, group, channels_last):
  """-> (N, G, C/G, HW) float64."""
  a = f64(a)
  if channels_last:
    return a.reshape(n, hw, group, c // group).transpose(0, 2, 3, 1)
  return a.reshape(n, group, c // group, hw)


def _gn_unview(a, shape, channels_last):
  n, g, cg, hw = a.shape
  if channels_last:
    a = a.transpose(0, 3, 1, 2)
  return a.reshape(shape)


def gn_fwd(x, weight, bias, n, c, hw, group, eps=1e-5, channels_last=False):
  xb = _gn_view(x, n, c, hw, group, channels_last)
  mean = xb.mean(axis=(2, 3), keepdims=True)
  rstd = 1.0 / np.sqrt(((xb - mean) ** 2).mean(axis=(2, 3), keepdims=True) + eps)
  y = (xb - mean) * rstd
  if weight is not None:
    y = y * f64(weight).reshape(1, group, c // group, 1)
  if bias is not None:
    y = y + f64(bias).reshape(1, group, c // group, 1)
  return _gn_unview(y, np.shape(x), channels_last), mean.reshape(n, group), rstd.reshape(n, group)


def gn_bwd(dy, x, mean, rstd, gamma, n, c, hw, group, channels_last=False):
  dyb = _gn_view(dy, n, c, hw, group, channels_last)
  xb = _gn_view(x, n, c, hw, group, channels_last)
  mean = f64(mean).reshape(n, group, 1, 1)
  rstd = f64(rstd).reshape(n, group, 1, 1)
  xhat = (xb - mean) * rstd
  g = dyb * f64(gamma).reshape(1, group, c // group, 1) if gamma is not None else dyb
  if xb.size:
    dx = rstd * (g - g.mean(axis=(2, 3), keepdims=True) - xhat * (g * xhat).mean(axis=(2, 3), keepdims=True))
  else:
    dx = np.zeros_like(xb)
  dgamma = (dyb * xhat).sum(axis=(0, 3)).reshape(c)
  dbeta = dyb.sum(axis=(0, 3)).reshape(c)
  return _gn_unview(dx, np.shape(x), channels_last), dgamma, dbeta


def dx_scale(dy, rstd, weight=None):
  """The magnitude of the terms of grad_input: max|rstd| * max|dy * weight|."""
  g = np.abs(f64(dy))
  if g.size == 0:
    return 0.0
  if weight is not None:
    g = g * np.max(np.abs(f64(weight)))
  return float(np.max(np.abs(f64(rstd))) * np.max(g))


# ----------------------------------------------------------------------------
# The vendors' other forms of the LayerNorm backward, and RMSNorm.


def ln_grad_ascendc(dy, x, variance, mean, gamma, eps):
  """AscendC LayerNormGrad as AscendC writes it, step by step (pd_var, pd_mean; docs/spec.md#layer_norm_grad-layer_norm_grad_beta), over the last axis.

  Returns (pd_x, res_for_gamma). ``variance``/``mean`` have one entry per row.
  """
  dy, x = f64(dy), f64(x)
  h = x.shape[-1]
  stat_shape = x.shape[:-1] + (1,)
  variance = f64(variance).reshape(stat_shape)
  mean = f64(mean).reshape(stat_shape)
  pd_xl = dy * f64(gamma) if gamma is not None else dy
  d = x - mean
  pd_var = np.sum((-0.5) * pd_xl * d * np.power(variance + eps, -1.5), axis=-1, keepdims=True)
  pd_mean = (np.sum((-1.0) * pd_xl * np.power(variance + eps, -0.5), axis=-1, keepdims=True)
             + pd_var * (1.0 / h) * np.sum((-2.0) * d, axis=-1, keepdims=True))
  pd_x = pd_xl * np.power(variance + eps, -0.5) + pd_var * (2.0 / h) * d + pd_mean * (1.0 / h)
  res_for_gamma = d * np.power(variance + eps, -0.5)
  return pd_x, res_for_gamma


def ln_grad_beta_ascendc(dy, res_for_gamma, norm_ndim):
  """AscendC LayerNormGradBeta: (sum dy * res_for_gamma, sum dy) over the leading dims."""
  dy, res = f64(dy), f64(res_for_gamma)
  lead_axes = tuple(range(dy.ndim - norm_ndim))
  return (dy * res).sum(axis=lead_axes), dy.sum(axis=lead_axes)


def ln_bwd_from_normalized(grad_output, weight, xhat, std):
  """InfiniOp LayerNormBackward from xhat and std = sqrt(var + eps), over the last axis.

  grad_input = (g - mean(g) - xhat mean(g xhat)) / std, g = grad_output * weight;
  grad_weight = sum grad_output * xhat; grad_bias = sum grad_output.
  """
  dy, xhat = f64(grad_output), f64(xhat)
  std = f64(std).reshape(xhat.shape[:-1] + (1,))
  g = dy * f64(weight) if weight is not None else dy
  lead_axes = tuple(range(dy.ndim - 1))
  if dy.size:
    dx = (g - g.mean(axis=-1, keepdims=True) - xhat * (g * xhat).mean(axis=-1, keepdims=True)) / std
  else:
    dx = np.zeros_like(dy)
  return dx, (dy * xhat).sum(axis=lead_axes), dy.sum(axis=lead_axes)


def rms_fwd(x, norm_ndim, weight=None, eps=1e-6):
  """y = x * rstd * weight, rstd = 1/sqrt(mean(x^2) + eps); rstd of shape A + (1,)*len(R)."""
  _, rstd = ln_stats(x, norm_ndim, eps, centered=False)
  y = f64(x) * rstd
  return (y * f64(weight) if weight is not None else y), rstd


def rms_bwd(dy, x, norm_ndim, rstd, weight=None):
  """dx = rstd (g - xhat mean(g xhat)), xhat = x rstd; dweight = sum dy xhat."""
  dy, x = f64(dy), f64(x)
  rstd = f64(rstd).reshape(x.shape[:x.ndim - norm_ndim] + (1,) * norm_ndim)
  axes = tuple(range(x.ndim - norm_ndim, x.ndim))
  xhat = x * rstd
  g = dy * f64(weight) if weight is not None else dy
  dx = rstd * (g - xhat * (g * xhat).mean(axis=axes, keepdims=True)) if x.size else np.zeros_like(x)
  return dx, (dy * xhat).sum(axis=tuple(range(x.ndim - norm_ndim)))


def fwd_scales(x, rstd, weight=None):
  """Error scales of a forward's (y, mean, rstd), for assert_close's ``scale``.

  The float32 mean is a sum of terms of size |x|, off by about their rounding
  however much they cancel; x - mean keeps that error, which in a row whose
  spread is far below |x| (few elements, a large offset) is much more than a
  rounding of y. So mean's scale is max|x|, y's is max|x| * max rstd *
  max|weight| (the size of the terms that cancel), and rstd's is max rstd
  times the same conditioning max|x| * max rstd.
  """
  x, rstd = np.abs(f64(x)), np.abs(f64(rstd))
  if x.size == 0:
    return 0.0, 0.0, 0.0
  cond = float(np.max(x) * np.max(rstd))
  w = float(np.max(np.abs(f64(weight)))) if weight is not None else 1.0
  return cond * w, float(np.max(x)), cond * float(np.max(rstd))


def activation(z, name):
  """GroupNorm's fused activations in float64, from their textbook forms (gelu by tanh)."""
  z = f64(z)
  if name == "silu":
    return z / (1.0 + np.exp(-z))
  if name == "gelu":
    return 0.5 * z * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (z + 0.044715 * z**3)))
  if name == "relu":
    return np.maximum(z, 0.0)
  raise ValueError(name)


def activation_grad(z, name):
  """d activation(z) / dz in float64."""
  z = f64(z)
  if name == "silu":
    s = 1.0 / (1.0 + np.exp(-z))
    return s * (1.0 + z * (1.0 - s))
  if name == "gelu":
    c = np.sqrt(2.0 / np.pi)
    t = np.tanh(c * (z + 0.044715 * z**3))
    return 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * c * (1.0 + 3 * 0.044715 * z * z)
  if name == "relu":
    return (z > 0).astype(np.float64)
  raise ValueError(name)
