"""Benchmark: the norms inside models, one jitted training step per variant.

Run from the repository root after `pip install .` (flax; optax if installed):

    python benchmarks/bench_models.py                  # the two small models, 5 rounds
    python benchmarks/bench_models.py --quick          # tiny models, 1 round: a smoke run
    python benchmarks/bench_models.py --model unet --rounds 8 --iters 40
    python benchmarks/bench_models.py --model transformer --rounds 60 --iters 120 \
        --keep-freed-memory --profile-rounds 5   # no page faults; savings by op time too
    python benchmarks/bench_models.py --model realistic --dtypes bfloat16,float32 \
        --trace-calls 2                          # the sizes people train (a GPU)

Two kinds of model, each built with flax.linen in several variants that
differ only in their norms:

* **unet**: a UNet-style stack of residual blocks (GroupNorm -> SiLU -> 3x3
  conv, twice, plus the skip), NHWC, a strided conv between levels;
  variants ``flax`` (flax.linen.GroupNorm then ``nn.silu``), ``ours``
  (jax_normgrad.flax.GroupNorm then ``nn.silu``), ``fused``
  (``jax_normgrad.flax.GroupNorm(..., activation="silu")``: the kernels
  apply the SiLU in their output pass, its derivative in the backward) and
  ``identity`` (SiLU alone: the step without the norms).
* **transformer**: a pre-norm stack (residual add -> LayerNorm or RMSNorm
  -> self-attention / MLP); variants ``flax`` (flax's norm after ``h = h +
  out``), ``ours`` (``jax_normgrad.flax.AddLayerNorm`` / ``AddRMSNorm``:
  the add and the norm one kernel, :func:`jax_normgrad.add_layer_norm`),
  ``dropin`` (``h = h + out`` then the plain drop-in, what ``patch()``
  gives) and ``identity`` (the add alone).

Besides the small ``unet`` and ``transformer`` (``--size``; on a GPU bound
by their launches), ``--model`` names sizes people train on one GPU
(``REALISTIC``): ``sd_unet``, a Stable-Diffusion-class UNet (a 64x64
latent of 4 channels, levels of 320/640/1280 channels, GroupNorm with 32
groups then SiLU, batch 8); ``gpt2``, a GPT-2-small-class transformer (12
blocks of 768, 12 heads, causal attention over 1024 tokens, batch 16);
``dit_b``, a DiT-B-class transformer (12 blocks of 768, 12 heads, 256
tokens, batch 64; its norms are LayerNorms with parameters, DiT's adaLN
modulation is not modelled). Their default variants are flax's layers, the
drop-ins with the kernel forward and with XLA's, the fused forms and the
identity (``REALISTIC_VARIANTS``).

The small models also run ``affine``: each norm replaced by its affine part
(``x * scale + bias``, flax's parameters, no statistics), a second stand-in
for a free norm. ``identity`` also drops the norms' parameters, their
optimizer updates and the gradient paths to them: in the transformer the
first norm reads the model's input, so the identity step computes no input
gradient of the first attention's projections, work that no norm kernel
can save. Savings are reported against both.

Each step is ``jax.value_and_grad`` of an MSE loss plus an optimizer update
(optax's adam where installed, else SGD), jitted. The variants of a model
are timed in interleaved rounds (each round times every variant in turn,
after a pause and one untimed call, as bench_cpu.py's columns), medians
over all rounds. Reported: the norms' share of flax's step, ``(flax -
identity) / flax``, and the share of that norm time each package variant
saves, ``(flax - variant) / (flax - identity)``, with a 90% interval
for it from the rounds (:func:`bench_lib.saves_interval`: each round times every
variant back to back, so a round's differences are paired; a slow spell
of the machine moves all of a round's steps together). With
``--profile-rounds`` also by op time (:func:`measure_model`). With
``--keep-freed-memory``, :func:`jax_normgrad.keep_freed_memory` first:
without it each step's fresh buffers page-fault, and on the 2-core VM a
step's first op that touches them stalled for 25-50 ms in 2 to 3 steps
of 10, whichever variant's op that was.

``--trace-calls N``: after the timed rounds, one ``jax.profiler`` trace per
model and dtype holding N calls of each variant's step
(``bench_lib.trace_steps``; ``--trace-variants``), saved
beside the JSON (``--trace-dir``), each variant's kernel times, launches and
the step's time with no kernel running in the row (``<variant>_trace``).
The steps are then compiled with ``xla_enable_command_buffers_during_profiling``:
XLA turns its command buffers (CUDA graphs) off while a profiler runs unless
a module was compiled with it, and reads it only then, so the timed rounds,
which run no profiler, run the same executables as without it.

Writes a JSON file (``--out``) with the run (:func:`bench_lib.run_info`:
device, GPU backend, versions, commit, command) and the load average,
after each model.
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import json
import os
import pathlib
import sys
import time
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_normgrad import _bench, _ffi

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_cpu import SETTLE_S, cpu_model  # noqa: E402  (the sibling script's conventions)
import bench_lib  # noqa: E402  (the profile parsing, the rounds' statistics)

import flax.linen as nn  # noqa: E402
import jax_normgrad.flax as jnf  # noqa: E402

class UNetSize(NamedTuple):
  batch: int
  side: int
  channels: tuple  # per level
  blocks: int  # per level
  groups: int
  in_channels: int = 3


class TransformerSize(NamedTuple):
  batch: int
  tokens: int
  width: int
  heads: int
  blocks: int
  causal: bool = False


# "quick" is a smoke size; "gpu" the small UNet at batch 32 (GroupNorm on 32x32x32x64 down to
# 32x8x8x256), launch-bound on a GPU.
UNET_SIZES = {
    "default": UNetSize(8, 32, (64, 128, 256), 2, 32),
    "quick": UNetSize(2, 8, (16,), 1, 4),
    "gpu": UNetSize(32, 32, (64, 128, 256), 2, 32),
}
# "gpu": a small DiT-sized stack (6 blocks of 512, 256 tokens, batch 32).
TRANSFORMER_SIZES = {
    "default": TransformerSize(8, 256, 512, 8, 4),
    "quick": TransformerSize(2, 16, 32, 2, 1),
    "gpu": TransformerSize(32, 256, 512, 8, 6),
}
#: model name -> (kind, {size name: size}). The realistic ones have one size, "full", and a
#: "quick" of their structure (channels per group not a power of two, causal attention).
MODELS = {
    "unet": ("unet", UNET_SIZES),
    "transformer": ("transformer", TRANSFORMER_SIZES),
    "sd_unet": ("unet", {"full": UNetSize(8, 64, (320, 640, 1280), 2, 32, in_channels=4),
                         "quick": UNetSize(2, 8, (20, 40), 1, 2, in_channels=4)}),
    "gpt2": ("transformer", {"full": TransformerSize(16, 1024, 768, 12, 12, causal=True),
                             "quick": TransformerSize(2, 16, 24, 2, 1, causal=True)}),
    "dit_b": ("transformer", {"full": TransformerSize(64, 256, 768, 12, 12),
                              "quick": TransformerSize(2, 16, 24, 2, 1)}),
}
#: ``--model`` names for several: the small (launch-bound) pair and the sizes people train.
MODEL_GROUPS = {"all": ("unet", "transformer"), "realistic": ("sd_unet", "gpt2", "dit_b")}
REALISTIC = MODEL_GROUPS["realistic"]
#: The realistic models' default variants by kind: flax's layers, the drop-ins with the kernel
#: forward and XLA's, the fused form (GroupNorm + SiLU; the residual add + LayerNorm), identity.
REALISTIC_VARIANTS = {"unet": ("flax", "ours", "ours_xla", "fused", "identity"),
                      "transformer": ("flax", "dropin", "dropin_xla", "ours", "identity")}


def fused_activation_available() -> bool:
  """Whether the GroupNorm drop-in takes ``activation=`` (the fused GroupNorm + SiLU)."""
  return "activation" in jnf.GroupNorm.__dataclass_fields__


# ----------------------------------------------------------------------------
# UNet-style residual blocks.


class Affine(nn.Module):
  """A norm without its statistics: ``x * scale (+ bias)`` over the last axis, a norm's parameters.

  The ``affine`` variants' stand-in for a free norm. Unlike ``identity`` it
  keeps what the norms bring besides their statistics: their parameters
  and optimizer updates, and the gradient paths to them (a transformer's
  first norm reads the model's input, so without a parameter there nothing
  before the first attention's projections needs an input gradient).
  """

  use_bias: bool = True

  @nn.compact
  def __call__(self, x):
    d = x.shape[-1]
    y = x * self.param("scale", nn.initializers.ones, (d,))
    return y + self.param("bias", nn.initializers.zeros, (d,)) if self.use_bias else y


def module_variant(variant: str) -> str:
  """The norms a variant's model is built with: ``rewrite`` is flax's model (the rewrite changes
  its traced loss, not its layers)."""
  return "flax" if variant == "rewrite" else variant


def forward_of(variant: str) -> str | None:
  """The drop-ins' ``forward`` for a package variant: ``*_xla`` is XLA's forward, else the kernel."""
  return "xla" if variant.endswith("_xla") else "kernel"


def split_variant(variant: str) -> tuple[str, dict]:
  """``"fused@gpu_nhwc_split=False"`` -> ``("fused", {"gpu_nhwc_split": False})``.

  A variant named ``base@key=value[@key=value...]`` is the model of ``base``
  with ``bench_lib.tuning(key=value, ...)`` in force
  while its step is traced: a kernel heuristic compared inside the model,
  beside the default, in the same interleaved rounds (values are Python
  literals).
  """
  base, *pairs = variant.split("@")
  tuning = {}
  for pair in pairs:
    key, _, value = pair.partition("=")
    try:
      tuning[key] = ast.literal_eval(value)
    except (ValueError, SyntaxError):
      tuning[key] = value
  return base, tuning


class NormSiLU(nn.Module):
  """GroupNorm then SiLU, in one of the variants (parameters named as flax's GroupNorm's).

  ``ours``/``fused`` run the forward kernel, ``ours_xla``/``fused_xla``
  XLA's jnp forward (``forward="xla"``), the backward kernel either way.
  """

  variant: str
  groups: int
  dtype: Any = None

  @nn.compact
  def __call__(self, x):
    kw = dict(num_groups=self.groups, dtype=self.dtype)
    if self.variant == "flax":
      return nn.silu(nn.GroupNorm(**kw)(x))
    if self.variant in ("ours", "ours_xla"):
      return nn.silu(jnf.GroupNorm(**kw, forward=forward_of(self.variant))(x))
    if self.variant in ("fused", "fused_xla"):  # the SiLU in the GroupNorm's output pass
      return jnf.GroupNorm(**kw, activation="silu", forward=forward_of(self.variant))(x)
    if self.variant == "identity":
      return nn.silu(x)
    if self.variant == "affine":
      return nn.silu(Affine()(x).astype(x.dtype))
    raise ValueError(f"variant: unknown {self.variant!r}")


class ResBlock(nn.Module):
  channels: int
  variant: str
  groups: int
  dtype: Any = None

  @nn.compact
  def __call__(self, x):
    conv = lambda k: nn.Conv(self.channels, k, dtype=self.dtype)
    h = conv((3, 3))(NormSiLU(self.variant, self.groups, self.dtype)(x))
    h = conv((3, 3))(NormSiLU(self.variant, self.groups, self.dtype)(h))
    if x.shape[-1] != self.channels:
      x = conv((1, 1))(x)
    return x + h


class UNetStack(nn.Module):
  """Stem conv, ``blocks`` residual blocks per level, a stride-2 conv between levels, a head conv."""

  channels: tuple
  blocks: int
  variant: str
  groups: int
  dtype: Any = None  # the convolutions' and norms' computation dtype (flax's ``dtype``)

  @nn.compact
  def __call__(self, x):
    h = nn.Conv(self.channels[0], (3, 3), dtype=self.dtype)(x)
    for level, c in enumerate(self.channels):
      if level:
        h = nn.Conv(c, (3, 3), strides=(2, 2), dtype=self.dtype)(h)
      for _ in range(self.blocks):
        h = ResBlock(c, self.variant, self.groups, self.dtype)(h)
    h = NormSiLU(self.variant, self.groups, self.dtype)(h)
    return nn.Conv(x.shape[-1], (3, 3), dtype=self.dtype)(h).astype(jnp.float32)


#: The package variants whose forward is XLA's (``forward="xla"``), each beside its kernel twin.
XLA_FORWARD_VARIANTS = ("ours_xla", "fused_xla", "dropin_xla")


def unet_variants() -> tuple[str, ...]:
  return ("flax", "ours", "ours_xla") + (
      ("fused", "fused_xla") if fused_activation_available() else ()) + (
      "rewrite", "identity", "affine")


def _size(size, sizes: dict):
  return sizes[size] if isinstance(size, str) else size


def unet_setup(variant: str, size="default", dtype=jnp.float32):
  """``(model, x, target)``; the target has the last level's shape.

  ``size``: a name of ``UNET_SIZES`` or a :class:`UNetSize`. ``dtype``: the
  model's computation dtype (its convolutions and norms; the parameters
  stay float32, as flax's mixed precision), x in it too.
  """
  batch, side, channels, blocks, groups, cin = _size(size, UNET_SIZES)
  model = UNetStack(channels, blocks, module_variant(variant), groups, jnp.dtype(dtype))
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((batch, side, side, cin), np.float32)).astype(dtype)
  out_side = side >> (len(channels) - 1)
  target = jnp.asarray(rng.standard_normal((batch, out_side, out_side, cin), np.float32))
  return model, x, target


def unet_norm_shapes(size="default") -> list[str]:
  """The GroupNorm inputs of one forward, NHWC, as ``NxHxWxC`` (each with the count)."""
  batch, side, channels, blocks, *_ = _size(size, UNET_SIZES)
  shapes = {}
  prev = channels[0]
  for level, c in enumerate(channels):
    s = side >> level
    for b in range(blocks):
      for ch in ((prev if b == 0 else c), c):
        key = f"{batch}x{s}x{s}x{ch}"
        shapes[key] = shapes.get(key, 0) + 1
      prev = c
  s = side >> (len(channels) - 1)
  key = f"{batch}x{s}x{s}x{channels[-1]}"
  shapes[key] = shapes.get(key, 0) + 1
  return [f"{k} ({v}x)" for k, v in shapes.items()]


# ----------------------------------------------------------------------------
# Pre-norm transformer blocks.


class AddNorm(nn.Module):
  """``(y, h)`` with ``h = x + residual`` and ``y = norm(h)``; ``residual=None``: ``h = x``."""

  variant: str
  norm: str  # "layer" | "rms"
  dtype: Any = None

  @nn.compact
  def __call__(self, x, residual=None):
    centered = self.norm == "layer"
    kw = dict(dtype=self.dtype)
    if self.variant != "flax":
      kw["forward"] = forward_of(self.variant)
    if self.variant in ("ours", "ours_xla") and residual is not None:
      return (jnf.AddLayerNorm(**kw) if centered else jnf.AddRMSNorm(**kw))(x, residual)
    h = x if residual is None else x + residual
    if self.variant == "identity":
      return h, h
    if self.variant == "affine":
      return Affine(use_bias=centered)(h).astype(h.dtype), h
    mod = nn if self.variant == "flax" else jnf
    return (mod.LayerNorm(**kw) if centered else mod.RMSNorm(**kw))(h), h


class MLP(nn.Module):
  dtype: Any = None

  @nn.compact
  def __call__(self, y):
    d = y.shape[-1]
    return nn.Dense(d, dtype=self.dtype)(nn.gelu(nn.Dense(4 * d, dtype=self.dtype)(y)))


class PreNormStack(nn.Module):
  """``blocks`` pre-norm blocks (attention, then MLP), the add before each norm, a final norm."""

  blocks: int
  heads: int
  variant: str
  norm: str
  dtype: Any = None
  causal: bool = False  # each token attends to those before it (a language model's mask)

  @nn.compact
  def __call__(self, x):
    add_norm = lambda: AddNorm(self.variant, self.norm, self.dtype)
    mask = nn.make_causal_mask(x[..., 0]) if self.causal else None
    y, h = add_norm()(x)
    for _ in range(self.blocks):
      out = nn.MultiHeadDotProductAttention(num_heads=self.heads, dtype=self.dtype)(y, mask=mask)
      y, h = add_norm()(out, h)
      y, h = add_norm()(MLP(self.dtype)(y), h)
    return y.astype(jnp.float32)


TRANSFORMER_VARIANTS = ("flax", "ours", "ours_xla", "dropin", "dropin_xla", "rewrite", "identity",
                        "affine")
# The variants without this package's kernels: the reference and the two stand-ins for a free norm.
BASELINES = ("flax", "identity", "affine")
# The norm-free steps a saving is measured against, and its keys' suffix.
SAVINGS_BASES = (("", "identity"), ("_vs_affine", "affine"))


def transformer_setup(variant: str, norm: str = "layer", size="default", dtype=jnp.float32):
  """``(model, x, target)``; ``size`` a name of ``TRANSFORMER_SIZES`` or a :class:`TransformerSize`,
  ``dtype`` as :func:`unet_setup`'s (the residual stream in it too)."""
  batch, tokens, width, heads, blocks, causal = _size(size, TRANSFORMER_SIZES)
  model = PreNormStack(blocks, heads, module_variant(variant), norm, jnp.dtype(dtype), causal)
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((batch, tokens, width), np.float32)).astype(dtype)
  target = jnp.asarray(rng.standard_normal(x.shape, np.float32))
  return model, x, target


