"""Concurrency: kernels run from many threads at once, or side by side in one program, give bitwise
the results of one call at a time (the kernels keep no shared mutable state)."""

from __future__ import annotations

import concurrent.futures
import functools

import jax
import jax.numpy as jnp
import numpy as np

import jax_normgrad as jn
from cases import kernel_launches, random


def _bits(outs):
  """Outputs as raw-bit NumPy arrays (exact comparison, NaN-safe)."""
  arrays = [np.asarray(o) for o in jax.tree.leaves(outs)]
  return [a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize]) for a in arrays]


def _assert_same(got, expected, name):
  assert len(got) == len(expected), name
  for g, e in zip(got, expected):
    np.testing.assert_array_equal(g, e, err_msg=name)


def _ln_fwd(x, w, b):
  return jn.layer_norm_fwd(x, x.shape[-1], w, b)


def _ln_bwd(dy, x, w, b):
  _, mean, rstd = jn.layer_norm_fwd(x, x.shape[-1], w, b)
  return jn.layer_norm_backward(dy, x, x.shape[-1], mean, rstd, w, b)


def _gn_bwd(dy, x, w, b, channels_last):
  n, c = x.shape[0], x.shape[-1 if channels_last else 1]
  hw = x.size // (n * c)
  _, mean, rstd = jn.group_norm_fwd(x, w, b, n, c, hw, 4, channels_last=channels_last)
  return jn.group_norm_backward(dy, x, mean, rstd, w, n, c, hw, 4, channels_last=channels_last)


def _layer_grad(x, w, b):
  return jax.grad(lambda x, w, b: jnp.sum(jn.layer_norm(x, w, b) ** 2), argnums=(0, 1, 2))(x, w, b)


def _workloads():
  """name -> (function, args): each big enough for many tasks and per-task partial sums."""
  rng = np.random.default_rng(0)
  loads = {}
  for dtype in (jnp.float32, jnp.bfloat16):
    tag = jnp.dtype(dtype).name
    x, dy = random(rng, (1031, 257), dtype, 2.0, 0.5), random(rng, (1031, 257), dtype)
    w, b = random(rng, (257,), dtype, offset=1.0), random(rng, (257,), dtype)
    loads[f"ln_fwd_{tag}"] = (_ln_fwd, (x, w, b))
    loads[f"ln_bwd_{tag}"] = (_ln_bwd, (dy, x, w, b))
    loads[f"ln_layer_grad_{tag}"] = (_layer_grad, (x, w, b))
    for channels_last in (False, True):
      shape = (6, 333, 32) if channels_last else (6, 32, 333)
      gx, gdy = random(rng, shape, dtype, 2.0, -0.3), random(rng, shape, dtype)
      gw, gb = random(rng, (32,), dtype, offset=1.0), random(rng, (32,), dtype)
      loads[f"gn_bwd_{tag}_{'nhwc' if channels_last else 'nchw'}"] = (
          functools.partial(_gn_bwd, channels_last=channels_last), (gdy, gx, gw, gb))
  return loads


def test_threads_calling_jitted_functions_at_once():
  loads = _workloads()
  jitted = {name: jax.jit(fn) for name, (fn, _) in loads.items()}
  expected = {name: _bits(jitted[name](*args)) for name, (_, args) in loads.items()}
  # Every function several times, interleaved, from more threads than cores:
  # the same function runs in several threads at once, and different ones too.
  jobs = [name for _ in range(6) for name in loads]
  np.random.default_rng(1).shuffle(jobs)

  def run(name):
    return name, _bits(jitted[name](*loads[name][1]))

  with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
    results = list(pool.map(run, jobs))
  assert len(results) == len(jobs)
  for name, got in results:
    _assert_same(got, expected[name], name)


def test_threads_calling_eager_ops_at_once():
  # The eager path: each op call goes through the package's cached jit.
  loads = _workloads()
  expected = {name: _bits(fn(*args)) for name, (fn, args) in loads.items()}
  jobs = [name for _ in range(3) for name in loads]

  def run(name):
    fn, args = loads[name]
    return name, _bits(fn(*args))

  with concurrent.futures.ThreadPoolExecutor(max_workers=6) as pool:
    for name, got in pool.map(run, jobs):
      _assert_same(got, expected[name], name)


def test_independent_custom_calls_in_one_program():
  # One program of independent custom calls, which XLA's CPU runtime may run
  # concurrently on its thread pool, against each alone.
  loads = _workloads()
  names = sorted(loads)

  def together(all_args):
    return [loads[name][0](*args) for name, args in zip(names, all_args)]

  all_args = [loads[name][1] for name in names]
  text = jax.jit(together).lower(all_args).as_text()
  assert kernel_launches(text) >= len(names)  # each workload is the platform's kernels
  outs = jax.jit(together)(all_args)
  for name, got in zip(names, outs):
    fn, args = loads[name]
    _assert_same(_bits(got), _bits(jax.jit(fn)(*args)), name)
