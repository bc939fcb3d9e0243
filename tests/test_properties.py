"""Property-based tests: random shapes, splits, dtypes and options against the float64 reference,
and random invalid arguments, which must raise ValueError or TypeError and nothing else.

The example budget is the hypothesis profile's (tests/conftest.py: "ci" by
default, fixed and derandomized); the "xla" implementation, slower to
compile, gets half of it.
"""

from __future__ import annotations

import math

import hypothesis
import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np
import pytest

import jax_normgrad as jn
from cases import DTYPES, random
import reference_np as ref
from tolerances import assert_close

F32 = jnp.dtype(jnp.float32)
#: Elements of x per example at most: a few ms of kernel time, whatever the shape.
ELEMENTS = 1 << 18
#: The longest normalized row (LayerNorm) / (n, g) block (GroupNorm).
MAX_ROW = 100_000
EPS = st.sampled_from([1e-5, 1e-3, 0.1])
# Row lengths: 1, primes, powers of two and their neighbours, and anything else.
SPECIAL_LENGTHS = [1, 2, 3, 7, 15, 16, 17, 31, 127, 128, 257, 1021, 4096, 4099, 65_521, 99_991, MAX_ROW]

_BUDGET = hypothesis.settings.default.max_examples


def _implementation_settings(implementation):
  """The profile's budget, halved for "xla" (a compile per example dominates)."""
  return hypothesis.settings(max_examples=_BUDGET if implementation is None else max(1, _BUDGET // 2))


def _run(check, implementation, problems):
  """Runs ``check(implementation, problem)`` on the budget's examples of ``problems``."""
  given = hypothesis.given(problems)(check)
  _implementation_settings(implementation)(given)(implementation)


def _divisors(n):
  small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
  return sorted(set(small + [n // d for d in small]))


@st.composite
def or_zero(draw, positive, allow_zero=True):
  """A draw of ``positive``, or 0 one time in eight (st.one_of would pick 0 far more often)."""
  if allow_zero and draw(st.sampled_from([False] * 7 + [True])):
    return 0
  return draw(positive)


def row_lengths(allow_zero=False):
  return or_zero(st.one_of(st.sampled_from(SPECIAL_LENGTHS), st.integers(1, MAX_ROW)), allow_zero)


def sizes(hi):
  """A dim of 1 to ``hi``, or 0."""
  return or_zero(st.integers(1, max(1, hi)))


@st.composite
def splits(draw, n):
  """``n`` as a tuple of 1 to 3 dims with product ``n`` (1-sized dims included)."""
  if n == 0:
    return draw(st.sampled_from([(0,), (0, 3), (2, 0), (1, 0, 5)]))
  dims, rest = [], n
  for _ in range(draw(st.integers(0, 2))):
    d = draw(st.sampled_from(_divisors(rest)))
    dims.append(d)
    rest //= d
  return tuple(dims) + (rest,)


@st.composite
def leading_dims(draw, max_rows):
  """0 to 3 dims (0- and 1-sized included) whose product is at most ``max_rows``."""
  dims, room = [], max_rows
  for _ in range(draw(st.integers(0, 3))):
    d = draw(sizes(min(room, 4096)))
    dims.append(d)
    room //= max(d, 1)
  return tuple(dims)


def _f32(a):
  return None if a is None else np.asarray(jnp.asarray(a).astype(jnp.float32))


def _grad_dtype(weight, bias, x):
  for p in (weight, bias):
    if p is not None:
      return p.dtype
  return x.dtype


# ----------------------------------------------------------------------------
# LayerNorm


@st.composite
def layer_norm_problems(draw, backward):
  dtype = jnp.dtype(draw(st.sampled_from(DTYPES)))
  h = draw(row_lengths(allow_zero=backward))
  norm = draw(splits(h))
  lead = draw(leading_dims(max(1, ELEMENTS // max(h, 1))))
  rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
  x = random(rng, lead + norm, dtype, scale=draw(st.sampled_from([0.1, 2.0])),
             offset=draw(st.sampled_from([0.0, 0.5, 3.0])))
  pdtype = draw(st.sampled_from([dtype, F32]))
  weight = random(rng, norm, pdtype, offset=1.0) if draw(st.booleans()) else None
  bias = random(rng, norm, pdtype) if draw(st.booleans()) else None
  p = dict(x=x, norm=norm, weight=weight, bias=bias, eps=draw(EPS))
  if backward:
    p["dy"] = random(rng, x.shape, dtype)
    p["stats_dtype"] = draw(st.sampled_from([F32, dtype]))
    p["stats_shape"] = draw(st.sampled_from(["keepdims", "flat", "lead"]))
    p["mask"] = draw(st.tuples(st.booleans(), st.booleans(), st.booleans()))
  return p


def _check_layer_norm_fwd(implementation, p):
  x, norm, w, b = p["x"], p["norm"], p["weight"], p["bias"]
  y, mean, rstd = jn.layer_norm_fwd(x, norm, w, b, p["eps"], implementation=implementation)
  y_ref, mean_ref, rstd_ref = ref.ln_fwd(x, len(norm), w, b, p["eps"])
  h = math.prod(norm)
  assert y.shape == x.shape and y.dtype == x.dtype
  assert mean.shape == rstd.shape == mean_ref.shape and mean.dtype == rstd.dtype == F32
  y_scale, mean_scale, rstd_scale = ref.fwd_scales(x, rstd_ref, w)
  assert_close(y, y_ref, x.dtype, h, "y", scale=y_scale)
  assert_close(mean, mean_ref, F32, h, "mean", scale=mean_scale)
  assert_close(rstd, rstd_ref, F32, h, "rstd", scale=rstd_scale)


def _check_layer_norm_backward(implementation, p):
  x, dy, norm, w, b, mask = p["x"], p["dy"], p["norm"], p["weight"], p["bias"], p["mask"]
  lead = x.shape[:x.ndim - len(norm)]
  h, rows = math.prod(norm), math.prod(lead)
  if h:
    mean, rstd = ref.ln_stats(x, len(norm), p["eps"])
  else:  # No elements: any statistics do.
    mean = rstd = np.ones(lead + (1,) * len(norm))
  shape = {"keepdims": mean.shape, "flat": (rows,), "lead": lead}[p["stats_shape"]]
  mean, rstd = (jnp.asarray(s.astype(np.float32).reshape(shape)).astype(p["stats_dtype"])
                for s in (mean, rstd))
  outs = jn.layer_norm_backward(dy, x, norm, mean, rstd, w, b, mask, implementation=implementation)
  refs = ref.ln_bwd(dy, x, len(norm), _f32(mean), _f32(rstd), w)
  pdtype = _grad_dtype(w, b, x)
  for i, (out, expected) in enumerate(zip(outs, refs)):
    if not mask[i]:
      assert out is None
      continue
    shape, dtype = (x.shape, x.dtype) if i == 0 else (norm, pdtype)
    assert out.shape == shape and out.dtype == dtype
    if i == 0:
      assert_close(out, expected, dtype, h, "grad_input", scale=ref.dx_scale(dy, _f32(rstd), w))
    else:
      assert_close(out, expected, dtype, rows, ("grad_weight", "grad_bias")[i - 1])


@pytest.mark.parametrize("implementation", [None, "xla"])
def test_layer_norm_fwd_matches_reference(implementation):
  _run(_check_layer_norm_fwd, implementation, layer_norm_problems(backward=False))


@pytest.mark.parametrize("implementation", [None, "xla"])
def test_layer_norm_backward_matches_reference(implementation):
  _run(_check_layer_norm_backward, implementation, layer_norm_problems(backward=True))


# ----------------------------------------------------------------------------
# GroupNorm


@st.composite
def group_norm_problems(draw, backward):
  dtype = jnp.dtype(draw(st.sampled_from(DTYPES)))
  group = draw(st.sampled_from([1, 2, 3, 4, 7, 8, 32]))
  cg = draw(st.one_of(st.sampled_from([1, 2, 3, 8, 13]), st.integers(1, 64)))
  c = group * cg
  max_hw = max(1, min(MAX_ROW // cg, ELEMENTS // c))
  hw = draw(or_zero(st.one_of(st.integers(1, min(max_hw, 9)), st.integers(1, max_hw)), backward))
  n = draw(sizes(min(17, ELEMENTS // max(c * hw, 1))))
  channels_last = draw(st.booleans())
  # x may have any shape with N*C*HxW elements: the layout's, with the
  # spatial size split in 0 to 2 dims, or flattened.
  spatial = draw(splits(hw)) if hw != 1 else draw(st.sampled_from([(), (1,), (1, 1)]))
  layout = (n,) + spatial + (c,) if channels_last else (n, c) + spatial
  shape = draw(st.sampled_from([layout, (n * c * hw,), (n, c * hw)]))
  rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
  x = random(rng, shape, dtype, scale=draw(st.sampled_from([0.1, 2.0])),
             offset=draw(st.sampled_from([0.0, -0.3, 3.0])))
  pdtype = draw(st.sampled_from([dtype, F32]))
  weight = random(rng, (c,), pdtype, offset=1.0) if draw(st.booleans()) else None
  bias = random(rng, (c,), pdtype) if draw(st.booleans()) else None
  p = dict(x=x, n=n, c=c, hw=hw, group=group, channels_last=channels_last, weight=weight,
           bias=bias, eps=draw(EPS))
  if backward:
    p["dy"] = random(rng, x.shape, dtype)
    p["stats_dtype"] = draw(st.sampled_from([F32, dtype]))
    p["flat_stats"] = draw(st.booleans())
    p["mask"] = draw(st.tuples(st.booleans(), st.booleans(), st.booleans()))
  return p


def _check_group_norm_fwd(implementation, p):
  x, w, b = p["x"], p["weight"], p["bias"]
  args = (p["n"], p["c"], p["hw"], p["group"])
  y, mean, rstd = jn.group_norm_fwd(x, w, b, *args, p["eps"], channels_last=p["channels_last"],
                                    implementation=implementation)
  y_ref, mean_ref, rstd_ref = ref.gn_fwd(x, w, b, *args, p["eps"], p["channels_last"])
  block = p["c"] // p["group"] * p["hw"]
  assert y.shape == x.shape and y.dtype == x.dtype
  assert mean.shape == rstd.shape == (p["n"], p["group"]) and mean.dtype == rstd.dtype == F32
  y_scale, mean_scale, rstd_scale = ref.fwd_scales(x, rstd_ref, w)
  assert_close(y, y_ref, x.dtype, block, "y", scale=y_scale)
  assert_close(mean, mean_ref, F32, block, "mean", scale=mean_scale)
  assert_close(rstd, rstd_ref, F32, block, "rstd", scale=rstd_scale)


def _check_group_norm_backward(implementation, p):
  x, dy, w, mask = p["x"], p["dy"], p["weight"], p["mask"]
  n, c, hw, group = p["n"], p["c"], p["hw"], p["group"]
  if hw:
    _, mean, rstd = ref.gn_fwd(x, None, None, n, c, hw, group, p["eps"], p["channels_last"])
  else:  # No elements: any statistics do.
    mean = rstd = np.ones((n, group))
  shape = (n * group,) if p["flat_stats"] else (n, group)
  mean, rstd = (jnp.asarray(s.astype(np.float32).reshape(shape)).astype(p["stats_dtype"])
                for s in (mean, rstd))
  outs = jn.group_norm_backward(dy, x, mean, rstd, w, n, c, hw, group, mask,
                                channels_last=p["channels_last"], implementation=implementation)
  refs = ref.gn_bwd(dy, x, _f32(mean), _f32(rstd), w, n, c, hw, group, p["channels_last"])
  pdtype = w.dtype if w is not None else x.dtype
  for i, (out, expected) in enumerate(zip(outs, refs)):
    if not mask[i]:
      assert out is None
      continue
    shape, dtype = (x.shape, x.dtype) if i == 0 else ((c,), pdtype)
    assert out.shape == shape and out.dtype == dtype
    if i == 0:
      assert_close(out, expected, dtype, c // group * hw, "grad_input",
                   scale=ref.dx_scale(dy, _f32(rstd), w))
    else:
      assert_close(out, expected, dtype, n * hw, ("grad_gamma", "grad_beta")[i - 1])


@pytest.mark.parametrize("implementation", [None, "xla"])
def test_group_norm_fwd_matches_reference(implementation):
  _run(_check_group_norm_fwd, implementation, group_norm_problems(backward=False))


@pytest.mark.parametrize("implementation", [None, "xla"])
def test_group_norm_backward_matches_reference(implementation):
  _run(_check_group_norm_backward, implementation, group_norm_problems(backward=True))


# ----------------------------------------------------------------------------
# Invalid arguments: a valid call with 1 to 3 of its arguments made invalid
# must raise ValueError or TypeError (the one its rule names, when alone), with
# a message naming an argument it changed. Every change makes its argument
# invalid on its own or against x, whose shape never changes; of the GroupNorm
# sizes (N, C, HxW, group), which are checked against each other, at most one
# changes. So no combination of changes can be valid again.

INVALID_DTYPES = [np.int32, np.uint8, np.bool_, np.complex64, np.float64]


def _array(shape, dtype):
  """A small host array: building it compiles nothing."""
  return np.ones(shape, dtype)


def _other_half(dtype):
  """A supported dtype that is neither ``dtype`` nor float32."""
  return jnp.float16 if dtype == jnp.bfloat16 else jnp.bfloat16


def _bad_dtype_array(draw, shape):
  return _array(shape, draw(st.sampled_from(INVALID_DTYPES)))


def _bad_kind(draw, optional=False):
  """Something that is no array at all (None only where the argument is required)."""
  return draw(st.sampled_from(([] if optional else [None]) + ["array", [1.0, 2.0], object()]))


def _array_changes(draw, name, shape, dtype, x_dtype, stats=False):
  """Changes of an array argument ``name`` of valid ``shape``/``dtype``: (value, error, names)."""
  size = math.prod(shape)
  optional = name in ("weight", "bias", "gamma")
  options = [
      # Other element counts (some arguments are checked by count, not shape).
      lambda: (_array((size + 1,), dtype), ValueError),
      lambda: (_bad_dtype_array(draw, shape), TypeError),
      lambda: (_bad_kind(draw, optional), TypeError),
  ]
  if size:
    options += [lambda: (_array(shape[:-1] + (shape[-1] + 1,), dtype), ValueError),
                lambda: (_array((1,) + tuple(shape) + (2,), dtype), ValueError)]
  if stats or optional:
    # Parameters: x's dtype or float32; statistics: not narrower than x.
    narrower = [d for d in (jnp.float16, jnp.bfloat16) if d != x_dtype]
    options.append(lambda: (_array(shape, draw(st.sampled_from(narrower))), TypeError))
  value, error = draw(st.sampled_from(options))()
  return value, error, (name,)


def _mask_changes(draw):
  options = [
      lambda: (tuple(draw(st.lists(st.booleans(), max_size=5).filter(lambda m: len(m) != 3))),
               ValueError),
      lambda: (tuple(draw(st.sampled_from([1, 0, None, "yes", 1.0])) if i == draw(st.integers(0, 2))
                     else True for i in range(3)), TypeError),
      lambda: (draw(st.sampled_from([None, "TTT", 3, True])), TypeError),
  ]
  value, error = draw(st.sampled_from(options))()
  return value, error, ("output_mask",)


def _eps_changes(draw):
  value, error = draw(st.sampled_from([(-1e-5, ValueError), (float("nan"), ValueError),
                                       (float("inf"), ValueError), ("1e-5", TypeError),
                                       (None, TypeError), (True, TypeError)]))
  return value, error, ("eps",)


def _implementation_changes(draw):
  return draw(st.sampled_from(["cuda", "XLA", "", "triton", 1])), ValueError, ("implementation",)


def _x_changes(draw, shape):
  """x keeps its shape: only its dtype or kind changes."""
  options = [lambda: (_bad_dtype_array(draw, shape), TypeError), lambda: (_bad_kind(draw), TypeError)]
  value, error = draw(st.sampled_from(options))()
  return value, error, ("x", "grad_out")


def _check_invalid_call(fn, args, changes):
  for name, (value, _, _) in changes.items():
    args[name] = value
  errors = {error for _, error, _ in changes.values()}
  expected = errors.pop() if len(changes) == 1 else (ValueError, TypeError)
  with pytest.raises((ValueError, TypeError)) as info:
    fn(**args)
  assert isinstance(info.value, expected), (changes, info.value)
  names = {n for _, _, ns in changes.values() for n in ns}
  assert any(n in str(info.value) for n in names), (changes, info.value)


@st.composite
def layer_norm_invalid_calls(draw, fn):
  dtype = jnp.dtype(draw(st.sampled_from(DTYPES)))
  norm = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=2)))
  lead = tuple(draw(st.lists(st.integers(1, 5), max_size=2)))
  x = _array(lead + norm, dtype)
  pdtype = draw(st.sampled_from([dtype, F32]))
  weight = _array(norm, pdtype) if draw(st.booleans()) else None
  bias = _array(norm, pdtype) if draw(st.booleans()) else None
  rows = math.prod(lead)
  args = dict(x=x, normalized_shape=norm, weight=weight, bias=bias)
  shape_changes = [
      ((), ValueError), ((1,) * (x.ndim + 1), ValueError), (norm[:-1] + (norm[-1] + 1,), ValueError),
      (norm[:-1] + (float(norm[-1]),), TypeError), ("abc", TypeError), (2.5, TypeError)]
  changes = {
      "x": lambda: _x_changes(draw, x.shape),
      "normalized_shape": lambda: draw(st.sampled_from(shape_changes)) + (("normalized_shape", "x"),),
      "weight": lambda: _array_changes(draw, "weight", norm, pdtype, dtype),
      "bias": lambda: _array_changes(draw, "bias", norm, pdtype, dtype),
      "implementation": lambda: _implementation_changes(draw),
  }
  if weight is not None and bias is not None:
    other = dtype if pdtype == F32 else F32
    changes["bias"] = lambda: draw(st.sampled_from([
        _array_changes(draw, "bias", norm, pdtype, dtype), (_array(norm, other), TypeError, ("bias",))]))
  if fn is jn.layer_norm_backward:
    stats_dtype = draw(st.sampled_from([F32, dtype]))
    args.update(grad_out=_array(x.shape, dtype), mean=_array((rows,), stats_dtype),
                rstd=_array((rows,), stats_dtype), output_mask=(True, True, True))
    changes.update({
        "grad_out": lambda: _array_changes(draw, "grad_out", x.shape, dtype, dtype),
        "mean": lambda: _array_changes(draw, "mean", (rows,), stats_dtype, dtype, stats=True),
        "rstd": lambda: _array_changes(draw, "rstd", (rows,), stats_dtype, dtype, stats=True),
        "output_mask": lambda: _mask_changes(draw),
    })
    if stats_dtype != dtype:  # then float32: rstd in x's dtype differs from mean's.
      changes["rstd"] = lambda: draw(st.sampled_from([
          _array_changes(draw, "rstd", (rows,), stats_dtype, dtype, stats=True),
          (_array((rows,), dtype), TypeError, ("rstd",))]))
  else:
    args["eps"] = 1e-5
    changes["eps"] = lambda: _eps_changes(draw)
  names = draw(st.lists(st.sampled_from(sorted(changes)), min_size=1, max_size=3, unique=True))
  return fn, args, {name: changes[name]() for name in names}


@st.composite
def group_norm_invalid_calls(draw, fn):
  dtype = jnp.dtype(draw(st.sampled_from(DTYPES)))
  group = draw(st.integers(1, 4))
  c = group * draw(st.integers(1, 3))
  hw = draw(st.integers(0 if fn is jn.group_norm_backward else 1, 6))
  n = draw(st.integers(0 if fn is not jn.group_norm else 1, 3))
  channels_last = draw(st.booleans())
  shape = (n, hw, c) if channels_last else (n, c, hw)
  x = _array(shape, dtype)
  pdtype = draw(st.sampled_from([dtype, F32]))
  weight = _array((c,), pdtype) if draw(st.booleans()) else None
  bias = _array((c,), pdtype) if draw(st.booleans()) else None
  changes = {
      "x": lambda: _x_changes(draw, x.shape),
      "implementation": lambda: _implementation_changes(draw),
  }

  def size_change(name, value):
    # Invalid on its own (type, range), or against x's size when x is not empty.
    options = [(-1, ValueError), (float(value), TypeError), (str(value), TypeError),
               (None, TypeError)]
    if x.size:
      options.append((value + 1, ValueError))
    return draw(st.sampled_from(options)) + ((name, "x"),)

  if fn is jn.group_norm:
    args = dict(x=x, num_groups=group, weight=weight, bias=bias, eps=1e-5,
                channel_axis=-1 if channels_last else 1)
    changes.update({
        "num_groups": lambda: draw(st.sampled_from([(0, ValueError), (-group, ValueError),
                                                     (c + 1, ValueError), (float(group), TypeError)]))
        + (("group", "num_groups"),),
        "channel_axis": lambda: draw(st.sampled_from([(0, ValueError), (3, ValueError),
                                                       (-4, ValueError), (1.0, TypeError)]))
        + (("channel_axis",),),
        "weight": lambda: _array_changes(draw, "weight", (c,), pdtype, dtype),
        "bias": lambda: _array_changes(draw, "bias", (c,), pdtype, dtype),
        "eps": lambda: _eps_changes(draw),
    })
  else:
    args = dict(x=x, N=n, C=c, HxW=hw, group=group, channels_last=channels_last)
    sizes = {
        "N": lambda: size_change("N", n),
        "C": lambda: draw(st.sampled_from([(0, ValueError), (float(c), TypeError)] + (
            [(c + 1, ValueError)] if group > 1 else []))) + (("C", "group", "x"),),
        "HxW": lambda: size_change("HxW", hw),
        "group": lambda: draw(st.sampled_from([(0, ValueError), (-1, ValueError),
                                                (c + 1, ValueError), (float(group), TypeError)]))
        + (("group",),),
    }
    size = draw(st.sampled_from(sorted(sizes)))
    changes[size] = sizes[size]
    if fn is jn.group_norm_fwd:
      args.update(weight=weight, bias=bias, eps=1e-5)
      changes.update({
          "weight": lambda: _array_changes(draw, "weight", (c,), pdtype, dtype),
          "bias": lambda: _array_changes(draw, "bias", (c,), pdtype, dtype),
          "eps": lambda: _eps_changes(draw),
      })
    else:
      stats_dtype = draw(st.sampled_from([F32, dtype]))
      args.update(grad_out=_array(shape, dtype), mean=_array((n, group), stats_dtype),
                  rstd=_array((n, group), stats_dtype), gamma=weight,
                  output_mask=(True, True, True))
      changes.update({
          "grad_out": lambda: _array_changes(draw, "grad_out", shape, dtype, dtype) + (),
          "mean": lambda: _array_changes(draw, "mean", (n, group), stats_dtype, dtype, stats=True),
          "rstd": lambda: _array_changes(draw, "rstd", (n, group), stats_dtype, dtype, stats=True),
          "gamma": lambda: _array_changes(draw, "gamma", (c,), pdtype, dtype),
          "output_mask": lambda: _mask_changes(draw),
      })
  names = draw(st.lists(st.sampled_from(sorted(changes)), min_size=1, max_size=3, unique=True))
  return fn, args, {name: changes[name]() for name in names}


# Invalid calls compile nothing (the checks run before any kernel), so they
# get twice the budget.
@pytest.mark.parametrize("fn", [jn.layer_norm_backward, jn.layer_norm_fwd, jn.layer_norm],
                         ids=lambda fn: fn.__name__)
@hypothesis.settings(max_examples=2 * _BUDGET)
@hypothesis.given(data=st.data())
def test_layer_norm_invalid_arguments_raise(fn, data):
  _check_invalid_call(*data.draw(layer_norm_invalid_calls(fn), label="call"))


@pytest.mark.parametrize("fn", [jn.group_norm_backward, jn.group_norm_fwd, jn.group_norm],
                         ids=lambda fn: fn.__name__)
@hypothesis.settings(max_examples=2 * _BUDGET)
@hypothesis.given(data=st.data())
def test_group_norm_invalid_arguments_raise(fn, data):
  _check_invalid_call(*data.draw(group_norm_invalid_calls(fn), label="call"))