# ----------------------------------------------------------------------------
# The training step and the interleaved timing.


def _optimizer():
  """optax's adam where installed, else SGD as ``(init, update)`` on pytrees; and its name."""
  try:
    import optax
  except ImportError:
    init = lambda params: ()
    update = lambda grads, state, params: (jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads),
                                           state)
    return init, update, "sgd"
  tx = optax.adam(1e-3)

  def update(grads, state, params):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return tx.init, update, f"optax {optax.__version__} adam"


def training_step(model: nn.Module, x, target, rewrite: bool = False) -> tuple[Callable, tuple]:
  """The jitted ``step(params, opt_state, x, target) -> (loss, params, opt_state)`` and its args.

  ``rewrite``: the loss under :func:`jax_normgrad.rewrite` (the ``rewrite`` variant)."""
  init, update, _ = _optimizer()

  def loss_fn(params, x, target):
    return jnp.mean(jnp.square(model.apply(params, x) - target))

  if rewrite:
    import jax_normgrad as jn
    loss_fn = jn.rewrite(loss_fn)

  @jax.jit
  def step(params, opt_state, x, target):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, target)
    params, opt_state = update(grads, opt_state, params)
    return loss, params, opt_state

  params = init_params(model, x)
  return step, (params, init(params), x, target)


