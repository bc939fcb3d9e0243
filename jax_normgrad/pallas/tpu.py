"""Pallas Mosaic kernels for TPU: a sequential grid per TensorCore with resident float32 accumulators.

A TPU runs a Pallas grid as a loop on each TensorCore; the leading
"parallel" axes (parameter group, channel group, program) are shared out
between the cores of a megacore chip. Each program walks its contiguous
range of sample blocks along an "arbitrary" axis while its partial
parameter gradients stay in one output block in VMEM: the accumulation is
sequential, hence deterministic, with no atomics. The programs' partials
are added afterwards in a fixed order (``common.ordered_sum``).

Blocks obey the (8, 128) tiling rule: the last two block dims are either
whole array dims or multiples of (8 or 16, 128). Ragged edges are masked
with iotas: padding values are never summed (``where``, not a multiply, so
that NaN garbage cannot leak). A segment too long for one block is done in
two kernels: one accumulates its statistics over the chunks, the other
uses them. float16, which Mosaic handles on few chips, is computed in
float32 (converted outside the kernels).

Interpreted (``interpret=True``, on CPU) the kernels run under Pallas'
generic interpreter, or under its TPU interpret mode inside
``tpu_interpret_mode`` (tests): simulated VMEM and TensorCores, race
detection, uninitialized memory NaN.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jax_normgrad.pallas import common, config

F32 = jnp.float32
_PARALLEL = ("w", "g", "p")


def _lane_group_sum(v, groups: int, cg: int):
  """Sums each run of ``cg`` lanes of ``v`` and broadcasts the sum back over the run."""
  if cg == 1:
    return v
  if groups == 1:
    return jnp.broadcast_to(jnp.sum(v, axis=-1, keepdims=True), v.shape)
  lane = lax.broadcasted_iota(jnp.int32, (1, v.shape[-1]), 1)

  def group(k, out):
    inside = (lane >= k * cg) & (lane < (k + 1) * cg)
    return jnp.where(inside, jnp.sum(jnp.where(inside, v, 0.0), axis=-1, keepdims=True), out)

  return lax.fori_loop(0, groups, group, jnp.zeros_like(v))


class _Layout:
  """How one ``Segments`` kind maps onto TPU blocks; subclasses fill in the specifics.

  Grid axes are named: ``w`` parameter group, ``g`` channel group, ``p``
  program, ``s`` sample block of the program, ``c``/``h`` chunks of a
  segment. ``main_order`` is the backward's grid (partials accumulate over
  ``main_acc``), ``stats_order`` the grid of the kernels that accumulate a
  segment's statistics over its chunks (``stats_acc``). Operand kinds:
  ``data`` (x, dy, dx, y), ``stats`` (mean, rstd, c1, c2), ``param``
  (weight, bias), ``partial`` (the per-program parameter gradients).
  """

  main_order: tuple[str, ...]
  main_acc: tuple[str, ...]
  stats_order: tuple[str, ...]
  stats_acc: tuple[str, ...]
  chunk_axes: tuple[str, ...]

  def __init__(self, seg: common.Segments, sample_tile: int):
    self.seg = seg
    self.blocks_per_group = config.cdiv(seg.per_group, sample_tile)
    self.programs, self.steps = config.tpu_split(self.blocks_per_group)
    self.sizes = {"w": seg.param_groups, "g": seg.groups, "p": self.programs, "s": self.steps}

  @property
  def fused(self) -> bool:
    return all(self.sizes[a] == 1 for a in self.chunk_axes)

  @property
  def idle(self) -> bool:
    """Whether the last program has steps past the last sample block (idle steps)."""
    return self.programs * self.steps > self.blocks_per_group

  # Helpers of the index maps and kernels.
  def sample_block(self, ids):
    """The block of samples of step ``s`` of program ``p`` (ids as ``pinned`` gives them)."""
    return ids["p"] * self.steps + ids["s"]

  def in_range(self, ids):
    return ids["p"] * self.steps + ids["s"] < self.blocks_per_group

  def pinned(self, ids, order):
    """The grid ids an index map sees: an idle step's are its program's last real step's.

    That is the last sample block, with every axis inside ``s`` in ``order``
    at its last value, the ids of the grid point just before the idle steps:
    no block index changes, so an idle step fetches nothing and writes
    nothing back (an output block is never revisited after another one),
    and the kernels skip it (``_call``).
    """
    if not self.idle:
      return ids
    idle = jnp.logical_not(self.in_range(ids))
    out = dict(ids, s=jnp.where(idle, self.blocks_per_group - 1 - ids["p"] * self.steps, ids["s"]))
    for a in order[order.index("s") + 1:]:
      out[a] = jnp.where(idle, self.sizes[a] - 1, ids[a])
    return out

  def first(self, ids, axes):
    return functools.reduce(jnp.logical_and, [ids[a] == 0 for a in axes], True)

  def last(self, ids, axes):
    return functools.reduce(jnp.logical_and, [ids[a] == self.sizes[a] - 1 for a in axes], True)

  def grid(self, order):
    return tuple(self.sizes[a] for a in order)

  def spec(self, kind: str, order):
    index = getattr(self, f"{kind}_index")
    return pl.BlockSpec(getattr(self, f"{kind}_block"),
                        lambda *grid_ids: index(self.pinned(dict(zip(order, grid_ids)), order)))

  def sample_mask(self, ids):
    """Mask of the valid samples of a block (None: blocks are never ragged)."""
    return None

  def inner_mask(self, ids):
    """Mask of the in-segment elements of a chunked block (None: not chunked)."""
    return None


class _Rows(_Layout):
  """LayerNorm: x as ``(W, M/W, H)``; blocks ``(tm, th)``, a segment per sublane row."""

  main_order, main_acc = ("w", "p", "h", "s"), ("s",)
  stats_order, stats_acc = ("w", "p", "s", "h"), ("h",)
  chunk_axes = ("h",)

  def __init__(self, seg, itemsize):
    self.tm, self.th = config.tpu_rows_tiles(seg.per_group, seg.minor, itemsize)
    super().__init__(seg, self.tm)
    self.sizes["h"] = config.cdiv(seg.minor, self.th)
    w, mw, h = seg.param_groups, seg.per_group, seg.minor
    self.data_shape, self.stats_shape = (w, mw, h), (w, mw, 1)
    self.partial_shape = (w, self.programs, 1, h)
    self.data_block, self.stats_block = (None, self.tm, self.th), (None, self.tm, 1)
    self.param_block, self.partial_block = (None, 1, self.th), (None, None, 1, self.th)

  def data_index(self, ids):
    return ids["w"], self.sample_block(ids), ids["h"]

  def stats_index(self, ids):
    return ids["w"], self.sample_block(ids), 0

  def param_index(self, ids):
    return ids["w"], 0, ids["h"]

  def partial_index(self, ids):
    return ids["w"], ids["p"], 0, ids["h"]

  def view_stats(self, s):
    return s.reshape(self.stats_shape)

  def unview_stats(self, s):
    return s.reshape(self.seg.n, 1)

  def view_param(self, p):
    return p.reshape(self.seg.param_groups, 1, self.seg.minor)

  def seg_sum(self, v):
    return jnp.sum(v, axis=1, keepdims=True)

  def param_sum(self, v):
    return jnp.sum(v, axis=0, keepdims=True)

  def sample_mask(self, ids):
    if self.seg.per_group % self.tm == 0:
      return None
    rows = lax.broadcasted_iota(jnp.int32, (self.tm, self.th), 0)
    return (ids["p"] * self.steps + ids["s"]) * self.tm + rows < self.seg.per_group

  def inner_mask(self, ids):
    if self.seg.minor % self.th == 0:
      return None
    cols = lax.broadcasted_iota(jnp.int32, (self.tm, self.th), 1)
    return ids["h"] * self.th + cols < self.seg.minor


class _ChannelsFirst(_Layout):
  """GroupNorm NCHW: x as ``(W, N/W, G, C/G, HW)``; blocks ``(tn, tc, thw)`` of one group."""

  main_order, main_acc = ("w", "g", "p", "c", "s", "h"), ("s", "h")
  stats_order, stats_acc = ("w", "g", "p", "s", "c", "h"), ("c", "h")
  chunk_axes = ("c", "h")

  def __init__(self, seg, itemsize):
    self.tn, self.tc, self.thw = config.tpu_channels_first_tiles(seg.per_group, seg.cg, seg.minor,
                                                                 itemsize)
    super().__init__(seg, self.tn)
    self.sizes["c"], self.sizes["h"] = config.cdiv(seg.cg, self.tc), config.cdiv(seg.minor, self.thw)
    w, nw, g, cg, hw = seg.param_groups, seg.per_group, seg.groups, seg.cg, seg.minor
    self.data_shape, self.stats_shape = (w, nw, g, cg, hw), (w, nw, g, 1, 1)
    self.partial_shape = (w, self.programs, g, 1, cg, 1)
    self.data_block, self.stats_block = (None, self.tn, None, self.tc, self.thw), (
        None, self.tn, None, 1, 1)
    self.param_block, self.partial_block = (None, None, self.tc, 1), (
        None, None, None, 1, self.tc, 1)

  def data_index(self, ids):
    return ids["w"], self.sample_block(ids), ids["g"], ids["c"], ids["h"]

  def stats_index(self, ids):
    return ids["w"], self.sample_block(ids), ids["g"], 0, 0

  def param_index(self, ids):
    return ids["w"], ids["g"], ids["c"], 0

  def partial_index(self, ids):
    return ids["w"], ids["p"], ids["g"], 0, ids["c"], 0

  def view_stats(self, s):
    return s.reshape(self.stats_shape)

  def unview_stats(self, s):
    return s.reshape(self.seg.n, self.seg.groups)

  def view_param(self, p):
    return p.reshape(self.seg.param_groups, self.seg.groups, self.seg.cg, 1)

  def seg_sum(self, v):
    return jnp.sum(jnp.sum(v, axis=2, keepdims=True), axis=1, keepdims=True)

  def param_sum(self, v):
    return jnp.sum(jnp.sum(v, axis=2, keepdims=True), axis=0, keepdims=True)

  def inner_mask(self, ids):
    if self.fused:
      return None
    shape = (self.tc, self.thw)
    chans = ids["c"] * self.tc + lax.broadcasted_iota(jnp.int32, shape, 0) < self.seg.cg
    space = ids["h"] * self.thw + lax.broadcasted_iota(jnp.int32, shape, 1) < self.seg.minor
    return (chans & space)[None]


class _ChannelsLast(_Layout):
  """GroupNorm NHWC: x as ``(W, N/W, HW, C)``; blocks ``(tn, thw, C)``, groups as lane runs.

  The statistics are kept per channel (``(tn, 1, C)``, each group's value
  repeated over its channels), so they broadcast against the block.
  """

  main_order, main_acc = ("w", "p", "s", "h"), ("s", "h")
  stats_order, stats_acc = ("w", "p", "s", "h"), ("h",)
  chunk_axes = ("h",)

  def __init__(self, seg, itemsize):
    self.tn, self.thw = config.tpu_channels_last_tiles(seg.per_group, seg.major, seg.minor, itemsize)
    super().__init__(seg, self.tn)
    self.sizes["h"] = config.cdiv(seg.major, self.thw)
    w, nw, hw, c = seg.param_groups, seg.per_group, seg.major, seg.minor
    self.data_shape, self.stats_shape = (w, nw, hw, c), (w, nw, 1, c)
    self.partial_shape = (w, self.programs, 1, 1, c)
    self.data_block, self.stats_block = (None, self.tn, self.thw, c), (None, self.tn, 1, c)
    self.param_block, self.partial_block = (None, 1, c), (None, None, 1, 1, c)

  def data_index(self, ids):
    return ids["w"], self.sample_block(ids), ids["h"], 0

  def stats_index(self, ids):
    return ids["w"], self.sample_block(ids), 0, 0

  def param_index(self, ids):
    return ids["w"], 0, 0

  def partial_index(self, ids):
    return ids["w"], ids["p"], 0, 0, 0

  def view_stats(self, s):
    return jnp.repeat(s, self.seg.cg, axis=1).reshape(self.stats_shape)

  def unview_stats(self, s):
    return s.reshape(self.seg.n, self.seg.minor)[:, ::self.seg.cg]

  def view_param(self, p):
    return p.reshape(self.seg.param_groups, 1, self.seg.minor)

  def seg_sum(self, v):
    return _lane_group_sum(jnp.sum(v, axis=1, keepdims=True), self.seg.groups, self.seg.cg)

  def param_sum(self, v):
    return jnp.sum(jnp.sum(v, axis=1, keepdims=True), axis=0, keepdims=True)

  def inner_mask(self, ids):
    if self.fused:
      return None
    rows = lax.broadcasted_iota(jnp.int32, (self.thw, self.seg.minor), 0)
    return (ids["h"] * self.thw + rows < self.seg.major)[None]


_LAYOUTS = {"rows": _Rows, "channels_first": _ChannelsFirst, "channels_last": _ChannelsLast}


def _ids(order):
  return {a: pl.program_id(i) for i, a in enumerate(order)}


def _masked(v, mask):
  return v if mask is None else jnp.where(mask, v, 0.0)


# ----------------------------------------------------------------------------
# TPU interpret mode (tests)

_interpret_params: pltpu.InterpretParams | None = None
#: The TPU interpreter keeps one process-wide simulated TPU per kernel: one at a time.
_INTERPRET_LOCK = threading.Lock()


@contextlib.contextmanager
def tpu_interpret_mode(params: pltpu.InterpretParams) -> Iterator[None]:
  """Kernels lowered inside the block with ``interpret=True`` run in Pallas' TPU interpret mode.

  ``params`` (``pltpu.InterpretParams``) is passed as each ``pallas_call``'s
  ``interpret``: simulated memory spaces and cores (``num_cores_or_threads``
  shares the "parallel" axes out as on a megacore chip), ``detect_races``
  (a race is printed: "RACE DETECTED"), ``uninitialized_memory="nan"``. The
  setting is read when a function is lowered: lower fresh functions inside
  (``jax.clear_caches()``). ``forward`` and ``backward`` also take such an
  object as ``interpret`` directly.
  """
  global _interpret_params  # pylint: disable=global-statement
  saved, _interpret_params = _interpret_params, params
  try:
    yield
  finally:
    _interpret_params = saved


def _interpret_mode(interpret):
  """``interpret`` as ``pallas_call`` takes it: False, True, or the TPU interpret mode's params."""
  if interpret is True and _interpret_params is not None:
    return _interpret_params
  return interpret


