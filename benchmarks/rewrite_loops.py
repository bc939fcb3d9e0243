"""Small training loops of six frameworks, each runnable plainly or with its one line of jax_normgrad.rewrite.

flax NNX, flax linen (``TrainState``), keras 3 (``model.fit``), dm-haiku,
equinox (``eqx.filter_jit``) and transformers' Flax GPT-2 (a tiny random
config): a small model with norms, Dropout and, where the framework has one,
BatchNorm, trained with SGD with momentum. :func:`train` runs one for a few
steps and returns what each step left (the loss, the parameters, the state)
with the lowered step's text, the number of norms rewritten and the times.
``tests/test_rewrite_training.py`` checks that both ways train alike;
``bench_rewrite.py --frameworks`` prints the table. The one lines are
docs/rewrite.md's ("In a training loop").
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Callable

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jax_normgrad as jn  # noqa: E402

#: SGD with momentum (its trace is optimizer state). Adam's first step, about g / |g|, would
#: turn the rounding of a gradient that is zero in exact arithmetic into a step of the
#: learning rate's size, and the two runs could not be compared.
LR, MOMENTUM = 0.1, 0.9

_rng = np.random.default_rng(0)
X = _rng.standard_normal((8, 16)).astype(np.float32) * 1.5 + 0.3
T = _rng.standard_normal((8, 4)).astype(np.float32)
IDS = _rng.integers(0, 64, (4, 12)).astype(np.int32)


@dataclasses.dataclass
class Run:
  """One loop's run: per step ``(loss, state)``; the lowered step; norms; seconds."""
  history: list
  text: str  # the step's lowered text
  norms: int  # the norms the rewrite's last trace replaced (0: plain)
  compile_s: float  # the first step's trace, lowering and compile (less a step's run)
  step_s: list  # the wall time of each step after the first


class _Reports:
  """``rewrite(f)`` when on, recording its reports; ``f`` itself when off."""

  def __init__(self, on: bool):
    self.on, self.reports = on, []

  def __call__(self, f):
    return jn.rewrite(f, report=self.reports.append) if self.on else f

  @property
  def norms(self) -> int:
    return sum(self.reports[-1].counts().values()) if self.reports else 0


def _timed_loop(step, args: tuple, advance: Callable, steps: int, rw: _Reports) -> Run:
  """Lowers and compiles the jitted ``step`` on ``args``, then runs it ``steps`` times.

  ``advance(args, outputs) -> (args, record)``: the next step's arguments and what to record.
  """
  t0 = time.perf_counter()
  lowered = step.lower(*args)
  compiled = lowered.compile()
  compile_s = time.perf_counter() - t0
  history, times = [], []
  for _ in range(steps):
    t0 = time.perf_counter()
    outs = jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - t0)
    args, record = advance(args, outs)
    history.append(record)
  return Run(history, lowered.as_text(), rw.norms, compile_s, times[1:] or times)


def _split_key(key):
  key, sub = jax.random.split(key)
  return key, sub


# ----------------------------------------------------------------------------


def nnx_loop(rewrite: bool, steps: int) -> Run:
  from flax import nnx
  import optax
  rw = _Reports(rewrite)

  class Model(nnx.Module):
    def __init__(self, rngs):
      self.lin = nnx.Linear(16, 32, use_bias=False, rngs=rngs)
      self.bn = nnx.BatchNorm(32, rngs=rngs)
      self.ln = nnx.LayerNorm(32, rngs=rngs)
      self.drop = nnx.Dropout(0.2, rngs=rngs)
      self.rms = nnx.RMSNorm(32, rngs=rngs)
      self.out = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x):
      return self.out(self.rms(self.drop(nnx.gelu(self.ln(self.bn(self.lin(x)))))))

  def loss_fn(model, x, t):
    return jnp.mean((model(x) - t) ** 2)

  @nnx.jit
  def train_step(model, opt, x, t):
    loss, grads = nnx.value_and_grad(rw(loss_fn))(model, x, t)
    opt.update(model, grads)
    return loss

  model = Model(nnx.Rngs(0))
  opt = nnx.Optimizer(model, optax.sgd(LR, MOMENTUM), wrt=nnx.Param)

  def state():
    return [np.asarray(jax.random.key_data(a)) if jnp.issubdtype(a.dtype, jax.dtypes.prng_key)
            else np.asarray(a) for a in jax.tree.leaves(nnx.state((model, opt)))]

  history, times = [], []
  for _ in range(steps):
    t0 = time.perf_counter()
    loss = jax.block_until_ready(train_step(model, opt, X, T))
    times.append(time.perf_counter() - t0)
    history.append((loss, state()))
  return _first_step_run(history, train_step.lower(model, opt, X, T).as_text(), rw, times)


