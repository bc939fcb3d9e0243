"""jax_normgrad.rewrite never changes what a function computes: values, derivatives and effects.

Custom derivative rules stay the user's, a fused activation keeps the code's
derivative (ties included), NNX state and effects change as in the plain code,
and the failures a user cannot act on are clear errors naming the function.
Each check compares the rewritten function with the plain one: values and
gradients under a random cotangent, state step by step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_normgrad as jn
import rewrite_corpus as rc
from test_rewrite import kernel_calls

F32 = jnp.float32


def _close(got, want, rtol=1e-4):
  """Each pair of leaves within ``rtol`` of the largest value of the expected tree."""
  scale = max([1.0] + [float(np.abs(np.asarray(a, np.float32)).max()) for a in jax.tree.leaves(want)])
  for a, e in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(e, np.float32), rtol=0,
                               atol=rtol * scale)


def _value_and_grads(f, args, ct):
  """``f(*args)`` and the gradient of ``sum(f(*args) * ct)`` with respect to every argument."""
  loss = lambda *a: jnp.sum(f(*a).astype(F32) * ct)
  return jax.jit(lambda *a: (f(*a), jax.grad(loss, tuple(range(len(a))))(*a)))(*args)


def _same_as_plain(f, args, ct):
  _close(_value_and_grads(jn.rewrite(f), args, ct), _value_and_grads(f, args, ct))


# ----------------------------------------------------------------------------
# Custom derivative rules.


def _ln(x):
  m = x.mean(-1, keepdims=True)
  return (x - m) * jax.lax.rsqrt(((x - m) ** 2).mean(-1, keepdims=True) + rc.EPS)


@jax.custom_jvp
def straight_through_ln(x):
  """A LayerNorm whose derivative is the identity."""
  return _ln(x)


@straight_through_ln.defjvp
def _straight_through_jvp(primals, tangents):
  return straight_through_ln(*primals), tangents[0]


@jax.custom_vjp
def doubled_grad_ln(x):
  """A LayerNorm whose backward is twice the cotangent."""
  return _ln(x)


doubled_grad_ln.defvjp(lambda x: (doubled_grad_ln(x), None), lambda _, g: (2.0 * g,))


@pytest.mark.parametrize("norm", [straight_through_ln, doubled_grad_ln])
def test_custom_rules_are_kept(norm):
  """The norm inside is rewritten in the primal only; the user's rule still differentiates it."""
  x, w, b, ct = rc.inputs(False, F32)
  f = lambda x, w, b: jnp.tanh(norm(x) * w + b)
  _same_as_plain(f, (x, w, b), ct)
  (m,) = jn.explain_rewrite(f, x, w, b).matches
  assert m.op == "layer_norm" and "custom_" in m.where, m
  assert kernel_calls(jn.rewrite(f), x, w, b) == 1  # the primal on the kernel


def test_statistics_through_a_custom_rule_are_left_alone():
  """A norm whose rsqrt is a custom_jvp function: the op would replace its rule, so it runs as written."""
  x, w, b, ct = rc.inputs(False, F32)

  def f(x, w, b):
    m = x.mean(-1, keepdims=True)
    return (x - m) * rc.damped_rsqrt(((x - m) ** 2).mean(-1, keepdims=True) + rc.EPS) * w + b

  _same_as_plain(f, (x, w, b), ct)
  report = jn.explain_rewrite(f, x, w, b)
  assert not report.matches
  (miss,) = report.near_misses
  assert miss.reason.startswith("the statistics pass through a function with a custom derivative")


# ----------------------------------------------------------------------------
# Fused activations: the code's derivative, ties included.


