"""GPU benchmark: jax_normgrad's kernels against XLA, PyTorch, Liger-Kernel and tokamax, over the copy roof.

Run from the repository root on a machine with a GPU, after installing the
package (on the project's GPU machine: ``pip install --no-build-isolation
--no-deps .``, the CPU extension being optional there):

    python benchmarks/bench_gpu.py                        # every row, JSON to benchmarks/recorded/
    python benchmarks/bench_gpu.py --out gpu.json --rounds 5 --iters 40
    python benchmarks/bench_gpu.py --only ln,rms          # the rows whose name has "ln" or "rms"
    python benchmarks/bench_gpu.py --no-peers             # without PyTorch, Liger-Kernel, tokamax
    pip install --no-deps --target /tmp/site .whl/*.whl   # Liger-Kernel, tokamax and its needs
    PYTHONPATH=/tmp/site python benchmarks/bench_gpu.py   # (torch and triton installed)
    python benchmarks/bench_gpu.py --gpu-backend mosaic_gpu   # the Mosaic GPU kernels (sm_90+)
    python benchmarks/bench_gpu.py --residual             # add_layer_norm / add_rms_norm, pre-norm stack

For each row (LayerNorm and RMSNorm 32768x1024, 16384x4096, 4096x16384 in
bfloat16 and float32; GroupNorm 8x256x64x64 with 32 groups, NCHW and NHWC) it
measures, in interleaved rounds within one process:

* the forward with statistics and the backward of this package
  (``layer_norm_fwd`` / ``layer_norm_backward``, the RMSNorm and GroupNorm
  equivalents: the kernels alone) and of XLA (the jitted jnp layer; its
  autodiff pullback with the residuals computed once);
* ``jax.grad`` of each layer (forward + backward, as in training);
* where it imports (Python 3.12+, jax 0.11.1+; ``benchmarks/gpu_wheels.sh`` fetches it
  and what it needs that the GPU machine lacks), tokamax's ``layer_norm``
  (the JAX peer: its Triton kernels through jax-triton, ``implementation=
  "triton"``; on a CPU its XLA code) for the LayerNorm and RMSNorm rows
  (it has no GroupNorm): the forward as in training, ``jax.vjp`` of the
  layer returning y and the statistics it keeps, and the backward alone
  (the pullback of residuals computed once, as XLA's). The row's
  ``tokamax_kernel_calls`` counts the Triton calls in its forward's lowered
  module: 0 on a GPU means it ran XLA's code, not its kernels (said on
  stderr);
* where they import, PyTorch's native layers (``torch.nn.functional.layer_norm``
  / ``rms_norm`` / ``group_norm``) and Liger-Kernel's (``LigerLayerNormFunction``,
  ``LigerRMSNormFunction`` with its default ``casting_mode="llama"`` and
  ``in_place=False``, ``LigerGroupNormFunction``) on the same values, shapes
  and dtypes, weight and bias as in the JAX rows: the forward on inputs that
  require grad (as in training: the statistics kept), the backward alone
  (``torch.autograd.grad(y, (x, w, b), dy, retain_graph=True)``). Torch runs
  on CUDA (on a CPU-only machine, on the CPU), Liger on CUDA only; without
  them their columns are absent. Channels-last GroupNorm gets the NHWC bytes
  as a channels_last NCHW tensor (Liger copies it to NCHW inside its call);
* the copy roof: copies of x's bytes (read once, written once), timed as the
  kernels, the roof being the fastest: ``jnp.copy`` (XLA's device-to-device
  copy), two halves of x copied in one jit, XLA's elementwise ``-x``, a
  Pallas copy kernel (Triton; on the CPU in interpret mode) with the block
  size and warp count of ``PALLAS_COPY_CONFIGS`` that was fastest at the
  size (tried once per size and dtype, a few samples each), and a torch
  ``clone`` where torch runs.

Every figure is a median of ``--iters`` samples after warm-up; each sample is
the mean time of calls issued back to back for about ``--batch-ms`` and
blocked once (``_bench.call_times_ms``; torch's calls: one
``torch.cuda.synchronize``): one call blocked alone would time its
dispatch and synchronisation, tens of microseconds, with a kernel that takes
about as long at these sizes. Bandwidth figures count the bytes a kernel must
move: forward x read and y written, backward x and dy read and dx written
(the statistics and parameters are small); ``*_of_roof`` is that bandwidth
over the roof's (read + write) in the same run. The JSON holds every row
(each roof candidate's GB/s, each Pallas copy configuration's, the
fastest of the four per pass, the peers' largest relative difference from
this package's y and dx over the first ``CHECK_ELEMENTS``), the machine
(device kind, SM count), the versions (torch's and Liger's, with triton's,
where they ran: ``peers``) and the command. On an H100
(2026-11-27) the 16 LayerNorm, RMSNorm and GroupNorm rows then listed took 90 s, peers included; the run
prints its time, ``--no-peers`` leaves out torch and Liger.

On a machine with no GPU the script runs on the CPU (``--smoke`` uses tiny
shapes: ``tests/test_benchmarks.py`` runs it so), so that the first run on a
GPU measures instead of debugging the script.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import importlib.metadata
import json
import os
import pathlib
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jax_normgrad import _bench, _settings

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_lib  # noqa: E402  (the sibling module: the residual and stack workloads)

# (kind, shape, dtype); GroupNorm shapes are (n, c, h, w, groups).
ROWS = [
    *[(kind, shape, dtype)
      for dtype in (jnp.bfloat16, jnp.float32)
      for kind in ("ln", "rms")
      for shape in ((32768, 1024), (16384, 4096), (4096, 16384))],
    ("gn", (8, 256, 64, 64, 32), jnp.float32),
    ("gn_nhwc", (8, 256, 64, 64, 32), jnp.float32),
    ("gn", (8, 256, 64, 64, 32), jnp.bfloat16),
    ("gn_nhwc", (8, 256, 64, 64, 32), jnp.bfloat16),
    # A UNet's largest GroupNorm (benchmarks/bench_models.py at batch 32): 32 groups of 2 channels.
    ("gn_nhwc", (32, 64, 32, 32, 32), jnp.float32),
    ("gn_nhwc", (32, 64, 32, 32, 32), jnp.bfloat16),
    # The SD-class UNet's GroupNorms (bench_models.py --model sd_unet: batch 8, a 64x64 latent,
    # 320/640/1280 channels, 32 groups), whose kernels cost more than XLA's norms in that step.
    *[("gn_nhwc", shape, dtype) for dtype in (jnp.bfloat16, jnp.float32)
      for shape in ((8, 320, 64, 64, 32), (8, 640, 32, 32, 32), (8, 1280, 16, 16, 32))],
]
# The same kinds at tiny sizes, odd widths included (CPU smoke test).
SMOKE_ROWS = [("ln", (24, 40), jnp.float32), ("rms", (16, 72), jnp.bfloat16),
              ("gn", (2, 6, 3, 5, 3), jnp.float32), ("gn_nhwc", (2, 6, 3, 5, 3), jnp.bfloat16)]
VARIANTS = ("fwd", "bwd", "grad")
#: Whose forward and backward are timed: this package, XLA, PyTorch, Liger-Kernel, tokamax.
WHO = ("ours", "xla", "torch", "liger", "tokamax")
#: The Pallas copy's (bytes per program, warps) tried at each size: 64 or 128 bytes a thread.
PALLAS_COPY_CONFIGS = ((8192, 4), (16384, 4), (32768, 8), (65536, 16))
SMOKE_PALLAS_COPY_CONFIGS = ((256, 4), (1024, 4))  # 1024: a masked last block in every smoke row
# --residual: add_layer_norm / add_rms_norm forward + backward against this package's
# layer_norm(x + residual) and XLA's autodiff (bench_lib.measure_residual), then a pre-norm MLP
# stack's training step with and without the fused form (bench_lib.measure_stack).
# (kind, shape, dtype, residual stream dtype; None: dtype's).
RESIDUAL_ROWS = [(kind, shape, dtype, stream)
                 for dtype, stream in ((jnp.bfloat16, None), (jnp.float32, None),
                                       (jnp.bfloat16, jnp.float32))
                 for kind in ("ln", "rms") for shape in ((32768, 1024), (16384, 4096))]
SMOKE_RESIDUAL_ROWS = [("ln", (24, 40), jnp.float32, None), ("rms", (16, 72), jnp.bfloat16, None),
                       ("rms", (16, 72), jnp.bfloat16, jnp.float32)]
STACK = dict(layers=4, hidden=4096, ffn=1024, tokens=16384)
SMOKE_STACK = dict(layers=2, hidden=64, ffn=32, tokens=32)
#: A peer's y and dx are compared with this package's on their first this many elements.
CHECK_ELEMENTS = 1 << 20


def workload(kind: str, shape: tuple, dtype) -> _bench.Workload:
  if kind == "ln":
    return _bench.layer_norm_workload(*shape, dtype)
  if kind == "rms":
    return _bench.rms_norm_workload(*shape, dtype)
  return _bench.group_norm_workload(*shape, dtype, channels_last=kind == "gn_nhwc")


def _error(e: BaseException) -> str:
  return f"{type(e).__name__}: {e}"[:400]


# ----------------------------------------------------------------------------
# The copy roof: copies of x's bytes, the fastest of them the roof.


def _copy(x):
  # A jitted function cannot return its (undonated) argument's buffer, so XLA copies x
  # into a new one: one read and one write of x.
  return jnp.copy(x)


def _two_copies(a, b):
  return jnp.copy(a), jnp.copy(b)


def _copy_kernel(x_ref, y_ref, *, block: int, n: int):
  idx = pl.program_id(0) * block + lax.broadcasted_iota(jnp.int32, (block,), 0)
  mask = None if n % block == 0 else idx < n
  pltriton.store(y_ref.at[idx], pltriton.load(x_ref.at[idx], mask=mask), mask=mask)


def pallas_copy(x, *, block_bytes: int, num_warps: int, interpret: bool = False):
  """A copy of ``x`` by a Pallas Triton kernel: one flat block of ``block_bytes`` a program.

  The norms' kernels load tiles of whole rows; x being contiguous, a block
  of rows is a flat block of the same bytes. Where the size is not a
  multiple of the block, the last block is masked.
  """
  n, block = x.size, block_bytes // x.dtype.itemsize
  if block < 1 or block & (block - 1):
    raise ValueError(f"block_bytes: {block_bytes} is not a power of two of {x.dtype} elements")
  if n + block >= 2 ** 31:
    raise ValueError(f"x: {n} elements, past this copy's int32 indices")
  y = pl.pallas_call(
      functools.partial(_copy_kernel, block=block, n=n),
      out_shape=jax.ShapeDtypeStruct((n,), x.dtype), grid=(pl.cdiv(n, block),),
      interpret=interpret, name="bench_copy",
      compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1))(x.reshape(-1))
  return y.reshape(x.shape)


def tune_pallas_copy(x, configs, *, interpret: bool, batch_ms: float) -> dict:
  """The Pallas copy of x at each ``(block bytes, warps)``, a few samples each.

  Returns ``{"config": the fastest's label, "fn": its jitted function,
  "tried_gbs": {label: GB/s, or the error it raised}}``; ``fn`` is None
  where none ran. The fastest is checked to copy x exactly.
  """
  tried, best, best_gbs = {}, None, 0.0
  for block_bytes, warps in configs:
    label = f"{block_bytes} B, {warps} warps"
    fn = jax.jit(functools.partial(pallas_copy, block_bytes=block_bytes, num_warps=warps,
                                   interpret=interpret))
    try:
      ms = float(np.median(_bench.call_times_ms(fn, x, warmup=2, iters=3, batch_ms=batch_ms)))
    except Exception as e:  # a configuration Triton refuses (registers, shared memory)
      tried[label] = _error(e)
      continue
    tried[label] = 2 * x.nbytes / (ms * 1e-3) / 1e9
    if tried[label] > best_gbs:
      best, best_gbs = (label, fn), tried[label]
  if best is not None and not bool(jnp.array_equal(best[1](x), x)):
    raise RuntimeError(f"the Pallas copy ({best[0]}) did not copy x")
  return {"config": best and best[0], "fn": best and best[1], "tried_gbs": tried}


def roof_candidates(x, *, pallas: dict | None) -> dict:
  """``{name: (fn, args, block)}``: the JAX copies of x's bytes (``block`` None: JAX's)."""
  flat = x.reshape(-1)
  half = flat.size // 2
  cands = {"jnp_copy": (jax.jit(_copy), (x,), None),
           "two_copies": (jax.jit(_two_copies), (flat[:half], flat[half:]), None),
           "xla_neg": (jax.jit(jnp.negative), (x,), None)}
  if pallas is not None and pallas["fn"] is not None:
    cands["pallas_copy"] = (pallas["fn"], (x,), None)
  return cands


# ----------------------------------------------------------------------------
# PyTorch's and Liger-Kernel's layers on the same data.


class Peers:
  """PyTorch (and on CUDA Liger-Kernel), where importable, on the platform JAX runs on.

  ``info`` says what runs (versions, device) or why not; a layer or copy of
  theirs is a ``(fn, args, block)`` as JAX's, ``block`` a torch synchronize.
  """

  def __init__(self, platform: str, enabled: bool = True):
    self.torch, self.liger, self.device = None, None, None
    self.info = {"torch": None, "liger_kernel": None}
    if not enabled:
      self.info["absent"] = "--no-peers"
      return
    try:
      import torch
    except ImportError as e:
      self.info["absent"] = f"torch: {_error(e)}"
      return
    if platform == "gpu" and torch.cuda.is_available():
      self.device = "cuda"
    elif platform == "cpu":
      self.device = "cpu"
    else:
      self.info["absent"] = f"torch {torch.__version__}: no device beside JAX's {platform}"
      return
    self.torch = torch
    self.info["torch"] = {"version": torch.__version__, "device": self.device,
                          "cuda": torch.version.cuda,
                          "device_name": (torch.cuda.get_device_name()
                                          if self.device == "cuda" else None)}
    if self.device != "cuda":
      self.info["absent"] = "liger_kernel: needs CUDA"
      return
    try:
      import triton
      from liger_kernel.ops import (LigerGroupNormFunction, LigerLayerNormFunction,
                                    LigerRMSNormFunction)
    except Exception as e:  # ImportError, or what its import raises without a usable Triton
      self.info["absent"] = f"liger_kernel: {_error(e)}"
      return
    self.liger = {"ln": LigerLayerNormFunction, "rms": LigerRMSNormFunction,
                  "gn": LigerGroupNormFunction}
    try:
      version = importlib.metadata.version("liger_kernel")
    except importlib.metadata.PackageNotFoundError:
      version = "?"
    self.info["liger_kernel"] = {"version": version, "triton": triton.__version__}

  def versions(self) -> dict:
    return {k: v["version"] for k, v in (("torch", self.info["torch"]),
                                        ("liger_kernel", self.info["liger_kernel"])) if v}

  def sync(self, _results=None) -> None:
    if self.device == "cuda":
      self.torch.cuda.synchronize()

  def tensor(self, a):
    """A JAX array's values as a torch tensor of its dtype on ``device`` (through float32)."""
    dtype = getattr(self.torch, jnp.dtype(a.dtype).name)
    host = np.array(jnp.asarray(a).astype(jnp.float32))  # a writable copy for torch
    return self.torch.from_numpy(host).to(device=self.device, dtype=dtype)

  def layers(self, kind: str, shape: tuple) -> dict:
    """``{who: f(x, *params)}``: torch's and Liger's layer of the row, as the JAX rows set it."""
    F = self.torch.nn.functional
    if kind == "ln":
      width = shape[-1]
      out = {"torch": lambda x, w, b: F.layer_norm(x, (width,), w, b, 1e-5)}
      lig = lambda x, w, b: self.liger["ln"].apply(x, w, b, 1e-5)
    elif kind == "rms":
      width = shape[-1]
      out = {"torch": lambda x, w: F.rms_norm(x, (width,), w, 1e-6)}
      # Liger's defaults (offset 0, "llama" casting) but not in place: dx written over dy
      # would change dy between calls.
      lig = lambda x, w: self.liger["rms"].apply(x, w, 1e-6, 0.0, "llama", False)
    else:
      channels, groups = shape[1], shape[4]
      out = {"torch": lambda x, w, b: F.group_norm(x, groups, w, b, 1e-5)}
      lig = lambda x, w, b: self.liger["gn"].apply(x, w, b, channels, groups, 1e-5)
    if self.liger is not None:
      out["liger"] = lig
    return out

  def variants(self, kind: str, shape: tuple, wl: _bench.Workload) -> tuple[dict, dict, dict]:
    """The row's torch and Liger forward and backward, and torch's clone of x.

    Returns ``({name: (fn, args, block)}, {name: first elements of its y or
    dx, float32, in x's layout}, {name: error})`` with names ``fwd_torch``,
    ``bwd_liger``, ... and ``roof_torch_clone``.
    """
    torch = self.torch
    xj, *pj = wl.ours_fwd[1]
    x, dy = self.tensor(xj), self.tensor(wl.ours_bwd[1][0])
    params = [self.tensor(p) for p in pj]
    nhwc = kind == "gn_nhwc"
    # The NHWC bytes as the channels_last NCHW tensor torch's layers take.
    view = (lambda t: t.permute(0, 3, 1, 2)) if nhwc else (lambda t: t)
    unview = (lambda t: t.permute(0, 2, 3, 1)) if nhwc else (lambda t: t)
    m = min(x.numel(), CHECK_ELEMENTS)
    first = lambda t: t.detach().reshape(-1)[:m].float().cpu().numpy()
    out = {"roof_torch_clone": (torch.clone, (x,), self.sync)}
    outputs, errors = {}, {}
    for who, f in self.layers(kind.removesuffix("_nhwc"), shape).items():
      try:
        leaves = [t.detach().clone().requires_grad_() for t in (x, *params)]
        fwd = lambda f=f, leaves=leaves: f(view(leaves[0]), *leaves[1:])
        y = fwd()
        grad = lambda y=y, leaves=leaves: torch.autograd.grad(y, leaves, view(dy),
                                                              retain_graph=True)
        outputs[f"fwd_{who}"], outputs[f"bwd_{who}"] = first(unview(y)), first(grad()[0])
        out[f"fwd_{who}"] = (fwd, (), self.sync)
        out[f"bwd_{who}"] = (grad, (), self.sync)
      except Exception as e:  # an op this torch lacks, a Triton launch that fails
        errors[f"fwd_{who}"] = errors[f"bwd_{who}"] = _error(e)
    return out, outputs, errors

  def release(self) -> None:
    """After a row: its tensors freed, torch's cached blocks returned to the device."""
    gc.collect()
    if self.device == "cuda":
      self.torch.cuda.empty_cache()