def _in_own_computation(fn, arrays):
  """``fn(*arrays)`` run by a host callback as a jitted computation of its own, one at a time.

  TPU interpret mode runs a kernel as ordered host callbacks, an effect that
  a primitive's lowering (where the kernels are traced) cannot declare; a
  computation of its own declares it. ``_INTERPRET_LOCK`` keeps kernels of
  concurrent computations (the devices of a sharded one) apart.
  """
  jitted = jax.jit(fn)

  def host(*args):
    with _INTERPRET_LOCK:
      return jax.tree.map(np.asarray, jitted(*args))

  return jax.pure_callback(host, jax.eval_shape(fn, *arrays), *arrays)


def _call(lay: _Layout, order, kernel, inputs, outputs, *, interpret, name, scratch=()):
  """``pallas_call`` over ``lay``'s grid in ``order``; operands as ``(kind, array | None)``.

  ``kernel(*refs, ids=)`` gets the grid ids by axis name; idle steps
  (``_Layout.pinned``) do not run it.
  """
  inputs = [(k, a) for k, a in inputs if a is not None]
  semantics = tuple(pltpu.PARALLEL if a in _PARALLEL else pltpu.ARBITRARY for a in order)
  mode = _interpret_mode(interpret)

  def body(*refs):
    # The ids are read here, outside the guard: Pallas' generic interpreter
    # lowers no program_id inside a cond.
    ids = _ids(order)
    if lay.idle:
      pl.when(lay.in_range(ids))(lambda: kernel(*refs, ids=ids))
    else:
      kernel(*refs, ids=ids)

  def run(*arrays):
    return pl.pallas_call(
        body,
        out_shape=common.typed_like([s for _, s in outputs], arrays),
        grid=lay.grid(order),
        in_specs=[lay.spec(k, order) for k, _ in inputs],
        out_specs=[lay.spec(k, order) for k, _ in outputs],
        scratch_shapes=scratch,
        interpret=mode,
        compiler_params=pltpu.CompilerParams(dimension_semantics=semantics),
        name=name,
    )(*arrays)

  arrays = [a for _, a in inputs]
  if not isinstance(mode, bool):  # TPU interpret mode's params
    return _in_own_computation(run, arrays)
  return run(*arrays)