def _gn(x, w, b):
  n, h, wd, c = x.shape
  xg = x.reshape(n, h, wd, 8, c // 8)
  m = xg.mean((1, 2, 4), keepdims=True)
  v = xg.var((1, 2, 4), keepdims=True)
  return ((xg - m) * jax.lax.rsqrt(v + rc.EPS)).reshape(x.shape) * w + b


_OLD_JAX = tuple(int(v) for v in jax.__version__.split(".")[:2]) < (0, 10)


@pytest.mark.parametrize("name", sorted(rc.ACTIVATION_FORMS))
def test_fused_activation_keeps_the_codes_derivative(name):
  """A GroupNorm's activation at a constant sample (its y exactly 0, a tie of max and where)."""
  act, fused = rc.ACTIVATION_FORMS[name]
  x, w, b, ct = rc.inputs(True, F32)
  x, b = x.at[0].set(0.0), jnp.zeros_like(b)
  f = lambda x, w, b: act(_gn(x, w, b))
  _same_as_plain(f, (x, w, b), ct)
  (m,) = jn.explain_rewrite(f, x, w, b).matches
  if name == "nn_relu" and _OLD_JAX:
    # jax 0.8 does not evaluate the custom_jvp activation's rule at trace time where the
    # rewrite checks it: not fused, left as written (the safe way; values and gradient above).
    fused = None
  assert (m.op, m.activation) == ("group_norm", fused), m
  if name.startswith("maximum"):
    assert "derivative at 0 is 0.5, the op's 0" in m.note and m.note in m.line()


# ----------------------------------------------------------------------------
# Errors and outputs.


def test_jitted_helper_returning_a_python_constant():
  x, w, b, ct = rc.inputs(False, F32)
  f = lambda x, w, b: jax.jit(lambda x: (rc.ln_two_pass(x, w, b), 1.0))(x)
  y, c = jn.rewrite(f)(x, w, b)
  _close(y, rc.ln_two_pass(x, w, b))
  assert float(c) == 1.0


def test_non_array_outputs_pass_through_and_jitted_functions_are_refused():
  x, w, b, ct = rc.inputs(False, F32)

  def f(x, w, b):
    return {"y": rc.ln_two_pass(x, w, b), "name": "ln", "act": jax.nn.relu, "n": 3}

  got = jn.rewrite(f)(x, w, b)
  assert (got["name"], got["act"], got["n"]) == ("ln", jax.nn.relu, 3)
  _close(got["y"], f(x, w, b)["y"])
  assert jax.jit(jn.rewrite(lambda *a: f(*a)["y"])).lower(x, w, b) is not None

  def loss(x):
    return jnp.sum(rc.ln_two_pass(x, w, b) * ct)

  with pytest.raises(TypeError, match=r"loss .*test_rewrite_semantics.py.* is already jitted"):
    jn.rewrite(jax.jit(loss))
  # jax's errors name the user's function and its arguments, not the rewrite's internals.

  def branchy(x):
    return x * 2 if jnp.sum(x) > 0 else x

  with pytest.raises(jax.errors.ConcretizationTypeError, match="function branchy at .*argument x"):
    jn.rewrite(branchy)(x)


def test_traced_eps_is_named_in_the_report():
  x, w, b, _ = rc.inputs(False, F32)

  def f(x, w, eps):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * w

  report = jn.explain_rewrite(f, x, w, jnp.float32(1e-5))
  assert not report.matches
  (miss,) = report.near_misses
  assert miss.reason.startswith("eps is a traced value") and "static" in miss.reason, miss
  assert jn.explain_rewrite(f, x, w, 1e-5).counts() == {"rms_norm": 1}
  # As a user meets it: a Python float eps that the enclosing jit traces.
  reports = []
  y = jax.jit(jn.rewrite(f, report=reports.append))(x, w, 1e-5)
  assert reports[-1].near_misses[0].reason.startswith("eps is a traced value")
  _close(y, f(x, w, 1e-5))


# ----------------------------------------------------------------------------
# flax NNX: state and effects change exactly as in the plain code.


def _nnx_training(wrap_loss, wrap_step, jit, steps=3):
  """Losses and the model's and optimizer's state after each step of a Dropout + BatchNorm model."""
  nnx = pytest.importorskip("flax.nnx")
  optax = pytest.importorskip("optax")

  class Model(nnx.Module):
    def __init__(self, rngs):
      self.lin = nnx.Linear(8, 16, rngs=rngs)
      self.bn = nnx.BatchNorm(16, rngs=rngs)
      self.ln = nnx.LayerNorm(16, rngs=rngs)
      self.drop = nnx.Dropout(0.3, rngs=rngs)
      self.out = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
      return self.out(self.drop(self.ln(self.bn(self.lin(x)))))

  def loss_fn(model, x, t):
    return jnp.mean((model(x) - t) ** 2)

  def train_step(model, opt, x, t):
    loss, grads = nnx.value_and_grad(wrap_loss(loss_fn))(model, x, t)
    opt.update(model, grads)
    return loss

  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((6, 8)), F32)
  t = jnp.asarray(rng.standard_normal((6, 4)), F32)
  model = Model(nnx.Rngs(0))
  opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
  step = wrap_step(train_step)
  step = nnx.jit(step) if jit else step
  history = []
  for _ in range(steps):
    loss = step(model, opt, x, t)
    history.append((loss, [np.asarray(a) if not jnp.issubdtype(a.dtype, jax.dtypes.prng_key)
                           else np.asarray(jax.random.key_data(a))
                           for a in jax.tree.leaves(nnx.state((model, opt)))]))
  return history