def _first_step_run(history, text, rw, times) -> Run:
  """A Run of a loop that calls its jitted step directly: its first step less a later one's."""
  later = times[1:] or times
  return Run(history, text, rw.norms, times[0] - float(np.median(later)), later)


def linen_loop(rewrite: bool, steps: int) -> Run:
  import flax.linen as nn
  import optax
  from flax.training import train_state
  rw = _Reports(rewrite)

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x, train):
      h = nn.Dense(32, use_bias=False)(x)
      h = nn.BatchNorm(use_running_average=not train)(h)
      h = nn.gelu(nn.LayerNorm()(h))
      h = nn.Dropout(0.2, deterministic=not train)(h)
      return nn.Dense(4)(nn.RMSNorm()(h))

  class State(train_state.TrainState):
    batch_stats: dict

  model = Model()
  variables = jax.jit(lambda k: model.init(k, X, False))(jax.random.key(0))
  state = State.create(apply_fn=rw(model.apply), params=variables["params"],
                       tx=optax.sgd(LR, MOMENTUM), batch_stats=variables["batch_stats"])

  @jax.jit
  def step(state, x, t, key):
    def loss_fn(params):
      y, updates = state.apply_fn({"params": params, "batch_stats": state.batch_stats}, x, True,
                                  mutable=["batch_stats"], rngs={"dropout": key})
      return jnp.mean((y - t) ** 2), updates

    (loss, updates), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    return loss, state.apply_gradients(grads=grads, batch_stats=updates["batch_stats"])

  def advance(args, outs):
    _, x, t, key = args
    loss, state = outs
    return (state, x, t, jax.random.fold_in(key, 1)), (
        loss, (state.params, state.batch_stats, state.opt_state))

  return _timed_loop(step, (state, X, T, jax.random.key(1)), advance, steps, rw)


def keras_loop(rewrite: bool, steps: int) -> Run:
  import keras
  if keras.backend.backend() != "jax":
    raise RuntimeError("keras runs another backend than jax (KERAS_BACKEND)")
  rw = _Reports(rewrite)
  layers = keras.layers
  keras.utils.set_random_seed(0)
  model = keras.Sequential([
      keras.Input((16,)), layers.Dense(32, use_bias=False), layers.BatchNormalization(),
      layers.LayerNormalization(), layers.Activation("gelu"), layers.Dropout(0.2, seed=3),
      layers.RMSNormalization(), layers.Dense(4)])
  model.compile(optimizer=keras.optimizers.SGD(LR, momentum=MOMENTUM), loss="mse")
  if rewrite:
    model.compute_loss_and_updates = rw(model.compute_loss_and_updates)

  class Record(keras.callbacks.Callback):
    def __init__(self):
      super().__init__()
      self.history, self.times = [], []

    def on_train_batch_begin(self, batch, logs=None):
      self.t0 = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
      self.times.append(time.perf_counter() - self.t0)

    def on_epoch_end(self, epoch, logs=None):
      m = self.model  # the step donates its state: copies
      self.history.append((logs["loss"], ([np.array(v.value) for v in m.trainable_variables],
                                          [np.array(v.value) for v in m.non_trainable_variables],
                                          [np.array(v.value) for v in m.optimizer.variables])))

  rec = Record()
  # One batch an epoch: each epoch's loss is its one step's.
  model.fit(X, T, batch_size=len(X), epochs=steps, shuffle=False, verbose=0, callbacks=[rec])
  state = ([v.value for v in model.trainable_variables],
           [v.value for v in model.non_trainable_variables],
           [v.value for v in model.optimizer.variables],
           [v.value for v in model.metrics_variables])
  text = jax.jit(model.train_step).lower(state, (X, T)).as_text()
  later = rec.times[1:] or rec.times
  return Run(rec.history, text, rw.norms, rec.times[0] - float(np.median(later)), later)


