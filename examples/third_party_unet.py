"""A third-party model, unchanged, on jax_normgrad's kernels: flaxdiff's UNet under ``patch()``.

flaxdiff (a diffusion library on PyPI; nothing of it is written here) builds
its UNet from ``flax.linen.GroupNorm`` (and ``LayerNorm`` in its attention
blocks). ``jax_normgrad.flax.patch()`` before importing it makes those the
drop-ins. This script builds a small random-init UNet twice, with flax's
layers and patched, and checks what a user switching would check:

* the loss and every gradient leaf equal to float32 tolerance;
* 20 adam steps: the same loss curve;
* the time of one jitted training step (value_and_grad + adam update) with
  flax's layers, patched, and with the norms replaced by identities (the
  norms' share of the step), in interleaved rounds, medians.

Install and run (flaxdiff's own dependencies are for its data pipelines and
trainers, not its models, hence ``--no-deps``)::

    pip install --no-deps flaxdiff==0.2.11 && pip install einops optax
    python examples/third_party_unet.py             # the check and the timing
    python examples/third_party_unet.py --size bench --rounds 5

``tests/test_examples.py`` runs :func:`compare` on the small size.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import optax

import jax_normgrad.flax as jf

# (batch, image side, feature depths, attention per level); "bench" is closer to a real UNet.
SIZES = {
    "small": (2, 16, (16, 32), (None, {"heads": 2})),
    "bench": (8, 32, (64, 128, 256), (None, None, {"heads": 4})),
    "gpu": (32, 32, (64, 128, 256), (None, None, {"heads": 4})),
}


def _identity(cls):
  """``cls`` with its constructor and a ``__call__`` that returns x: a norm that costs nothing."""
  return type(cls.__name__, (cls,), {"__call__": lambda self, x, *a, **k: x})


@contextlib.contextmanager
def _forward(choice: str):
  """The drop-ins' default forward while a step is lowered (``JAX_NORMGRAD_FORWARD``)."""
  before = os.environ.get("JAX_NORMGRAD_FORWARD")
  os.environ["JAX_NORMGRAD_FORWARD"] = choice
  try:
    yield
  finally:
    if before is None:
      del os.environ["JAX_NORMGRAD_FORWARD"]
    else:
      os.environ["JAX_NORMGRAD_FORWARD"] = before


def _layers_in_place(variant: str):
  """What flax.linen's norms are while a variant is built: flax's, the drop-ins, or identities.

  "ours": the drop-ins with the platform's default forward; "ours_kernel" / "ours_xla": with
  the forward kernel / XLA's forward (the backward kernel either way).
  """
  if variant == "flax":
    return contextlib.nullcontext()
  if variant.startswith("ours"):
    stack = contextlib.ExitStack()
    stack.enter_context(jf.patch())
    if variant != "ours":
      stack.enter_context(_forward(variant.removeprefix("ours_")))
    return stack
  # The same replacement patch() makes (a private helper: a benchmark's variant, not an API).
  return jf._layers.Patch("flax.linen", [_identity(c) for c in (jf._LayerNorm, jf._RMSNorm,
                                                                jf._GroupNorm)])


def _setup(size: str, seed: int = 0):
  batch, side, depths, attention = SIZES[size]
  k = jax.random.split(jax.random.key(seed), 4)
  x = jax.random.normal(k[0], (batch, side, side, 3))
  t = jax.random.uniform(k[1], (batch,))
  text = jax.random.normal(k[2], (batch, 4, 32))
  target = jax.random.normal(k[3], x.shape)
  config = dict(output_channels=3, emb_features=4 * depths[0], feature_depths=depths,
                attention_configs=attention, num_res_blocks=1, num_middle_res_blocks=1,
                norm_groups=8)
  return config, (x, t, text, target)


def training_step(model, opt):
  def loss_fn(params, x, t, text, target):
    return jnp.mean((model.apply(params, x, t, text) - target) ** 2)

  @jax.jit
  def step(params, state, x, t, text, target):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, t, text, target)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss, grads

  return step


def _variant(variant: str, size: str):
  """(compiled step, params, opt_state, data, kernel calls in the step): one variant.

  The step is traced and compiled inside the patch (ahead of time), so it
  keeps the layers it was built with whatever is patched when it runs.
  """
  config, data = _setup(size)
  # flaxdiff's modules look up nn.GroupNorm / nn.LayerNorm when the model is
  # built and traced, so what is in place then is what the step runs.
  unet = importlib.import_module("flaxdiff.models.simple_unet").Unet
  with _layers_in_place(variant):
    model = unet(**config)
    params = model.init(jax.random.key(1), *data[:3])
    opt = optax.adam(1e-3)
    state = opt.init(params)
    lowered = training_step(model, opt).lower(params, state, *data)
  calls = lowered.as_text().count("custom_call @jax_normgrad_")
  return lowered.compile(), params, state, data, calls