def _param(ref):
  return None if ref is None else ref[...]


# ----------------------------------------------------------------------------
# Forward


def _input(x_ref, r_ref, h_dtype):
  """A block of the normalized input, float32: x, or with a residual h = x + residual as it
  is stored in ``h_dtype`` (``common.stored_sum``)."""
  x = x_ref[...].astype(F32)
  return x if r_ref is None else common.stored_sum(x, r_ref[...].astype(F32), h_dtype)


def _fwd_kernel(*refs, ids, lay: _Layout, eps: float, has_weight: bool, has_bias: bool,
                has_residual: bool, h_dtype=None):
  """Segments within one block: statistics and y from a single read of x (and the residual:
  h, their float32 sum as stored in ``h_dtype``, is what is normalized and written)."""
  del ids  # a block is a whole segment
  seg = lay.seg
  x_ref, r_ref, w_ref, b_ref, y_ref, mean_ref, rstd_ref, h_ref = common.unpack(
      refs, True, has_residual, has_weight, has_bias, True, seg.centered, True, has_residual)
  x = _input(x_ref, r_ref, h_dtype)
  if has_residual:
    h_ref[...] = x.astype(h_ref.dtype)
  mean = lay.seg_sum(x) / seg.count if seg.centered else None
  xc = x - mean if seg.centered else x
  rstd = common.inv_std(lay.seg_sum(xc * xc) / seg.count, eps)
  y_ref[...] = common.normalize(xc, rstd, _param(w_ref), _param(b_ref),
                                seg.activation).astype(y_ref.dtype)
  if seg.centered:
    mean_ref[...] = mean
  rstd_ref[...] = rstd


