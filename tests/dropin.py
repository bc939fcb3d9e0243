"""Helpers of the drop-in layer tests: tolerances, tree comparison, kernel use, fallback warnings."""

from __future__ import annotations

import contextlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np

import jax_normgrad as jn
from jax_normgrad import _fallback
from cases import kernel_launches

#: Relative tolerance (to the array's max |value|) of one result: a few roundings of its dtype
#: (the kernels and the original round the same float32 value, in another order of operations).
TOL = {jnp.dtype(jnp.float32): 3e-5, jnp.dtype(jnp.float16): 4e-3,
       jnp.dtype(jnp.bfloat16): 3e-2, jnp.dtype(jnp.float64): 1e-12}


def tol_dtype(*dtypes):
  """The least precise of ``dtypes`` (None ignored): a float32 result computed in it carries its error."""
  return max((jnp.dtype(d) for d in dtypes if d is not None), key=lambda d: TOL[d])


def assert_trees_close(ours, theirs, what="", dtype=None):
  """Same structure of leaves (paths, shapes, dtypes), values within the tolerance of the leaf's dtype
  or of ``dtype`` if that is less precise."""
  a, b = (jax.tree_util.tree_flatten_with_path(t)[0] for t in (ours, theirs))
  assert [p for p, _ in a] == [p for p, _ in b], (what, [p for p, _ in a], [p for p, _ in b])
  for (path, u), (_, v) in zip(a, b):
    u, v = jnp.asarray(u), jnp.asarray(v)
    assert (u.shape, u.dtype) == (v.shape, v.dtype), (what, path, u.shape, u.dtype, v.shape, v.dtype)
    u64, v64 = np.asarray(u.astype(jnp.float32), np.float64), np.asarray(v.astype(jnp.float32), np.float64)
    scale = max(float(np.max(np.abs(v64))) if v64.size else 0.0, 1e-30)
    np.testing.assert_allclose(u64, v64, rtol=0, atol=TOL[tol_dtype(u.dtype, dtype)] * scale,
                               err_msg=f"{what} {jax.tree_util.keystr(path)}")


def assert_same_structure(ours, theirs, what=""):
  """Same leaf paths, shapes and dtypes (a parameter tree: names and layout)."""
  spec = lambda t: [(jax.tree_util.keystr(p), tuple(v.shape), jnp.dtype(v.dtype))
                    for p, v in jax.tree_util.tree_flatten_with_path(t)[0]]
  assert spec(ours) == spec(theirs), what


def kernel_calls(fn, *args) -> int:
  """How many jax_normgrad kernel launches the jitted ``fn`` lowers to (``cases.kernel_launches``)."""
  return kernel_launches(jax.jit(fn).lower(*args).as_text())


def run_jitted(fn, *args):
  """``(jit(fn)(*args), number of jax_normgrad kernel launches in it)``, traced and compiled once."""
  lowered = jax.jit(fn).lower(*args)
  return lowered.compile()(*args), kernel_launches(lowered.as_text())


def normal(shape, dtype=jnp.float32, seed=0, offset=0.0, scale=1.0):
  """Random normal array (NumPy's generator: jax.random compiles once per shape, slowly)."""
  a = np.random.default_rng(seed).normal(offset, scale, size=shape).astype(np.float32)
  return jnp.asarray(a).astype(dtype)


def random_like(tree, seed=3):
  """Non-trivial values (around 1, not init's ones/zeros) for a tree of arrays or shape structs."""
  leaves, treedef = jax.tree.flatten(tree)
  return jax.tree.unflatten(treedef, [normal(l.shape, l.dtype, seed + i, 1.0, 0.3)
                                      for i, l in enumerate(leaves)])


@contextlib.contextmanager
def expect_fallback(expected: bool):
  """Asserts a FallbackWarning is (or is not) emitted in the block; resets the one-time memo."""
  _fallback.warn_once.cache_clear()
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    yield
  got = [c for c in caught if issubclass(c.category, jn.FallbackWarning)]
  assert bool(got) == expected, [str(c.message) for c in got]


def assert_matches_original(run, ours, theirs, dtype, kernel: bool):
  """``run(layer) -> (outputs, kernel calls)`` of the drop-in and the original agree.

  The drop-in's run warns of a fallback exactly when ``kernel`` is False, and
  calls the kernels exactly when it is True.
  """
  with expect_fallback(not kernel):
    ours_out, calls = run(ours)
  theirs_out, _ = run(theirs)
  assert_trees_close(ours_out, theirs_out, "y, loss, grads", dtype)
  assert (calls > 0) == kernel


def cotangent(shape, dtype=jnp.float32, seed=7):
  return normal(shape, dtype, seed)


def linear_loss(y, ct):
  """<y, ct> in float32: its gradient is the VJP of the layer with cotangent ct."""
  return jnp.vdot(y.astype(jnp.float32).ravel(), ct.astype(jnp.float32).ravel())
