"""Training loops under jax_normgrad.rewrite, one line added to each: the same run as the plain loop.

The loops are ``benchmarks/rewrite_loops.py``'s: flax linen (``TrainState`` with
``apply_fn=jn.rewrite(model.apply)``), keras 3's ``model.fit``, dm-haiku
(``hk.transform_with_state``), equinox (an ``eqx.filter_jit`` step) and
transformers' Flax GPT-2 of a tiny random config, each a small model with
norms and Dropout (and BatchNorm's running statistics where the framework has
one). Each runs three steps plainly and with its one line of docs/rewrite.md;
the losses, the parameters and the state (batch statistics, RNG counts, the
optimizer's) must be equal after every step, and the rewritten step's lowered
text must run every norm's forward and backward kernel. Each skips where its
framework is missing. flax NNX's loop is ``test_rewrite_semantics.py``'s.
"""

from __future__ import annotations

import pathlib
import sys

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import rewrite_loops as rl  # noqa: E402  (the loops, shared with bench_rewrite.py --frameworks)
from test_rewrite import kernels_in  # noqa: E402
from tolerances import ATOL32  # noqa: E402

STEPS = 3
#: Each state leaf after each step within TOL of the largest value of that step's state, each
#: loss within TOL of the loss (rewrite_loops.max_difference). The kernels compute each norm
#: as XLA's code does up to the order of its float32 sums: ATOL32 sqrt(n) relative, 1.1e-5 for
#: these rows of n <= 32; TOL is twice that. The runs differ by at most 6e-7 (ten steps,
#: bench_rewrite.py --frameworks), while a lost update, a stale batch statistic or another
#: dropout mask is an error of the size of the values.
TOL = 10 * ATOL32


#: NNX's loop is test_rewrite_semantics.py's (the rewrite around the loss and around the step).
FRAMEWORKS = [name for name in rl.LOOPS if name != "flax NNX"]


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_loop_trains_as_the_plain_one(framework):
  module, _, norms = rl.LOOPS[framework]
  pytest.importorskip(module)
  pytest.importorskip("optax")
  if framework == "keras":
    import keras
    if keras.backend.backend() != "jax":
      pytest.skip("keras runs another backend")
  if framework.startswith("transformers"):
    import transformers
    if not hasattr(transformers, "FlaxGPT2LMHeadModel"):
      pytest.skip("transformers without its Flax models")
  want = rl.train(framework, False, STEPS)
  got = rl.train(framework, True, STEPS)
  assert len(got.history) == len(want.history) == STEPS
  # The state does change from step to step (the comparison below means something).
  first, last = rl.leaves(want.history[0][1]), rl.leaves(want.history[-1][1])
  assert any(not np.array_equal(a, b) for a, b in zip(first, last))
  difference = rl.max_difference(got, want)
  assert difference <= TOL, difference
  assert got.norms == norms and want.norms == 0
  assert kernels_in(got.text, "fwd") == norms and kernels_in(got.text, "bwd") == norms, got.norms
  assert kernels_in(want.text, "fwd") == 0