# ----------------------------------------------------------------------------
# tokamax's normalization on the same data.


class Tokamax:
  """tokamax's ``layer_norm`` (LayerNorm; RMSNorm with ``subtract_mean=False``) where it imports.

  ``module``: a stand-in for the package (tests); else ``import tokamax``.
  ``info`` says what runs (version, implementation) or why not. On a GPU its
  Triton implementation, elsewhere its XLA one (the column then times no
  kernel of its own).
  """

  def __init__(self, platform: str, enabled: bool = True, module=None):
    self.tokamax = None
    self.info = {"tokamax": None}
    if not enabled:
      self.info["absent"] = "--no-peers"
      return
    if module is None:
      try:
        import tokamax as module  # pylint: disable=g-import-not-at-top
      except Exception as e:  # ImportError, or what its import raises with another jax
        self.info["absent"] = f"tokamax: {_error(e)}"
        return
    self.tokamax = module
    self.implementation = "triton" if platform == "gpu" else "xla"
    target = getattr(sys.modules.get("jax_triton"), "CUSTOM_CALL_TARGET_NAME", None)
    self.kernel_target = target or "triton_kernel_call"
    self.info["tokamax"] = {"version": getattr(module, "__version__", "?"),
                            "implementation": self.implementation}

  def layer(self, kind: str):
    """The row's layer ``f(x, *params)``, as the JAX rows set it (eps 1e-5 and 1e-6)."""
    impl, norm = self.implementation, self.tokamax.layer_norm
    if kind == "ln":
      return lambda x, w, b: norm(x, w, b, epsilon=1e-5, implementation=impl)
    return lambda x, w: norm(x, w, None, epsilon=1e-6, subtract_mean=False, implementation=impl)

  def variants(self, kind: str, wl: _bench.Workload) -> tuple[dict, dict, dict]:
    """As :meth:`Peers.variants`: ``fwd_tokamax`` and ``bwd_tokamax``, their first elements of
    y and dx, and their errors (a GroupNorm row: none of the three)."""
    if kind not in ("ln", "rms"):
      return {}, {}, {}
    x, *params = wl.xla_fwd[1]
    dy = wl.ours_bwd[1][0]
    stats = x.shape[:-1] + (1,)

    def forward(*args):  # y and the statistics kept (returning x or y again would copy them)
      y, vjp = jax.vjp(f, *args)
      return y, [r for r in jax.tree.leaves(vjp) if r.shape == stats]

    try:
      f = self.layer(kind)
      fwd = jax.jit(forward)
      lowered = fwd.lower(x, *params).as_text()
      self.kernel_calls = lowered.count(f"custom_call @{self.kernel_target}")
      if self.implementation == "triton" and not self.kernel_calls:
        print(f"note: tokamax's {kind} forward holds no {self.kernel_target} call: its column "
              "times XLA's code", file=sys.stderr)
      bwd = _bench._pure_backward(f, (x, *params), dy)  # pylint: disable=protected-access
      m = min(x.size, CHECK_ELEMENTS)
      first = lambda a: np.asarray(a.reshape(-1)[:m].astype(jnp.float32))
      outputs = {"fwd_tokamax": first(fwd(x, *params)[0]), "bwd_tokamax": first(bwd[0](*bwd[1])[0])}
    except Exception as e:  # a shape or dtype it refuses, a kernel that fails
      return {}, {}, {"fwd_tokamax": _error(e), "bwd_tokamax": _error(e)}
    return ({"fwd_tokamax": (fwd, (x, *params), None), "bwd_tokamax": (*bwd, None)}, outputs, {})


