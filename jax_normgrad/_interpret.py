"""The Mosaic GPU kernels in Pallas' GPU interpret mode (CPU): one kernel at a time.

The interpreter simulates a kernel with ordered callbacks around one
process-wide simulated GPU, set up and torn down per kernel: two kernels
must not overlap, which JAX ensures through the ordered effect those
callbacks carry. A primitive declares no effects (its abstract evaluation
knows no platform), so inside the primitive's lowering nothing would order
two kernels of one program; :func:`in_own_computation` runs the kernel as a
computation of its own, by a host callback, which declares the effect, and
a lock keeps kernels of concurrent computations apart.
"""

from __future__ import annotations

import threading

import jax
import numpy as np

from jax_normgrad.pallas import config

_LOCK = threading.Lock()


def in_own_computation(fn, tuning):
  """``fn`` run by a host callback as a jitted computation of its own, one at a time.

  The kernel is traced when the callback first runs, so the primitive's
  ``tuning`` is applied there.
  """
  jitted = jax.jit(fn)

  def host(*arrays):
    with _LOCK, config.lowering(tuning, "cpu"):
      return jax.tree.map(np.asarray, jitted(*arrays))

  def run(*args):
    shapes = jax.eval_shape(fn, *args)
    return jax.pure_callback(host, shapes, *args)

  return run