def _moments_kernel(*refs, ids, lay: _Layout, eps: float, has_residual: bool = False,
                    h_dtype=None):
  """Long segments: mean and rstd merged chunk by chunk (``common.combine_moments``)."""
  seg = lay.seg
  x_ref, r_ref, mean_ref, rstd_ref, count_sc, mean_sc, m2_sc = common.unpack(
      refs, True, has_residual, seg.centered, True, seg.centered, seg.centered, True)
  inner = lay.inner_mask(ids)
  x = _input(x_ref, r_ref, h_dtype)
  xm = _masked(x, inner)

  @pl.when(lay.first(ids, lay.stats_acc))
  def _():
    for ref in (count_sc, mean_sc, m2_sc):
      if ref is not None:
        ref[...] = jnp.zeros_like(ref)

  if seg.centered:
    n = lay.seg_sum(_masked(jnp.ones_like(x), inner))
    m = lay.seg_sum(xm) / n
    d = _masked(x - m, inner)
    state = common.combine_moments((count_sc[...], mean_sc[...], m2_sc[...]),
                                   (n, m, lay.seg_sum(d * d)))
    count_sc[...], mean_sc[...], m2_sc[...] = state
  else:
    m2_sc[...] += lay.seg_sum(xm * xm)

  @pl.when(lay.last(ids, lay.stats_acc))
  def _():
    if seg.centered:
      mean_ref[...] = mean_sc[...]
    rstd_ref[...] = common.inv_std(m2_sc[...] / seg.count, eps)


