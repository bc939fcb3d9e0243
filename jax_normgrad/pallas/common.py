"""What the Pallas kernels share: the segment description, the per-tile math and backend dispatch.

LayerNorm, RMSNorm and GroupNorm in both layouts are one problem to the
kernels: ``x`` viewed as ``(n, a, b)`` is cut into ``n * groups`` segments,
each normalized on its own, and the parameters are indexed by the channel
axis (``a`` or ``b``). See :class:`Segments`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from jax_normgrad import _activations, _compat
from jax_normgrad.pallas import config

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Segments:
  """Static description of one normalization problem.

  ``x`` is viewed as ``(n, a, b)``:

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
  that y (its kernels take beta too, to recompute the pre-activation value).
  """

  kind: str
  n: int
  a: int
  b: int
  groups: int
  param_groups: int
  centered: bool = True
  activation: str | None = None

  @property
  def chan_axis(self) -> int:
    return 1 if self.kind == "channels_first" else 2

  @property
  def channels(self) -> int:
    return self.a if self.chan_axis == 1 else self.b

  @property
  def cg(self) -> int:
    """Channels per group."""
    return self.channels // self.groups

  @property
  def shape(self) -> tuple[int, int]:
    """The shape of one segment in the ``(a, b)`` plane."""
    return (self.cg, self.b) if self.chan_axis == 1 else (self.a, self.cg)

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


def sum_partials(partials):
  """``(W, P, C)`` float32 partial sums -> ``(W, C)``, added in program order.

  A fixed sequence of adds (XLA does not reassociate them): the result is
  bitwise reproducible. Used where P is small (TPU); the GPU sums its many
  partials with a Pallas kernel of the same order.
  """
  total = partials[:, 0]
  for p in range(1, partials.shape[1]):
    total = total + partials[:, p]
  return total


# ----------------------------------------------------------------------------
# Dispatch: which kernels run where.


@dataclasses.dataclass(frozen=True)
class GpuBackend:
  """The Pallas GPU backend a lowering was asked for (``_implementation.gpu_backend``).

  ``name`` is "triton" or "mosaic_gpu". ``forced``: the user named it
  (``implementation="mosaic_gpu"``), so a problem its kernels cannot run
  raises; otherwise (``JAX_NORMGRAD_GPU_BACKEND``) Triton runs it instead,
  with a ``FallbackWarning``.
  """

  name: str = "triton"
  forced: bool = False
  #: Why Pallas Triton cannot lower for the targeted GPU (``gpu_target.triton_problem``),
  #: None when it can. With "mosaic_gpu": what those kernels cannot run falls
  #: to the reference, not to Triton. ``name`` "xla": no Pallas GPU kernel
  #: runs on this GPU; the reference runs (``_implementation.with_reference``).
  no_triton: str | None = None


TRITON = GpuBackend()


class NoGpuKernel(Exception):
  """No Pallas GPU kernel can run this problem on the targeted GPU (the message says why)."""


def _gpu_kernels(backend: GpuBackend, seg: Segments, itemsize: int, *, backward: bool, op: str,
                 extra_bytes: int = 0):
  """The GPU kernel module for ``seg``: Mosaic GPU when asked for and able, else Triton.

  ``extra_bytes``: the residual form's further rows, bytes per element (the
  residual and h forward, dh backward; ``mosaic_gpu.unsupported``).
  """
  gpu, _ = _backends()
  if backend.name != "mosaic_gpu":
    return gpu
  from jax_normgrad.pallas import mosaic_gpu  # pylint: disable=g-import-not-at-top
  reason = mosaic_gpu.unsupported(seg, itemsize, backward=backward, extra_bytes=extra_bytes)
  if reason is None:
    return mosaic_gpu
  if backend.forced:
    raise ValueError(f"{op}: implementation='mosaic_gpu' cannot run this problem: {reason}")
  if backend.no_triton:
    raise NoGpuKernel(f"the Mosaic GPU kernels cannot run this problem ({reason}), and "
                      f"{backend.no_triton}")
  from jax_normgrad import _implementation  # pylint: disable=g-import-not-at-top
  _implementation.warn_once(
      f"jax_normgrad: {op}: the Mosaic GPU kernels (JAX_NORMGRAD_GPU_BACKEND=mosaic_gpu) cannot "
      f"run this problem ({reason}); the Triton kernels run it instead.")
  return gpu


def dispatch(gpu_fn, tpu_fn, arrays, *, interpret: bool, mosaic_gpu: bool = False, **static):
  """Runs ``gpu_fn`` on CUDA/ROCm, ``tpu_fn`` on TPU, either interpreted on CPU.

  The lowering rule is shared by every platform and only says whether to
  interpret, so the GPU/TPU choice is staged with ``lax.platform_dependent``:
  the branch of the platform being lowered is the only one compiled. On CPU
  the tuning's ``interpret_backend`` picks which kernels the interpreter runs,
  unless ``gpu_fn`` is a Mosaic GPU kernel (``mosaic_gpu``), which runs in
  Pallas' GPU interpret mode. Both return the final outputs, so the branches
  have the same types.
  """
  if interpret:
    use_tpu = config.current().interpret_backend == "tpu" and not mosaic_gpu
    fn = tpu_fn if use_tpu else gpu_fn
    return fn(*arrays, interpret=True, **static)
  gpu = functools.partial(gpu_fn, interpret=False, **static)
  return lax.platform_dependent(*arrays, cuda=gpu, rocm=gpu,
                                tpu=functools.partial(tpu_fn, interpret=False, **static))


def _backends():
  """The kernel modules, imported on first lowering: importing Pallas costs about
  0.3 s, which ``import jax_normgrad`` should not pay on CPU."""
  from jax_normgrad.pallas import gpu, tpu  # pylint: disable=g-import-not-at-top
  return gpu, tpu


def _residual_kernels(gpu_backend: GpuBackend, seg: Segments, itemsize: int, *, backward: bool,
                      op: str, extra_bytes: int):
  """The GPU kernel module for the residual form (``_gpu_kernels``).

  Every GPU kernel module fuses the residual (``FUSES_RESIDUAL``): its
  ``forward`` takes ``residual`` and ``h_dtype``, its ``backward`` ``dh``; the
  TPU kernels do too. ``extra_bytes``: the residual's and h's bytes per
  element forward, dh's backward.
  """
  kernels = _gpu_kernels(gpu_backend, seg, itemsize, backward=backward, op=op,
                         extra_bytes=extra_bytes)
  assert getattr(kernels, "FUSES_RESIDUAL", False), kernels.__name__
  return kernels


def forward(seg: Segments, x, weight, bias, *, eps: float, interpret: bool, y_dtype=None,
            gpu_backend: GpuBackend = TRITON, op: str = "norm_fwd", residual=None, h_dtype=None):
  """``(y, mean | None, rstd)``: ``y`` like x ``(n, a, b)``, statistics ``(n, groups)`` float32.

  y is in ``y_dtype`` (None: x's). A float32 y from a 16-bit x widens x first
  (exactly; an XLA convert), so y is rounded once. A 16-bit y from a float32
  x is written by the Triton and TPU kernels themselves (``y_dtype`` passed
  on); the Mosaic GPU kernels write float32 and XLA rounds it after them.

  ``residual`` (x's shape, x's dtype or float32): the kernels normalize
  ``h = x + residual``, summed in float32 tile by tile (statistics and y from
  the unrounded sum), and also write h in ``h_dtype`` (None: x's): the
  result is ``(y, mean | None, rstd, h)``.
  """
  narrow = {}
  if y_dtype is not None and jnp.dtype(y_dtype) != x.dtype:
    if jnp.dtype(y_dtype).itemsize < x.dtype.itemsize:
      narrow = dict(y_dtype=jnp.dtype(y_dtype))  # the kernels round y themselves
    else:
      x = x.astype(y_dtype)
  gpu, tpu = _backends()
  stats = jnp.zeros((seg.n, seg.groups), F32)
  if residual is not None:
    h_dtype = jnp.dtype(h_dtype or x.dtype)
    if x.size == 0:
      return jnp.zeros_like(x), (stats if seg.centered else None), stats, jnp.zeros(x.shape, h_dtype)
    kernels = _residual_kernels(gpu_backend, seg, x.dtype.itemsize, backward=False, op=op,
                                extra_bytes=residual.dtype.itemsize + h_dtype.itemsize)
    return dispatch(kernels.forward, tpu.forward, (x, residual, weight, bias),
                    interpret=interpret, mosaic_gpu=kernels is not gpu, seg=seg, eps=eps,
                    h_dtype=h_dtype)
  if x.size == 0:
    return (jnp.zeros(x.shape, narrow.get("y_dtype", x.dtype)), (stats if seg.centered else None),
            stats)
  kernels = _gpu_kernels(gpu_backend, seg, x.dtype.itemsize, backward=False, op=op)
  return dispatch(kernels.forward, tpu.forward, (x, weight, bias), interpret=interpret,
                  mosaic_gpu=kernels is not gpu, seg=seg, eps=eps, **narrow)


def backward(seg: Segments, dy, x, mean, rstd, gamma, mask, *, interpret: bool,
             gpu_backend: GpuBackend = TRITON, op: str = "norm_bwd", beta=None, dh=None,
             dx_dy: bool = False):
  """``(dx | None, dgamma | None, dbeta | None)`` for ``mask`` (three bools), [dx in dy's dtype].

  ``beta`` is read only with ``seg.activation`` (the kernels then take it
  after gamma).

  ``dx`` like x; ``dgamma``, ``dbeta`` of shape ``(param_groups, channels)``
  float32. Empty inputs give an empty ``dx`` and zero parameter gradients.
  ``dy`` may be float32 with a 16-bit x (the backward of a float32 y), or
  16-bit with a float32 x (the residual form's float32 h). GPU kernel
  modules with ``MIXED_DTYPES`` (Triton's) and the TPU kernels read each in
  its own dtype, write dx in x's and, with ``dx_dy`` (needs ``mask[0]``), dx
  once more rounded to dy's dtype. The Mosaic GPU kernels take one dtype:
  with them x and dy are widened (exactly) in XLA, and dx rounded to x's
  (and dy's) dtype after them (the TPU branch then gets the same). ``dh``
  (x's shape; needs ``mask[0]``): added to dx in float32 in the kernels'
  output pass, before dx's rounding.
  """
  gpu, tpu = _backends()
  assert mask[0] or not dx_dy, "dx_dy needs dx"
  if not any(mask):
    return (None, None, None)
  if x.size == 0:
    zeros = jnp.zeros((seg.param_groups, seg.channels), F32)
    return (jnp.zeros_like(x) if mask[0] else None,) + tuple(
        zeros if m else None for m in mask[1:]) + ((jnp.zeros_like(dy),) if dx_dy else ())
  x_dtype, dy_dtype = x.dtype, dy.dtype
  if dh is not None:  # the residual form (rows; no activation, so no beta)
    kernels = _residual_kernels(gpu_backend, seg, x.dtype.itemsize, backward=True, op=op,
                                extra_bytes=dh.dtype.itemsize)
    operands = (dy, x, mean, rstd, gamma, None, dh)
  else:
    kernels = _gpu_kernels(gpu_backend, seg, x.dtype.itemsize, backward=True, op=op)
    params = (gamma, beta) if seg.activation is not None else (gamma,)
    operands = (dy, x, mean, rstd) + params
  # Whether the GPU kernels read dy and x in their own dtypes; the TPU
  # branch of ``dispatch`` takes the same operands and ``dx_dy`` (its kernels
  # read mixed dtypes too).
  mixed = getattr(kernels, "MIXED_DTYPES", False)
  if dy_dtype != x_dtype and not mixed:
    operands = (dy.astype(F32), x.astype(F32)) + operands[2:]
  outs = dispatch(kernels.backward, tpu.backward, operands, interpret=interpret,
                  mosaic_gpu=kernels is not gpu, seg=seg, mask=tuple(mask),
                  **(dict(dx_dy=dx_dy) if mixed else {}))
  dx, dgamma, dbeta = outs[:3]
  rest = ()
  if dx_dy:
    rest = (outs[3],) if mixed else (dx.astype(dy_dtype),)
  return ((None if dx is None else dx.astype(x_dtype)), dgamma, dbeta) + rest