def compare(size: str = "small", steps: int = 20) -> dict:
  """The patched model against flax's: loss, gradients, a loss curve, the norms' kernel calls."""
  flax_step, params, flax_state, data, flax_calls = _variant("flax", size)
  ours_step, ours_params, ours_state, _, ours_calls = _variant("ours", size)
  assert jax.tree.structure(params) == jax.tree.structure(ours_params)
  ours_params = params  # the same initial values for both
  curves = {"flax": [], "ours": []}
  first = {}
  for who, step, p, s in [("flax", flax_step, params, flax_state),
                          ("ours", ours_step, ours_params, ours_state)]:
    for i in range(steps):
      p, s, loss, grads = step(p, s, *data)
      if i == 0:
        first[who] = (float(loss), grads)
      curves[who].append(float(loss))
  grad_err = max(
      float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30))
      for a, b in zip(jax.tree.leaves(first["ours"][1]), jax.tree.leaves(first["flax"][1])))
  return {"size": size, "kernel_calls": {"flax": flax_calls, "ours": ours_calls},
          "loss": {"flax": first["flax"][0], "ours": first["ours"][0]},
          "max_grad_rel_err": grad_err, "curves": curves,
          "grad_leaves": len(jax.tree.leaves(first["flax"][1]))}


def time_steps(size: str, rounds: int = 5, iters: int = 10,
               variants: tuple[str, ...] = ("flax", "ours", "none")) -> dict:
  """Median ms of one jitted training step per variant, interleaved rounds: flax's layers
  ("flax"), the drop-ins ("ours"; "ours_kernel" / "ours_xla" with that forward) and the norms
  replaced by identities ("none": what a free norm would cost)."""
  variants = {v: _variant(v, size) for v in variants}
  times = {k: [] for k in variants}
  for r in range(rounds):
    for who, (step, params, state, data, _) in variants.items():
      for _ in range(3 if r == 0 else 1):
        jax.block_until_ready(step(params, state, *data))
      for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(step(params, state, *data))
        times[who].append(1e3 * (time.perf_counter() - t0))
  return {who: statistics.median(t) for who, t in times.items()}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--size", choices=list(SIZES), default="small")
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--iters", type=int, default=10)
  parser.add_argument("--variants", default="flax,ours,none",
                      help="comma-separated: flax, ours, ours_kernel, ours_xla, none (flax and "
                           "none always run)")
  args = parser.parse_args(argv)
  variants = tuple(dict.fromkeys(["flax"] + args.variants.split(",") + ["none"]))
  result = compare(args.size)
  c = result["curves"]
  print(f"flaxdiff Unet ({args.size}): kernel calls in the step: flax {result['kernel_calls']['flax']}, "
        f"patched {result['kernel_calls']['ours']}")
  print(f"loss {result['loss']['flax']:.6f} (flax) vs {result['loss']['ours']:.6f} (patched); "
        f"max gradient error over {result['grad_leaves']} leaves {result['max_grad_rel_err']:.2e} "
        f"(relative to each leaf's max)")
  print("loss curve, 20 adam steps (flax / patched): " + ", ".join(
      f"{a:.4f}/{b:.4f}" for a, b in zip(c["flax"][::5], c["ours"][::5])) +
        f", last {c['flax'][-1]:.4f}/{c['ours'][-1]:.4f}")
  ms = time_steps(args.size, args.rounds, args.iters, variants)
  norms = ms["flax"] - ms["none"]
  print(f"one training step, median ms: flax {ms['flax']:.2f}, norms removed {ms['none']:.2f}; "
        f"the norms' share of flax's step {norms / ms['flax']:.1%}; jax {jax.__version__}, "
        f"{jax.devices()[0].device_kind}")
  for v in variants:
    if v.startswith("ours"):
      print(f"  {v}: {ms[v]:.2f} ms ({ms['flax'] / ms[v]:.2f}x flax's), saves "
            f"{(ms['flax'] - ms[v]) / norms:.0%} of the norms' time")
  return 0


if __name__ == "__main__":
  sys.exit(main())
