"""Pallas lowerings of the LayerNorm / RMSNorm primitives (rows of ``(M, H)``, one segment each)."""

from __future__ import annotations

from jax_normgrad.pallas import common


def _rows(x, centered, param_groups):
  m, h = x.shape
  return common.Segments("rows", m, 1, h, groups=1, param_groups=param_groups, centered=centered)


def layer_norm_fwd(x, *params, eps, centered, has_weight, has_bias, param_groups, interpret):
  """``[y, mean, rstd]`` (``[y, rstd]`` when not centered) of ``x`` ``(M, H)``.

  Per row, in float32: ``mean = sum(x) / H`` (0 for RMSNorm),
  ``rstd = 1 / sqrt(sum((x - mean)^2) / H + eps)``,
  ``y = (x - mean) * rstd * weight + bias``.
  """
  weight, bias = common.unpack(params, has_weight, has_bias)
  seg = _rows(x, centered, param_groups)
  y, mean, rstd = common.forward(seg, x.reshape(seg.n, 1, seg.b), weight, bias, eps=eps,
                                 interpret=interpret)
  stats = [mean, rstd] if centered else [rstd]
  return [y.reshape(x.shape)] + [s.reshape(seg.n) for s in stats]


def layer_norm_bwd(dy, x, *rest, centered, has_weight, output_mask, param_groups, interpret):
  """The ``output_mask``'ed of ``[dx, dweight, dbias]`` (see ``reference.layer_norm_bwd``).

  ``dx = rstd * (g - mean(g) - xhat * mean(g * xhat))`` per row (no
  ``mean(g)`` for RMSNorm), ``g = dy * weight``; ``dweight = sum_rows dy * xhat``,
  ``dbias = sum_rows dy``, per parameter group, float32.
  """
  mean, rstd, weight = common.unpack(rest, centered, True, has_weight)
  mask = tuple(output_mask) + (False,) * (3 - len(output_mask))
  seg = _rows(x, centered, param_groups)
  view = (seg.n, 1, seg.b)
  outs = common.backward(seg, dy.reshape(view), x.reshape(view),
                         None if mean is None else mean.reshape(seg.n, 1), rstd.reshape(seg.n, 1),
                         weight, mask, interpret=interpret)
  dx = None if outs[0] is None else outs[0].reshape(x.shape)
  return [o for o, m in zip((dx,) + tuple(outs[1:]), mask) if m]