def haiku_loop(rewrite: bool, steps: int) -> Run:
  import haiku as hk
  import optax
  rw = _Reports(rewrite)

  def forward(x, train):
    h = hk.Linear(32, with_bias=False)(x)
    h = hk.BatchNorm(True, True, 0.9)(h, is_training=train)
    h = jax.nn.gelu(hk.LayerNorm(-1, True, True)(h))
    if train:
      h = hk.dropout(hk.next_rng_key(), 0.2, h)
    return hk.Linear(4)(hk.RMSNorm(-1)(h))

  model = hk.transform_with_state(forward)
  params, state = jax.jit(lambda k: model.init(k, X, True))(jax.random.key(0))
  tx = optax.sgd(LR, MOMENTUM)
  apply = rw(model.apply)

  @jax.jit
  def step(params, state, opt_state, x, t, key):
    def loss_fn(params):
      y, state_new = apply(params, state, key, x, True)
      return jnp.mean((y - t) ** 2), state_new

    (loss, state_new), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return loss, optax.apply_updates(params, updates), state_new, opt_state

  def advance(args, outs):
    loss, p, s, o = outs
    return (p, s, o, args[3], args[4], jax.random.fold_in(args[5], 1)), (loss, (p, s, o))

  return _timed_loop(step, (params, state, tx.init(params), X, T, jax.random.key(1)), advance,
                     steps, rw)


def equinox_loop(rewrite: bool, steps: int) -> Run:
  import equinox as eqx
  import optax
  rw = _Reports(rewrite)

  class Model(eqx.Module):
    lin: eqx.nn.Linear
    ln: eqx.nn.LayerNorm
    drop: eqx.nn.Dropout
    gn: eqx.nn.GroupNorm
    out: eqx.nn.Linear

    def __init__(self, key):
      k1, k2 = jax.random.split(key)
      self.lin = eqx.nn.Linear(16, 32, key=k1)
      self.ln = eqx.nn.LayerNorm(32)
      self.drop = eqx.nn.Dropout(0.2)
      self.gn = eqx.nn.GroupNorm(4, 32)  # channels first: (32, 1) per sample
      self.out = eqx.nn.Linear(32, 4, key=k2)

    def __call__(self, x, key):
      h = self.drop(jax.nn.gelu(self.ln(self.lin(x))), key=key)
      return self.out(jax.nn.silu(self.gn(h[:, None]))[:, 0])

  tx = optax.sgd(LR, MOMENTUM)

  def loss_fn(model, x, t, key):
    y = jax.vmap(model)(x, jax.random.split(key, x.shape[0]))
    return jnp.mean((y - t) ** 2)

  @eqx.filter_jit
  def make_step(model, opt_state, x, t, key):
    loss, grads = eqx.filter_value_and_grad(rw(loss_fn))(model, x, t, key)
    updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return loss, eqx.apply_updates(model, updates), opt_state

  model = Model(jax.random.key(0))
  opt_state = tx.init(eqx.filter(model, eqx.is_array))
  key = jax.random.key(1)
  history, times = [], []
  for _ in range(steps):
    t0 = time.perf_counter()
    loss, model, opt_state = jax.block_until_ready(make_step(model, opt_state, X, T, key))
    times.append(time.perf_counter() - t0)
    key = jax.random.fold_in(key, 1)
    history.append((loss, (eqx.filter(model, eqx.is_array), opt_state)))
  text = make_step.lower(model, opt_state, X, T, key).as_text()
  return _first_step_run(history, text, rw, times)


