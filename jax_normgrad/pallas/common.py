"""What the Pallas kernels share: the segment description and the per-tile math.

LayerNorm, RMSNorm and GroupNorm in both layouts are one problem to the
kernels: ``x`` viewed as ``(n, major, minor)`` is cut into ``n * groups``
segments, each normalized on its own, and the parameters are indexed by the
channel axis (``major`` or ``minor``). See :class:`Segments`.

The bottom of ``pallas/``: the kernel modules (``gpu``, ``mosaic_gpu`` and
its ``mosaic_gpu_*``, ``tpu``) stand on it, and ``kernels`` on them; it
imports none of them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_normgrad import _activations, _compat

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class KernelPlan:
  """Which kernels a lowering runs for a ``kernels.Problem`` (``kernels.describe``), for ``explain``.

  ``variant``: the kernels' form (e.g. "fused rows", "sample-wide channels-last");
  ``kernels``: the names the kernels have in the lowered module, in launch order;
  ``detail``: the plan (tiles, warps, programs).
  """

  variant: str
  kernels: tuple[str, ...]
  detail: str

  def __str__(self) -> str:
    return f"{self.variant}: {', '.join(self.kernels)} ({self.detail})"


#: How ``explain`` names each ``Segments`` kind.
KINDS = {"rows": "rows", "channels_first": "channels-first groups",
         "channels_last": "channels-last groups"}


@dataclasses.dataclass(frozen=True)
class Segments:
  """Static description of one normalization problem.

  ``x`` is viewed as ``(n, major, minor)``: ``n`` samples, each a plane of
  ``major`` by ``minor`` elements, ``minor`` the contiguous axis:

  * ``"rows"`` (LayerNorm / RMSNorm): ``(M, 1, H)``, a segment per row; the
    parameters are indexed by the H axis.
  * ``"channels_first"`` (GroupNorm NCHW): ``(N, C, HW)``, channels on axis 1.
  * ``"channels_last"`` (GroupNorm NHWC): ``(N, HW, C)``, channels on axis 2.

  Segment ``(i, g)`` is ``x[i]`` restricted to the channels
  ``[g * cg, (g + 1) * cg)``; its statistics are ``mean[i, g]``,
  ``rstd[i, g]``. The samples form ``param_groups`` (W) equal contiguous
  groups, each with its own parameter row (W > 1 only under vmap).

  ``activation`` (GroupNorm only; ``jax_normgrad._activations``): y is
  ``act(xhat * weight + bias)``, and the backward's dy is the cotangent of
  that y (its kernels take the bias too, to recompute the pre-activation value).
  """

  kind: str
  n: int
  major: int
  minor: int
  groups: int
  param_groups: int
  centered: bool = True
  activation: str | None = None

  @property
  def chan_axis(self) -> int:
    return 1 if self.kind == "channels_first" else 2

  @property
  def channels(self) -> int:
    return self.major if self.chan_axis == 1 else self.minor

  @property
  def cg(self) -> int:
    """Channels per group."""
    return self.channels // self.groups

  @property
  def shape(self) -> tuple[int, int]:
    """The shape of one segment in the ``(major, minor)`` plane."""
    return (self.cg, self.minor) if self.chan_axis == 1 else (self.major, self.cg)

  @property
  def count(self) -> int:
    """Elements per segment (the ``H`` or ``C/G * HW`` of the means)."""
    return self.shape[0] * self.shape[1]

  @property
  def per_group(self) -> int:
    """Samples per parameter group."""
    return self.n // self.param_groups


def typed_like(out_shapes, operands):
  """The ``out_shape`` of a ``pallas_call``, varying inside ``shard_map`` like its operands.

  With ``check_vma=True`` Pallas needs every result's varying mesh axes; a
  kernel's results vary over those of the operand that varies most (the
  primitives' operands all vary alike: ``_sharding.match_varying``; arrays a
  lowering makes itself, such as zero statistics, vary over none).
  """
  operands = [a for a in operands if a is not None]
  like = max(operands, key=lambda a: len(_compat.varying_axes(jax.typeof(a))))
  return [_compat.struct_like(s.shape, s.dtype, like) for s in out_shapes]


def unpack(operands, *present: bool):
  """Splits the optional trailing operands of a primitive: one per flag, None where absent."""
  operands = list(operands)
  return [operands.pop(0) if p else None for p in present]


# ----------------------------------------------------------------------------
# Per-tile math, float32, shared by the GPU and TPU kernels.


def xhat_and_g(x, dy, mean, rstd, gamma):
  """``xhat = (x - mean) * rstd`` (RMSNorm: ``mean`` None) and ``g = dy * gamma``."""
  xhat = (x - mean) * rstd if mean is not None else x * rstd
  return xhat, (dy * gamma if gamma is not None else dy)


def grad_input(g, xhat, c1, c2, rstd):
  """``dx = rstd * (g - c1 - xhat * c2)``, ``c1 = mean(g)``, ``c2 = mean(g * xhat)``.

  ``c1`` is None for RMSNorm, whose xhat does not depend on a mean.
  """
  inner = g - xhat * c2
  return rstd * (inner - c1 if c1 is not None else inner)


def stored_sum(x, residual, h_dtype):
  """The residual form's h as it is stored: ``x + residual`` (float32 values) rounded to
  ``h_dtype`` and widened back (float32: the sum itself), the value the kernels normalize
  (docs/spec.md, the residual form)."""
  h = x + residual
  return h if jnp.dtype(h_dtype) == F32 else h.astype(h_dtype).astype(F32)


def inv_std(var, eps):
  """``rstd = 1 / sqrt(var + eps)``."""
  return 1.0 / jnp.sqrt(var + jnp.float32(eps))


def normalize(xc, rstd, weight, bias, activation=None):
  """``y = act(xc * rstd * weight + bias)`` with ``xc`` the centered x (RMSNorm: x).

  ``activation`` None is the identity (``Segments.activation``).
  """
  y = xc * rstd
  if weight is not None:
    y = y * weight
  return _activations.apply(y + bias if bias is not None else y, activation)


def pre_activation_grad(dy, x, mean, rstd, gamma, beta, activation):
  """The cotangent of ``z = xhat * gamma + beta`` from that of ``act(z)``: ``dy * act'(z)``.

  ``dy`` itself where ``activation`` is None. Where a tile is masked, dy
  reads 0, and so does the result.
  """
  if activation is None:
    return dy
  z, _ = xhat_and_g(x, dy, mean, rstd, None)
  if gamma is not None:
    z = z * gamma
  if beta is not None:
    z = z + beta
  return dy * _activations.grad(z, activation)


def combine_moments(state, chunk):
  """Merges the ``(count, mean, m2)`` moments of two disjoint parts (Chan et al.).

  ``m2`` is the sum of squared deviations from the part's mean; merging
  chunk by chunk keeps the accuracy of the two-pass variance in one pass.
  """
  na, ma, qa = state
  nb, mb, qb = chunk
  n = na + nb
  delta = mb - ma
  return n, ma + delta * (nb / n), qa + qb + delta * delta * (na * nb / n)


# ----------------------------------------------------------------------------
# Reductions in XLA over a kernel's partials (CTAs, programs, pieces), in a fixed order.


#: Up to this many terms a fixed-order reduction in XLA (``fixed_order``) is a chain; more,
#: a pairwise tree.
_CHAIN_TERMS = 16


def fixed_order(parts, combine):
  """``parts`` (a tuple of arrays, the terms along axis 0) reduced by ``combine`` in a fixed order.

  Up to ``_CHAIN_TERMS`` terms: in index order, one after another. More: a
  pairwise tree, terms (0, 1), (2, 3), ... combined level by level, an odd
  last one carried up unchanged. Either way XLA is given a fixed expression
  of elementwise ops, which it does not reassociate, so the result is
  bitwise reproducible (unlike a ``reduce``, whose order is the compiler's).
  The tree's HLO grows with log2 of the terms, not with their number: as a
  chain, the row backward's 500-odd CTA partials were 3K HLO ops (1022 adds,
  1024 slices) around a kernel of 1.9K ops, and XLA took seconds to compile
  them; the tree compiles in a fraction of one
  (``benchmarks/gpu_mosaic_probe.py``; BENCHMARKS.md#gpu-mosaic-gpu-against-triton). A
  ``fori_loop`` instead is an XLA while loop: a kernel launch per term.
  """
  n = parts[0].shape[0]
  if n <= _CHAIN_TERMS:
    state = tuple(p[0] for p in parts)
    for j in range(1, n):
      state = combine(state, tuple(p[j] for p in parts))
    return state
  while n > 1:
    even = n - n % 2
    merged = combine(tuple(p[0:even:2] for p in parts), tuple(p[1:even:2] for p in parts))
    if n % 2:
      merged = tuple(jnp.concatenate([m, p[even:]]) for m, p in zip(merged, parts))
    parts, n = merged, (n + 1) // 2
  return tuple(p[0] for p in parts)


def ordered_sum(a, axis: int):
  """``a`` summed over ``axis`` in a fixed order (``fixed_order``): bitwise reproducible."""
  total, = fixed_order((jnp.moveaxis(a, axis, 0),), lambda x, y: (x[0] + y[0],))
  return total