@functools.lru_cache(maxsize=None)
def _plain_nnx_training(steps):
  """The plain loop under nnx.jit: the reference of every variant (eager, it runs op by op: seconds)."""
  return _nnx_training(lambda f: f, lambda f: f, True, steps)


@pytest.mark.parametrize("where", ["loss_in_jit", "step_in_jit", "step_eager"])
def test_nnx_state_changes_as_in_plain_code(where):
  """Dropout's RNG count, BatchNorm's running statistics, the parameters and optimizer state.

  ``nnx.value_and_grad(jn.rewrite(loss))`` inside ``nnx.jit`` lost the first two;
  ``nnx.jit(jn.rewrite(train_step))`` lost them all (the model never trained).
  """
  ident = lambda f: f
  reports = []
  rewrite = lambda f: jn.rewrite(f, report=reports.append)
  wrap_loss, wrap_step = (rewrite, ident) if where == "loss_in_jit" else (ident, rewrite)
  jit = where != "step_eager"
  steps = 3 if jit else 2
  want = _plain_nnx_training(steps)
  got = _nnx_training(wrap_loss, wrap_step, jit, steps)
  assert reports[-1].counts() == {"layer_norm": 1}, str(reports[-1])
  assert not np.array_equal(want[0][1][0], want[-1][1][0])  # the state does change
  for (loss, state), (loss_want, state_want) in zip(got, want):
    _close(loss, loss_want)
    _close(state, state_want)


def test_nnx_module_closed_over_and_changed_is_an_error():
  nnx = pytest.importorskip("flax.nnx")
  bn = nnx.BatchNorm(4, rngs=nnx.Rngs(0))
  x = jnp.asarray(np.random.default_rng(0).standard_normal((6, 4)), F32)

  def normalize(x):
    return bn(x)

  with pytest.raises(TypeError, match="normalize .* changes a flax.nnx object .* pass the Module"):
    jn.rewrite(normalize)(x)
  y = jn.rewrite(lambda bn, x: bn(x))(bn, x)  # as an argument: threaded through
  _close(y, nnx.BatchNorm(4, rngs=nnx.Rngs(0))(x))
  assert float(jnp.abs(bn.mean[...]).max()) > 0


def test_equinox_step_returning_its_model():
  """``eqx.filter_jit(jn.rewrite(make_step))``: the step returns the model, whose activation
  (``jax.nn.relu``, a custom_jvp function) is a leaf that is not an array."""
  eqx = pytest.importorskip("equinox")
  optax = pytest.importorskip("optax")

  class Model(eqx.Module):
    lin: eqx.nn.Linear
    ln: eqx.nn.LayerNorm
    act: object

    def __call__(self, x):
      return self.act(self.ln(self.lin(x)))

  opt = optax.sgd(0.1)
  x = jnp.asarray(np.random.default_rng(0).standard_normal((6, 8)), F32)

  def make_step(model, state, x):
    loss, g = eqx.filter_value_and_grad(lambda m: jnp.mean(jax.vmap(m)(x) ** 2))(model)
    updates, state = opt.update(g, state, model)
    return loss, eqx.apply_updates(model, updates), state

  def train(step):
    model = Model(eqx.nn.Linear(8, 16, key=jax.random.key(0)), eqx.nn.LayerNorm(16), jax.nn.relu)
    state = opt.init(eqx.filter(model, eqx.is_array))
    history = []
    for _ in range(3):
      loss, model, state = step(model, state, x)
      history.append((loss, eqx.filter(model, eqx.is_array)))
    assert model.act is jax.nn.relu
    return history

  _close(train(eqx.filter_jit(jn.rewrite(make_step))), train(eqx.filter_jit(make_step)))
  with pytest.raises(TypeError, match="make_step .* is already jitted .* eqx.filter_jit"):
    jn.rewrite(eqx.filter_jit(make_step))


def test_effects_are_kept():
  """Ordered callbacks, one on a norm's mean and one nothing reads, run as in the plain code."""
  x, w, b, _ = rc.inputs(False, F32)
  seen = []

  def f(x):
    m = x.mean(-1, keepdims=True)
    jax.debug.callback(lambda v: seen.append(("mean", v.shape)), m, ordered=True)
    jax.debug.callback(lambda: seen.append(("unread",)), ordered=True)
    v = ((x - m) ** 2).mean(-1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(v + rc.EPS) * w

  want = jax.jit(f)(x)
  plain, seen[:] = list(seen), []
  got = jax.jit(jn.rewrite(f))(x)
  assert seen == plain == [("mean", (6, 1)), ("unread",)]
  _close(got, want)
  assert jn.explain_rewrite(f, x).counts() == {"layer_norm": 1}