def gpt2_loop(rewrite: bool, steps: int) -> Run:
  import optax
  import transformers
  if not hasattr(transformers, "FlaxGPT2LMHeadModel"):
    raise RuntimeError("transformers without its Flax models")
  rw = _Reports(rewrite)
  cfg = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=16,
                                resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
  model = transformers.FlaxGPT2LMHeadModel(cfg, _do_init=False)
  # Random parameters of the model's shapes, drawn in NumPy (its own init would compile).
  shapes = jax.eval_shape(lambda k: model.init_weights(k, IDS.shape), jax.random.key(0))
  rng = np.random.default_rng(2)

  def draw(path, a):
    name = jax.tree_util.keystr(path[-1:])
    if "scale" in name:
      return jnp.asarray(1.0 + 0.1 * rng.standard_normal(a.shape), a.dtype)
    return jnp.asarray(0.1 * rng.standard_normal(a.shape), a.dtype)

  params = jax.tree_util.tree_map_with_path(draw, shapes)
  tx = optax.sgd(LR, MOMENTUM)

  def loss_fn(params, ids, key):
    logits = model(ids, params=params, dropout_rng=key, train=True).logits
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:]).mean()

  @jax.jit
  def step(params, opt_state, ids, key):
    loss, grads = jax.value_and_grad(rw(loss_fn))(params, ids, key)
    updates, opt_state = tx.update(grads, opt_state, params)
    return loss, optax.apply_updates(params, updates), opt_state

  def advance(args, outs):
    loss, p, o = outs
    return (p, o, args[2], jax.random.fold_in(args[3], 1)), (loss, (p, o))

  return _timed_loop(step, (params, tx.init(params), IDS, jax.random.key(1)), advance, steps, rw)


#: framework -> (the module it needs, its loop, the norms in its model).
LOOPS = {
    "flax NNX": ("flax.nnx", nnx_loop, 2),
    "flax linen": ("flax.linen", linen_loop, 2),
    "keras": ("keras", keras_loop, 2),
    "haiku": ("haiku", haiku_loop, 2),
    "equinox": ("equinox", equinox_loop, 2),
    "transformers GPT-2": ("transformers", gpt2_loop, 3),
}


def train(framework: str, rewrite: bool, steps: int = 3) -> Run:
  """``steps`` steps of ``framework``'s loop, with its one line of ``jn.rewrite`` or without."""
  return LOOPS[framework][1](rewrite, steps)


def leaves(tree) -> list:
  """The tree's array leaves as float64 NumPy (PRNG keys as their data)."""
  out = []
  for a in jax.tree.leaves(tree):
    if hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
      a = jax.random.key_data(a)
    out.append(np.asarray(a, np.float64))
  return out


def max_difference(got: Run, want: Run) -> float:
  """The largest difference of the two runs' losses and state leaves over all steps, relative to
  the largest value of each step's state (the losses: to the loss)."""
  worst = 0.0
  for (loss, state), (loss_want, state_want) in zip(got.history, want.history, strict=True):
    worst = max(worst, abs(float(loss) - float(loss_want)) / max(abs(float(loss_want)), 1e-30))
    a, e = leaves(state), leaves(state_want)
    if len(a) != len(e):
      return float("inf")
    scale = max([1.0] + [float(np.abs(v).max()) for v in e if v.size])
    for u, v in zip(a, e):
      if u.shape != v.shape:
        return float("inf")
      if u.size:
        worst = max(worst, float(np.abs(u - v).max()) / scale)
  return worst