def init_params(model: nn.Module, x, seed: int = 1):
  """The model's parameters drawn by NumPy: kernels normal / sqrt(fan-in), scales 1, the rest 0.

  Shapes from ``jax.eval_shape(model.init)``, which traces and compiles
  nothing: jitting flax's initializers (truncated normals) took seconds per
  variant, more than the step's own compile at the smoke size.
  """
  rng = np.random.default_rng(seed)

  def draw(path, leaf):
    name = getattr(path[-1], "key", "")
    if name == "kernel":
      fan_in = int(np.prod(leaf.shape[:-1])) or 1
      return jnp.asarray(rng.standard_normal(leaf.shape, np.float32) / np.sqrt(fan_in))
    return jnp.full(leaf.shape, 1.0 if name == "scale" else 0.0, leaf.dtype)

  shapes = jax.eval_shape(model.init, jax.random.key(seed), x)
  return jax.tree_util.tree_map_with_path(draw, shapes)


def count_params(params) -> int:
  return int(sum(np.prod(p.shape) for p in jax.tree.leaves(params)))


def compile_steps(steps: dict[str, tuple], threads: int = 1,
                  compiler_options: dict | None = None) -> dict[str, tuple]:
  """``{variant: (compiled step, args, lowered text, compiled text)}``, compiled ahead of time.

  Each step is traced and lowered in turn (Python, one thread; a
  ``base@key=value`` variant under :func:`bench_lib.tuning`), then compiled:
  the first alone, the others on ``threads`` threads (XLA compiles without
  holding the GIL; on a GPU a model's variants compile in seconds each,
  most of a run's time). The first compile's autotuning of the
  convolutions and matmuls, which the variants share, is then in XLA's
  cache for the others, instead of every thread timing the same
  candidates on the one GPU at once. ``compiler_options``: XLA's options
  for every compile (``Lowered.compile``).
  """
  def lower(variant, step, args):
    with bench_lib.tuning(**split_variant(variant)[1]):
      return step.lower(*args)

  lowered = {v: (lower(v, step, args), args) for v, (step, args) in steps.items()}
  compile_one = lambda la: la[0].compile(compiler_options)
  first, *rest = lowered
  compiled = {first: compile_one(lowered[first])}
  with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as pool:
    compiled.update(zip(rest, pool.map(compile_one, [lowered[v] for v in rest])))
  return {v: (compiled[v], args, low.as_text(), compiled[v].as_text())
          for v, (low, args) in lowered.items()}