# ----------------------------------------------------------------------------
# A row.


def measure(kind: str, shape: tuple, dtype, *, iters: int, rounds: int, batch_ms: float = 0.0,
            peers: Peers | None = None, pallas_configs=PALLAS_COPY_CONFIGS,
            tuned: dict | None = None, tokamax: Tokamax | None = None) -> dict:
  """One row: medians over ``rounds`` interleaved rounds of ``iters / rounds`` samples each.

  ``tuned`` caches the Pallas copy's tuning by size and dtype across rows.
  The roof candidates and the peers that fail are left out, their errors
  in ``row["errors"]``; this package's and XLA's failures raise.
  """
  wl = workload(kind, shape, dtype)
  x = wl.xla_fwd[1][0]
  platform = jax.default_backend()
  errors = {}
  pallas = None
  if platform in ("gpu", "cpu"):
    key = (x.size, jnp.dtype(x.dtype).name)
    tuned = {} if tuned is None else tuned
    if key not in tuned:
      try:
        tuned[key] = tune_pallas_copy(x, pallas_configs, interpret=platform == "cpu",
                                      batch_ms=batch_ms)
      except Exception as e:
        tuned[key] = {"config": None, "fn": None, "tried_gbs": {}, "error": _error(e)}
    pallas = tuned[key]
    if pallas["fn"] is None:
      errors["roof_pallas_copy"] = pallas.get("error", "no configuration ran")
  variants = {f"roof_{k}": v for k, v in roof_candidates(x, pallas=pallas).items()}
  required = {"roof_jnp_copy"}
  for v in VARIANTS:
    for who in ("ours", "xla"):
      variants[f"{v}_{who}"] = (*getattr(wl, f"{who}_{v}"), None)
      required.add(f"{v}_{who}")
  outputs = {}
  if peers is not None and peers.torch is not None:
    more, outputs, peer_errors = peers.variants(kind, shape, wl)
    variants.update(more)
    errors.update(peer_errors)
  if tokamax is not None and tokamax.tokamax is not None:
    more, tok_outputs, tok_errors = tokamax.variants(kind, wl)
    variants.update(more)
    outputs.update(tok_outputs)
    errors.update(tok_errors)
  per_round = max(1, -(-iters // rounds))
  samples: dict[str, list[float]] = {}
  for r in range(rounds):
    warmup = 3 if r == 0 else 1
    for name, (fn, args, block) in list(variants.items()):
      try:
        samples.setdefault(name, []).extend(_bench.call_times_ms(
            fn, *args, warmup=warmup, iters=per_round, batch_ms=batch_ms, block=block))
      except Exception as e:
        if name in required:
          raise
        errors[name] = _error(e)
        del variants[name]
        samples.pop(name, None)
  row = {"workload": wl.name, "kind": kind, "shape": list(shape), "dtype": jnp.dtype(dtype).name,
         "rounds": rounds, "calls": per_round * rounds}
  ms = {name: float(np.median(times)) for name, times in samples.items()}
  copy_bytes = 2 * x.size * x.dtype.itemsize
  row["roof"] = {name.removeprefix("roof_"): {"ms": t, "gbs": copy_bytes / (t * 1e-3) / 1e9}
                 for name, t in ms.items() if name.startswith("roof_")}
  row["roof_by"] = max(row["roof"], key=lambda k: row["roof"][k]["gbs"])
  row["roof_gbs"] = row["roof"][row["roof_by"]]["gbs"]
  if pallas is not None:
    row["pallas_copy"] = {"config": pallas["config"], "tried_gbs": pallas["tried_gbs"]}
  nbytes = {"fwd": wl.nbytes_fwd, "bwd": wl.nbytes_bwd,
            "grad": wl.nbytes_fwd + wl.nbytes_bwd}  # forward, then backward
  for v in VARIANTS:
    for who in WHO:
      if f"{v}_{who}" not in ms:
        continue
      row[f"{v}_{who}_ms"] = ms[f"{v}_{who}"]
      row[f"{v}_{who}_gbs"] = nbytes[v] / (row[f"{v}_{who}_ms"] * 1e-3) / 1e9
      row[f"{v}_{who}_of_roof"] = row[f"{v}_{who}_gbs"] / row["roof_gbs"]
    row[f"{v}_vs_xla"] = row[f"{v}_xla_ms"] / row[f"{v}_ours_ms"]
  for v in ("fwd", "bwd"):
    timed = {who: row[f"{v}_{who}_ms"] for who in WHO if f"{v}_{who}_ms" in row}
    row[f"{v}_fastest"] = min(timed, key=timed.get)
    # The best other's time over ours: > 1, ours ahead of all.
    row[f"{v}_ours_vs_best_other"] = min(t for w, t in timed.items() if w != "ours") / timed["ours"]
  if "fwd_tokamax" in ms:
    row["tokamax_kernel_calls"] = tokamax.kernel_calls
  if outputs:  # the peers computed the same function on the same inputs
    m = min(x.size, CHECK_ELEMENTS)
    ours = {"fwd": wl.ours_fwd[0](*wl.ours_fwd[1])[0], "bwd": wl.ours_bwd[0](*wl.ours_bwd[1])[0]}
    for name, got in outputs.items():
      want = np.asarray(ours[name[:3]].reshape(-1)[:m].astype(jnp.float32))
      row[f"{name}_max_rel_err"] = _bench.max_rel_err(got, want)
  if errors:
    row["errors"] = errors
  return row


# ----------------------------------------------------------------------------
# Printing.


def _cell(r: dict, v: str, who: str) -> str:
  if f"{v}_{who}_ms" not in r:
    return "-"
  return (f"{r[f'{v}_{who}_ms']:.3f} {r[f'{v}_{who}_gbs'] / 1e3:.2f} "
          f"{r[f'{v}_{who}_of_roof']:.0%}")


def print_table(rows: list[dict], out=sys.stdout) -> None:
  """A table per pass: each one's ms, TB/s and share of the roof; the fastest; jax.grad."""
  names = {"ours": "ours", "xla": "XLA", "torch": "torch", "liger": "Liger",
           "tokamax": "tokamax"}
  for v, title in (("fwd", "forward"), ("bwd", "backward")):
    print(f"\n{title}: ms, TB/s, share of the roof (the fastest copy of x's bytes); fastest "
          "(the best other's time over ours: > 1, ours ahead)", file=out)
    head = ("| row | roof TB/s | ours | XLA | torch | Liger | tokamax | fastest |"
            + (" jax.grad ours / XLA ms |" if v == "bwd" else ""))
    print(head, file=out)
    print("|" + " --- |" * (head.count("|") - 1), file=out)
    for r in rows:
      line = (f"| {r['workload']} | {r['roof_gbs'] / 1e3:.2f} {r['roof_by']} | "
              + " | ".join(_cell(r, v, who) for who in WHO)
              + f" | {names[r[f'{v}_fastest']]} ({r[f'{v}_ours_vs_best_other']:.2f}x) |")
      if v == "bwd":
        line += f" {r['grad_ours_ms']:.3f} / {r['grad_xla_ms']:.3f} |"
      print(line, file=out)


def progress_line(row: dict, seconds: float) -> str:
  roof = ", ".join(f"{k} {c['gbs'] / 1e3:.2f}" for k, c in row["roof"].items())
  pallas = (row.get("pallas_copy") or {}).get("config")
  parts = [f"{row['workload']}: roof {row['roof_gbs'] / 1e3:.2f} TB/s ({roof} TB/s"
           + (f"; Pallas {pallas}" if pallas else "") + ")"]
  for v in ("fwd", "bwd"):
    parts.append(f"{v} ours {row[f'{v}_ours_ms']:.3f} ms ({row[f'{v}_ours_of_roof']:.0%} of roof, "
                 f"{row[f'{v}_vs_xla']:.2f}x XLA, fastest {row[f'{v}_fastest']})")
  if row.get("errors"):
    parts.append("errors: " + "; ".join(f"{k}: {e}" for k, e in row["errors"].items()))
  return ", ".join(parts) + f" [{seconds:.1f} s]"


def _driver() -> str | None:
  """The NVIDIA driver's version, from nvidia-smi where there is one."""
  try:
    run = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=30)
  except (OSError, subprocess.SubprocessError):
    return None
  return run.stdout.strip().splitlines()[0] if run.returncode == 0 and run.stdout.strip() else None


def machine() -> dict:
  dev = jax.devices()[0]
  return {"platform": dev.platform, "device_kind": getattr(dev, "device_kind", "?"),
          "core_count": getattr(dev, "core_count", None), "devices": len(jax.devices()),
          "driver": _driver() if dev.platform == "gpu" else None}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", type=pathlib.Path, help="JSON path (default: benchmarks/recorded/"
                      "gpu_<date>_<device>.json)")
  parser.add_argument("--iters", type=int, default=24,
                      help="timed samples per variant (all rounds)")
  parser.add_argument("--rounds", type=int, default=4)
  parser.add_argument("--batch-ms", type=float, default=2.0,
                      help="each sample: calls issued back to back for about this long, blocked "
                      "once (0: each call blocked and timed alone)")
  parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU smoke test)")
  parser.add_argument("--only", default="",
                      help="run the rows whose name (e.g. 'ln 32768x1024 bfloat16') contains "
                           "this text, or one of these comma-separated texts")
  parser.add_argument("--gpu-backend", choices=_settings.CHOICES[_settings.GPU_BACKEND_ENV],
                      help="the Pallas GPU backend of the package's kernels (sets "
                      f"{_settings.GPU_BACKEND_ENV} before anything is traced; default: the "
                      "variable's value, else triton; what Mosaic GPU cannot run, such as "
                      "channels-last GroupNorm past ~25K channels, Triton runs with a "
                      "FallbackWarning)")
  parser.add_argument("--residual", action="store_true",
                      help="the fused residual form's rows and the pre-norm stack's step instead")
  parser.add_argument("--no-peers", action="store_true",
                      help="without PyTorch's, Liger-Kernel's and tokamax's columns (and torch's "
                      "clone)")
  args = parser.parse_args(argv)
  if args.gpu_backend:
    os.environ[_settings.GPU_BACKEND_ENV] = args.gpu_backend
  args.gpu_backend = _settings.current().gpu_backend or "triton"
  if jax.default_backend() != "gpu" and not args.smoke:
    print(f"note: no GPU ({jax.default_backend()}); these are not GPU figures", file=sys.stderr)
  info = machine()
  date = datetime.date.today().isoformat()
  out = args.out or (pathlib.Path(__file__).parent / "recorded" /
                     f"gpu_{date}_{info['device_kind'].replace(' ', '_')}"
                     f"{'' if args.gpu_backend == 'triton' else '_' + args.gpu_backend}"
                     f"{'_residual' if args.residual else ''}.json")
  out.parent.mkdir(parents=True, exist_ok=True)
  rows, versions = [], _bench.versions()
  peers = None if args.residual else Peers(jax.default_backend(), enabled=not args.no_peers)
  tok = None if args.residual else Tokamax(jax.default_backend(), enabled=not args.no_peers)
  extra = {"commit": bench_lib.commit(), "gpu_backend_run": bench_lib.gpu_backend()}
  if peers is not None:
    versions.update(peers.versions())
    if tok.info["tokamax"]:
      versions["tokamax"] = tok.info["tokamax"]["version"]
    extra["peers"] = {**peers.info, "tokamax": tok.info["tokamax"]}
    if "absent" in tok.info:
      extra["peers"]["tokamax_absent"] = tok.info["absent"]
    print(f"peers: {json.dumps(extra['peers'])}", file=sys.stderr)
    if tok.tokamax is None:
      print(f"note: no tokamax column ({tok.info['absent']})", file=sys.stderr)

  def save():  # after every row: a run cut short keeps what it measured
    out.write_text(json.dumps({"date": date, "machine": info, "versions": versions,
                               "command": " ".join(sys.argv), "gpu_backend": args.gpu_backend,
                               "batch_ms": args.batch_ms, **extra, "rows": rows}, indent=1))

  if args.residual:
    for kind, shape, dtype, stream in (SMOKE_RESIDUAL_ROWS if args.smoke else RESIDUAL_ROWS):
      rows.append(bench_lib.measure_residual(kind, shape, dtype, args.iters, args.rounds,
                                          batch_ms=args.batch_ms, residual_dtype=stream))
      bench_lib.print_residual_rows(rows[-1:])
      save()
    for dtype, stream in bench_lib.STACK_ROWS:
      rows.append(bench_lib.measure_stack(dtype, args.iters, args.rounds, residual_dtype=stream,
                                       **(SMOKE_STACK if args.smoke else STACK)))
      bench_lib.print_residual_rows(rows[-1:])
      save()
  tuned = {}  # the Pallas copy's configuration by size and dtype
  start = time.perf_counter()
  for kind, shape, dtype in ([] if args.residual else SMOKE_ROWS if args.smoke else ROWS):
    name = f"{kind} {'x'.join(map(str, shape))} {jnp.dtype(dtype).name}"
    if args.only and not any(o in name for o in args.only.split(",") if o):
      continue
    t0 = time.perf_counter()
    row = measure(kind, shape, dtype, iters=args.iters, rounds=args.rounds,
                  batch_ms=args.batch_ms, peers=peers, tuned=tuned, tokamax=tok,
                  pallas_configs=SMOKE_PALLAS_COPY_CONFIGS if args.smoke else PALLAS_COPY_CONFIGS)
    peers.release()
    rows.append(row)
    save()
    print(progress_line(row, time.perf_counter() - t0), file=sys.stderr)
  if not args.residual:
    print_table(rows)
    print(f"{len(rows)} rows in {time.perf_counter() - start:.0f} s", file=sys.stderr)
  save()
  print(f"wrote {out}", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