def _normalize_kernel(*refs, ids, lay: _Layout, has_weight: bool, has_bias: bool,
                      has_residual: bool = False, h_dtype=None):
  """Long segments, second pass: ``y`` (and h) from the finished statistics."""
  del ids  # elementwise
  x_ref, r_ref, mean_ref, rstd_ref, w_ref, b_ref, y_ref, h_ref = common.unpack(
      refs, True, has_residual, lay.seg.centered, True, has_weight, has_bias, True, has_residual)
  x = _input(x_ref, r_ref, h_dtype)
  if has_residual:
    h_ref[...] = x.astype(h_ref.dtype)
  xc = x - mean_ref[...] if mean_ref is not None else x
  y_ref[...] = common.normalize(xc, rstd_ref[...], _param(w_ref), _param(b_ref),
                                lay.seg.activation).astype(y_ref.dtype)


def _compute_dtype(x):
  return _computed_in(x.dtype)


def _computed_in(dtype):
  """The dtype the TPU kernels compute a ``dtype`` operand in: float16 widened, else its own."""
  return jnp.dtype(F32) if jnp.dtype(dtype) == jnp.float16 else jnp.dtype(dtype)


def describe(problem, *, interpret) -> common.KernelPlan:
  """The kernels ``forward`` / ``backward`` launch for ``problem`` (a ``kernels.Problem``), and
  their plan (``explain``): the layout's blocks, fused (a segment in one block) or chunked (the
  forward's moments then apply kernels; the backward's statistics kernel first where dx is
  asked for)."""
  del interpret
  seg, mask = problem.seg, problem.mask
  itemsize = lambda name: _computed_in(name).itemsize
  if problem.backward:
    lay = _LAYOUTS[seg.kind](seg, min(itemsize(problem.dtype), itemsize(problem.dy_dtype)))
    names = (("bwd_stats",) if mask[0] and not lay.fused else ()) + ("bwd",)
  else:
    lay = _LAYOUTS[seg.kind](seg, itemsize(problem.dtype))
    names = ("fwd",) if lay.fused else ("fwd_moments", "fwd_apply")
  block = "x".join(str(d) for d in lay.data_block if d is not None)
  order = lay.main_order if problem.backward else lay.stats_order
  grid = "x".join(str(d) for d in lay.grid(order))
  return common.KernelPlan(("fused " if lay.fused else "chunked ") + common.KINDS[seg.kind],
                            tuple(f"jax_normgrad_norm_{n}" for n in names),
                            f"blocks of {block}, grid {grid}")