def measure_model(name: str, setups: dict[str, Any], iters: int, rounds: int,
                  settle_s: float = SETTLE_S, profile_rounds: int = 0,
                  compile_threads: int = 1, top_kernels: int = 0, trace_calls: int = 0,
                  trace_variants: tuple | None = None, trace_path=None) -> dict:
  """One model: each variant's step in interleaved rounds; the medians, shares and savings.

  ``setups``: variant -> ``(model, x, target)``; must hold ``flax`` and
  ``identity`` (``affine`` optional). Returns ``{"model", "variants",
  "rounds", "<variant>_ms", "<variant>_rounds_ms", "<variant>_loss",
  "<variant>_params", "<variant>_custom_calls", "norm_share",
  "<variant>_saves"}`` with ``<variant>_saves = (flax - variant) / (flax -
  identity)`` for each package variant (the share of the norm time saved);
  with ``affine``, also ``norm_ms_affine = flax - affine`` and
  ``<variant>_saves_vs_affine`` against that. ``<variant>_saves_paired``
  (and ``..._vs_affine_paired``): ``[estimate, low, high]`` of
  :func:`bench_lib.saves_interval` from the round medians, or None.

  With ``profile_rounds``, each variant's step is also profiled in that
  many interleaved rounds of 2 calls (:func:`bench_lib.step_op_ms`):
  ``<variant>_op_ms`` holds the medians of its summed op times (``ops``,
  ``matmul``, ``other``: ms per step), and ``<variant>_saves_by_op_time``
  the saved share computed from the ``other`` times, the passes besides
  the dots and convolutions, where the norms' own work runs: the
  variants' matmuls are the same ones (less the three the transformer's
  identity drops), and on a 2-core machine their run-to-run spread is
  larger than the whole norm time. On a GPU the op times are the device's
  kernels, with ``norm`` (this package's kernels) besides, and
  ``top_kernels`` > 0 keeps the largest kernels of each variant's step
  (``<variant>_op_ms["kernels"]``: name, us per step, launches per step):
  the norm kernels and the converts, transposes and reductions around them.
  ``compile_threads``: see :func:`compile_steps`.

  ``trace_calls`` > 0: after the rounds, the variants of ``trace_variants``
  (None: those without ``_xla`` or ``@`` in their name) in one trace
  (:func:`bench_lib.trace_steps`, saved to ``trace_path`` if given), each
  step's ``calls`` calls: ``<variant>_trace`` holds its summary (ms per
  step: ``ops``, ``matmul``, ``other``, ``busy`` and ``span``; on a GPU
  ``norm``, ``launches`` and with ``top_kernels`` the largest
  ``kernels``), compiled with command buffers kept on under the profiler
  (the module docstring says why the timed rounds are not changed).
  Each variant's ``<variant>_kernel_targets`` counts its kernel calls by
  custom-call target (a GPU's: Triton's or Mosaic GPU's).
  """
  t0 = time.perf_counter()
  options = {"xla_enable_command_buffers_during_profiling": True} if trace_calls else None
  compiled = compile_steps({v: training_step(*s, rewrite=split_variant(v)[0] == "rewrite")
                            for v, s in setups.items()}, compile_threads, options)
  compile_s = time.perf_counter() - t0
  steps = {v: (c[0], c[1]) for v, c in compiled.items()}
  per_round = max(1, -(-iters // rounds))
  samples = {v: [] for v in steps}
  round_medians = {v: [] for v in steps}
  for rnd in range(rounds):
    for v, (step, args) in steps.items():
      time.sleep(settle_s)
      times = _bench.call_times_ms(step, *args, warmup=2 if rnd == 0 else (1 if settle_s else 0),
                                   iters=per_round)
      samples[v] += times
      round_medians[v].append(float(np.median(times)))
  op_times = {v: [] for v in steps}
  for _ in range(profile_rounds):
    for v, (step, args) in steps.items():
      time.sleep(settle_s)
      op_times[v].append(bench_lib.step_op_ms(step, args, calls=2, top=top_kernels,
                                           hlo_text=compiled[v][3]))
  traced = {}
  if trace_calls:
    chosen = trace_variants or [v for v in steps if not v.endswith("_xla") and "@" not in v]
    traced = bench_lib.trace_steps({v: (*steps[v], compiled[v][3]) for v in chosen if v in steps},
                                   calls=trace_calls, top=top_kernels, save_to=trace_path)
  row = {"model": name, "variants": list(steps), "rounds": rounds, "iters": per_round * rounds,
         "profile_rounds": profile_rounds, "compile_s": compile_s, "trace_calls": trace_calls,
         "trace_file": str(trace_path) if traced and trace_path else None}
  for v, (step, args) in steps.items():
    row[f"{v}_loss"] = float(step(*args)[0])  # the first step's: flax's and the kernels' agree
    row[f"{v}_ms"] = float(np.median(samples[v]))
    row[f"{v}_rounds_ms"] = round_medians[v]
    row[f"{v}_params"] = count_params(steps[v][1][0])
    row[f"{v}_custom_calls"] = bench_lib.custom_calls(compiled[v][2])
    row[f"{v}_kernel_targets"] = bench_lib.kernel_targets(compiled[v][2])
    if v in traced:
      row[f"{v}_trace"] = traced[v]
    if profile_rounds:
      row[f"{v}_op_ms"] = {k: float(np.median([t[k] for t in op_times[v]]))
                           for k in ("ops", "matmul", "other", "norm", "launches")
                           if k in op_times[v][0]}
      if top_kernels:
        row[f"{v}_op_ms"]["kernels"] = op_times[v][-1]["kernels"]
  flax_ms, none_ms = row["flax_ms"], row["identity_ms"]
  row["norm_ms"] = flax_ms - none_ms
  row["norm_share"] = row["norm_ms"] / flax_ms
  if "affine" in steps:
    row["norm_ms_affine"] = flax_ms - row["affine_ms"]
  for v in steps:
    if v not in BASELINES:
      row[f"{v}_vs_flax"] = flax_ms / row[f"{v}_ms"]
      row[f"{v}_saves"] = (flax_ms - row[f"{v}_ms"]) / row["norm_ms"] if row["norm_ms"] > 0 else None
      if row.get("norm_ms_affine", 0) > 0:
        row[f"{v}_saves_vs_affine"] = (flax_ms - row[f"{v}_ms"]) / row["norm_ms_affine"]
      for suffix, base in SAVINGS_BASES:
        if base not in steps:
          continue
        paired = bench_lib.saves_interval(round_medians["flax"], round_medians[v],
                                          round_medians[base])
        row[f"{v}_saves{suffix}_paired"] = list(paired) if paired else None
        if profile_rounds:
          other = {b: row[f"{b}_op_ms"]["other"] for b in ("flax", v, base)}
          norm_other = other["flax"] - other[base]
          row[f"{v}_saves_by_op_time{suffix}"] = ((other["flax"] - other[v]) / norm_other
                                                  if norm_other > 0 else None)
  return row


def print_row(row: dict):
  print(f"\n{row['model']} ({row['flax_params'] / 1e6:.2f}M params; {row['rounds']} rounds, "
        f"{row['iters']} steps per variant; compiled in {row['compile_s']:.1f} s)")
  for v in row["variants"]:
    saves = row.get(f"{v}_saves")
    extra = (f"  {row[f'{v}_vs_flax']:.3f}x flax's, saves {100 * saves:5.1f}% of the norm time"
             if saves is not None else "")
    if v not in BASELINES:  # a wrong kernel shows here first
      lf = row["flax_loss"]
      extra += f"; loss {abs(row[f'{v}_loss'] - lf) / max(abs(lf), 1e-30):.1e} from flax's"
    if f"{v}_saves_vs_affine" in row:
      extra += f" ({100 * row[f'{v}_saves_vs_affine']:.1f}% against affine)"
    for suffix, base in SAVINGS_BASES:
      paired = row.get(f"{v}_saves{suffix}_paired")
      if paired:
        extra += (f"\n{'':12s}by round pairs against {base}: {100 * paired[0]:.1f}%, "
                  f"90% interval {100 * paired[1]:.1f}% to {100 * paired[2]:.1f}%")
    if f"{v}_trace" in row:
      tr = row[f"{v}_trace"]
      extra += (f"\n{'':12s}traced: {tr['span']:.2f} ms a step, an op running {tr['busy']:.2f} "
                f"ms; op time {tr['ops']:.2f} ms, matmuls {tr['matmul']:.2f}"
                + (f", norm kernels {tr['norm']:.2f}" if "norm" in tr else "")
                + (f"; {tr['launches']:g} launches" if "launches" in tr else ""))
    if f"{v}_op_ms" in row:
      op = row[f"{v}_op_ms"]
      extra += (f"\n{'':12s}op time {op['ops']:.2f} ms: matmuls {op['matmul']:.2f}, other "
                f"{op['other']:.2f}" + (f" (norm kernels {op['norm']:.2f})" if "norm" in op else "")
                + (f"; {op['launches']:g} launches" if "launches" in op else ""))
      if row.get(f"{v}_saves_by_op_time") is not None:
        extra += f"; saves {100 * row[f'{v}_saves_by_op_time']:.1f}% of the norms' op time"
      if row.get(f"{v}_saves_by_op_time_vs_affine") is not None:
        extra += f" ({100 * row[f'{v}_saves_by_op_time_vs_affine']:.1f}% against affine)"
    print(f"  {v:9s} {row[f'{v}_ms']:9.2f} ms  ({row[f'{v}_custom_calls']} custom calls;"
          f" by round {' '.join(f'{t:.1f}' for t in row[f'{v}_rounds_ms'])}){extra}", flush=True)
  print(f"  norms: {row['norm_ms']:.2f} ms, {100 * row['norm_share']:.1f}% of flax's step"
        + (f"; {row['norm_ms_affine']:.2f} ms against affine" if "norm_ms_affine" in row else ""),
        flush=True)


def _info(args, settle_s, kept) -> dict:
  """The run's machine, versions and settings, for the JSON."""
  info = bench_lib.run_info()
  import flax
  info["flax"] = flax.__version__
  info["optimizer"] = _optimizer()[2]
  try:
    info["cpu_kernel_isa"] = _ffi.isa()
  except RuntimeError:  # no compiled extension (a GPU machine may run the sources alone)
    info["cpu_kernel_isa"] = None
  info["cpu_model"] = cpu_model()
  info["settle_s"] = settle_s
  info["keep_freed_memory"] = kept
  info["loadavg_start"] = os.getloadavg()
  return info


def model_names(spec: str) -> list[str]:
  """``--model``'s comma-separated names (of ``MODELS`` or ``MODEL_GROUPS``), in order, once each."""
  names = []
  for name in filter(None, spec.split(",")):
    if name not in MODELS and name not in MODEL_GROUPS:
      raise ValueError(f"--model: expected names of {sorted(MODELS)} or {sorted(MODEL_GROUPS)}, "
                       f"got {name!r}")
    names += [n for n in MODEL_GROUPS.get(name, (name,)) if n not in names]
  return names


def model_size(name: str, quick: bool, size: str | None, gpu: bool):
  """A model's size: "quick" with ``quick``; else ``size`` where the model has it; else the
  realistic ones' "full", the small ones' "gpu" on a GPU and "default" elsewhere."""
  sizes = MODELS[name][1]
  if quick:
    return "quick", sizes["quick"]
  key = size if size in sizes else ("full" if "full" in sizes else "gpu" if gpu else "default")
  return key, sizes[key]


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="tiny models, 1 round of 2 steps")
  parser.add_argument("--size", choices=tuple(UNET_SIZES), default=None,
                      help="the small models' size (default: 'gpu' on a GPU, else 'default'; "
                           "--quick: 'quick')")
  parser.add_argument("--model", default="all",
                      help=f"comma-separated models of {', '.join(MODELS)}; 'all' is "
                           f"{','.join(MODEL_GROUPS['all'])}, 'realistic' "
                           f"{','.join(REALISTIC)}")
  parser.add_argument("--norm", choices=("layer", "rms"), default="layer",
                      help="the transformers' norm: LayerNorm or RMSNorm")
  parser.add_argument("--dtypes", default="float32",
                      help="comma-separated computation dtypes, each a run of every model "
                           "(float32, bfloat16)")
  parser.add_argument("--variants", default="",
                      help="comma-separated variants to run (flax and identity always run; "
                           "default: all, less 'affine' on a GPU; the realistic models: "
                           "REALISTIC_VARIANTS); 'base@key=value' is variant base traced under "
                           "bench_lib.tuning(key=value) (split_variant)")
  parser.add_argument("--iters", type=int, default=25, help="timed steps per variant (over the rounds)")
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--settle-ms", type=float, default=None,
                      help=f"pause before each variant's samples (default {1e3 * SETTLE_S:g} on "
                           "the CPU, 0 on a GPU)")
  parser.add_argument("--profile-rounds", type=int, default=0,
                      help="also profile each variant's step in this many interleaved rounds of 2 "
                           "calls: its op time besides the matmuls, and the savings by it")
  parser.add_argument("--top-kernels", type=int, default=0,
                      help="with --profile-rounds or --trace-calls on a GPU: keep each step's N "
                           "largest kernels")
  parser.add_argument("--trace-calls", type=int, default=0,
                      help="after the timed rounds, one trace per model and dtype holding this "
                           "many calls of each traced variant (command buffers on)")
  parser.add_argument("--trace-variants", default="",
                      help="comma-separated variants to trace (default: those without _xla or @)")
  parser.add_argument("--trace-dir", default=None,
                      help="where the traces go (default: beside --out, <stem>_traces)")
  parser.add_argument("--compile-threads", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                      help="compile a model's variants on this many threads")
  parser.add_argument("--keep-freed-memory", action="store_true",
                      help="call jax_normgrad.keep_freed_memory() first (no fresh-page faults)")
  parser.add_argument("--out", default="benchmarks/results/models.json")
  args = parser.parse_args(argv)
  import jax_normgrad as jn
  names = model_names(args.model)
  kept = jn.keep_freed_memory() if args.keep_freed_memory else False
  gpu = jax.default_backend() == "gpu"
  iters, rounds = (2, 1) if args.quick else (args.iters, args.rounds)
  settle_s = (0.0 if gpu else SETTLE_S) if args.settle_ms is None else args.settle_ms / 1e3
  wanted = set(filter(None, args.variants.split(",")))

  def chosen(name, variants):
    if not wanted and name in REALISTIC:
      variants, pick = REALISTIC_VARIANTS[MODELS[name][0]], set(variants)
      return [v for v in variants if v in pick]
    tuned = [v for v in args.variants.split(",") if "@" in v and split_variant(v)[0] in variants]
    return [v for v in variants if v in ("flax", "identity") or (
        v in wanted if wanted else not (gpu and v == "affine"))] + tuned

  info = _info(args, settle_s, kept)
  print(json.dumps(info))
  rows = []
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  trace_dir = pathlib.Path(args.trace_dir or out.with_name(out.stem + "_traces"))
  kw = dict(iters=iters, rounds=rounds, settle_s=settle_s, profile_rounds=args.profile_rounds,
            compile_threads=args.compile_threads, top_kernels=args.top_kernels,
            trace_calls=args.trace_calls,
            trace_variants=[v for v in args.trace_variants.split(",") if v] or None)
  for dtype in args.dtypes.split(","):
    dt = jnp.dtype(dtype)
    for name in names:
      kind, _ = MODELS[name]
      size_name, size = model_size(name, args.quick, args.size, gpu)
      trace_path = trace_dir / f"{name}_{size_name}_{dt.name}.trace.json.gz"
      if kind == "unet":
        setups = {v: unet_setup(split_variant(v)[0], size, dt)
                  for v in chosen(name, unet_variants())}
        b, side, channels, blocks, groups, cin = size
        row = measure_model(f"{name} {b}x{side}x{side}x{cin}, channels "
                            f"{'/'.join(map(str, channels))}, {blocks} blocks per level, "
                            f"{groups} groups, {dt.name}", setups, trace_path=trace_path, **kw)
        row["norm_shapes"] = unet_norm_shapes(size)
      else:
        setups = {v: transformer_setup(split_variant(v)[0], args.norm, size, dt)
                  for v in chosen(name, TRANSFORMER_VARIANTS)}
        b, tokens, width, heads, blocks, causal = size
        row = measure_model(f"{name} {b}x{tokens}x{width}, {heads} heads, {blocks} blocks"
                            f"{', causal' if causal else ''}, {args.norm} norm, {dt.name}",
                            setups, trace_path=trace_path, **kw)
      row.update(name=name, size=size_name, dtype=dt.name)
      rows.append(row)
      print_row(row)
      out.write_text(json.dumps({"info": info, "rows": rows}, indent=1))  # kept if a later one fails
  info["loadavg_end"] = os.getloadavg()
  out.write_text(json.dumps({"info": info, "rows": rows}, indent=1))
  print(f"load average at the start {info['loadavg_start']}, at the end {info['loadavg_end']}")
  print(f"wrote {out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