def forward(x, *operands, seg: common.Segments, eps: float, interpret, h_dtype=None,
            y_dtype=None):
  """``(y, mean | None, rstd)``, or with a residual ``(x, residual, weight, bias)`` and
  ``h_dtype``, ``(y, mean | None, rstd, h)``; see ``kernels.forward``. y in
  ``y_dtype`` (None: x's; a 16-bit one with a float32 x). ``interpret``: a bool, or
  a ``pltpu.InterpretParams`` (TPU interpret mode; see ``tpu_interpret_mode``)."""
  has_residual = h_dtype is not None
  residual, weight, bias = operands if has_residual else (None, *operands)
  if has_residual and _computed_in(h_dtype) != h_dtype:
    # A float16 h, which the kernels do not compute in: summed and rounded by XLA (beside
    # the widening of x and the residual that float16 takes anyway), then normalized.
    h = common.stored_sum(x.astype(F32), residual.astype(F32), h_dtype)
    y, mean, rstd = forward(h, weight, bias, seg=seg, eps=eps, interpret=interpret,
                            y_dtype=y_dtype or x.dtype)
    return y, mean, rstd, h.astype(h_dtype)
  out_dtype = jnp.dtype(y_dtype or x.dtype)
  x = x.astype(_compute_dtype(x))
  lay = _LAYOUTS[seg.kind](seg, x.dtype.itemsize)
  xv = x.reshape(lay.data_shape)
  data = [("data", xv)]
  h_out, res_flags = [], dict(has_residual=has_residual)
  if has_residual:
    data.append(("data", residual.astype(_compute_dtype(residual)).reshape(lay.data_shape)))
    h_out = [("data", jax.ShapeDtypeStruct(xv.shape, h_dtype))]
    res_flags["h_dtype"] = h_dtype
  params = [("param", None if p is None else lay.view_param(p)) for p in (weight, bias)]
  stats = jax.ShapeDtypeStruct(lay.stats_shape, F32)
  stat_outs = [("stats", stats)] * (1 + seg.centered)
  flags = dict(has_weight=weight is not None, has_bias=bias is not None)
  y_out = [("data", jax.ShapeDtypeStruct(xv.shape, _computed_in(out_dtype)))]
  if lay.fused:
    y, *st = _call(lay, lay.stats_order,
                   functools.partial(_fwd_kernel, lay=lay, eps=eps, **res_flags, **flags),
                   data + params, y_out + stat_outs + h_out,
                   interpret=interpret, name="jax_normgrad_norm_fwd")
    h = st.pop() if has_residual else None
  else:
    scratch = [pltpu.VMEM(tuple(d for d in lay.stats_block if d is not None), F32)]
    st = _call(lay, lay.stats_order,
               functools.partial(_moments_kernel, lay=lay, eps=eps, **res_flags),
               data, stat_outs, interpret=interpret, name="jax_normgrad_norm_fwd_moments",
               scratch=scratch * (3 if seg.centered else 1))
    y, *h = _call(lay, lay.stats_order,
                  functools.partial(_normalize_kernel, lay=lay, **res_flags, **flags),
                  data + [("stats", s) for s in st] + params, y_out + h_out,
                  interpret=interpret, name="jax_normgrad_norm_fwd_apply")
    h = h[0] if has_residual else None
  y = y.reshape(x.shape).astype(out_dtype)
  st = [lay.unview_stats(s) for s in st]
  out = (y, *st) if seg.centered else (y, None, st[0])
  return out + (h.reshape(x.shape),) if has_residual else out


# ----------------------------------------------------------------------------
# Backward


def _terms(x_ref, dy_ref, mean_ref, rstd_ref, gamma_ref, beta_ref, activation):
  """The float32 ``(xhat, g, dy, rstd)`` of a block (dy: of the pre-activation value)."""
  x = x_ref[...].astype(F32)
  mean, rstd, gamma = _param(mean_ref), rstd_ref[...], _param(gamma_ref)
  dy = common.pre_activation_grad(dy_ref[...].astype(F32), x, mean, rstd, gamma,
                                  _param(beta_ref), activation)
  xhat, g = common.xhat_and_g(x, dy, mean, rstd, gamma)
  return xhat, g, dy, rstd


def _bwd_stats_kernel(*refs, ids, lay: _Layout, has_gamma: bool, has_beta: bool):
  """Long segments: ``c1 = mean(g)``, ``c2 = mean(g * xhat)`` summed chunk by chunk."""
  seg = lay.seg
  dy_ref, x_ref, mean_ref, rstd_ref, gamma_ref, beta_ref, c1_ref, c2_ref = common.unpack(
      refs, True, True, seg.centered, True, has_gamma, has_beta, seg.centered, True)
  inner = lay.inner_mask(ids)
  xhat, g, _, _ = _terms(x_ref, dy_ref, mean_ref, rstd_ref, gamma_ref, beta_ref, seg.activation)
  sums = [(c1_ref, g), (c2_ref, g * xhat)]
  sums = [(ref, t) for ref, t in sums if ref is not None]

  @pl.when(lay.first(ids, lay.stats_acc))
  def _():
    for ref, _ in sums:
      ref[...] = jnp.zeros_like(ref)

  for ref, t in sums:
    ref[...] += lay.seg_sum(_masked(t, inner))

  @pl.when(lay.last(ids, lay.stats_acc))
  def _():
    for ref, _ in sums:
      ref[...] = ref[...] / seg.count


def _bwd_kernel(*refs, ids, lay: _Layout, mask, has_gamma: bool, has_beta: bool,
                has_dh: bool = False, dx_dy: bool = False):
  """dx from one read of x and dy; partials accumulated in the resident output block.

  ``c1``/``c2`` come from the block itself when segments fit in one,
  else from the stats kernel. h's cotangent ``dh`` (the residual form) is
  added to dx before its rounding; ``dx_dy`` writes dx a second time,
  rounded to dy's dtype. Partial sums skip ragged padding.
  """
  seg = lay.seg
  precomputed = mask[0] and not lay.fused
  (dy_ref, x_ref, mean_ref, rstd_ref, gamma_ref, beta_ref, c1_ref, c2_ref, dh_ref,
   dx_ref, dx2_ref, dw_ref, db_ref) = common.unpack(
       refs, True, True, seg.centered, True, has_gamma, has_beta, precomputed and seg.centered,
       precomputed, has_dh, mask[0], dx_dy, *mask[1:])
  xhat, g, dy, rstd = _terms(x_ref, dy_ref, mean_ref, rstd_ref, gamma_ref, beta_ref,
                             seg.activation)
  if mask[0]:
    if precomputed:
      c1, c2 = _param(c1_ref), c2_ref[...]
    else:
      c1 = lay.seg_sum(g) / seg.count if seg.centered else None
      c2 = lay.seg_sum(g * xhat) / seg.count
    dx = common.grad_input(g, xhat, c1, c2, rstd)
    if has_dh:
      dx = dx + dh_ref[...].astype(F32)
    dx_ref[...] = dx.astype(dx_ref.dtype)
    if dx_dy:
      dx2_ref[...] = dx.astype(dx2_ref.dtype)
  partials = [(ref, t) for ref, t in ((dw_ref, dy * xhat), (db_ref, dy)) if ref is not None]
  if not partials:
    return

  @pl.when(lay.first(ids, lay.main_acc))
  def _():
    for ref, _ in partials:
      ref[...] = jnp.zeros_like(ref)

  valid = lay.inner_mask(ids)
  rows = lay.sample_mask(ids)
  if rows is not None:
    valid = rows if valid is None else valid & rows

  for ref, t in partials:
    ref[...] += lay.param_sum(_masked(t, valid))


def backward(dy, x, mean, rstd, gamma, beta=None, dh=None, *, seg: common.Segments, mask,
             interpret, dx_dy: bool = False):
  """``(dx | None, dgamma | None, dbeta | None)``, [dx in dy's dtype]; see ``kernels.backward``.

  dy and x are read each in its own dtype (float16 widened first, as
  everywhere on TPU), in blocks tiled for the narrower one. ``interpret`` as in
  ``forward``.
  """
  out_dtype, dy_dtype = x.dtype, dy.dtype
  x, dy = x.astype(_compute_dtype(x)), dy.astype(_compute_dtype(dy))
  lay = _LAYOUTS[seg.kind](seg, min(x.dtype.itemsize, dy.dtype.itemsize))
  data = [("data", dy.reshape(lay.data_shape)), ("data", x.reshape(lay.data_shape))]
  stats = [("stats", None if mean is None else lay.view_stats(mean)),
           ("stats", lay.view_stats(rstd))]
  flags = dict(has_gamma=gamma is not None, has_beta=beta is not None)
  params = [("param", None if p is None else lay.view_param(p)) for p in (gamma, beta)]
  cs = []
  if mask[0] and not lay.fused:
    st = jax.ShapeDtypeStruct(lay.stats_shape, F32)
    cs = _call(lay, lay.stats_order, functools.partial(_bwd_stats_kernel, lay=lay, **flags),
               data + stats + params, [("stats", st)] * (1 + seg.centered), interpret=interpret,
               name="jax_normgrad_norm_bwd_stats")
  partial = ("partial", jax.ShapeDtypeStruct(lay.partial_shape, F32))
  outs = ([("data", jax.ShapeDtypeStruct(lay.data_shape, x.dtype))] if mask[0] else []) + (
      [("data", jax.ShapeDtypeStruct(lay.data_shape, _compute_dtype(dy)))] if dx_dy else []) + [
      partial] * sum(mask[1:])
  dh_in = [] if dh is None else [("data", dh.astype(_compute_dtype(dh)).reshape(lay.data_shape))]
  res = list(_call(lay, lay.main_order,
                   functools.partial(_bwd_kernel, lay=lay, mask=mask, has_dh=dh is not None,
                                     dx_dy=dx_dy, **flags),
                   data + stats + params + [("stats", c) for c in cs] + dh_in, outs,
                   interpret=interpret, name="jax_normgrad_norm_bwd"))
  dx = res.pop(0).reshape(x.shape).astype(out_dtype) if mask[0] else None
  dx2 = (res.pop(0).reshape(x.shape).astype(dy_dtype),) if dx_dy else ()
  return (dx,) + tuple(
      common.ordered_sum(res.pop(0).reshape(seg.param_groups, lay.programs, seg.channels), 1)
      if m else None for m in mask[1:]) + dx2
