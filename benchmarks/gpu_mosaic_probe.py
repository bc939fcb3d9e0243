"""Where the Mosaic GPU kernels' time goes: trace, compile, first call and steady calls, per phase.

Run from the repository root on a machine with a GPU::

    python benchmarks/gpu_mosaic_probe.py                      # LayerNorm 1024x1024, then 32768x1024 bf16
    python benchmarks/gpu_mosaic_probe.py --shapes 32768x1024 --dtype float32

and, on any machine (no GPU: ``jax.export`` lowers the kernels for cuda; the
checkout's sources, not an installed copy)::

    PYTHONPATH=. python benchmarks/gpu_mosaic_probe.py --lowered   # what each compile is given

``bench_gpu.py --gpu-backend mosaic_gpu`` has finished no row in 80 s on a
GPU machine, which does not say whether the compile or the kernels took the
time. This script times each phase of ``layer_norm_fwd`` and
``layer_norm_backward`` under ``implementation="mosaic_gpu"`` (and the Triton
kernels' as the baseline) with a line flushed after each, and every
``--dump-every`` seconds prints every thread's stack (``faulthandler``), so a
run cut short still shows the phase and the frame it was in.

``--lowered`` compiles nothing: it exports each case for cuda and prints,
per Mosaic GPU kernel, the seconds its lowering took and the size of the
module its custom call carries (the ops the Mosaic GPU pipeline, LLVM and
ptxas compile at XLA compile time: ``scf.for`` counts the loops left
rolled), and the StableHLO ops outside the kernels (what XLA compiles): a
chain of adds summing the CTA partials there once made the backward's compile
take seconds (BENCHMARKS.md#gpu-mosaic-gpu-against-triton).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import faulthandler
import io
import pathlib
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_normgrad as jn
from jax_normgrad import _bench

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_lib  # noqa: E402  (the sibling module: the one way to change a tuning)
_JAX_VERSION = tuple(int(v) for v in jax.__version__.split(".")[:2])


def _phases(name: str, fn, args, calls: int, moved: int) -> None:
  """Times each phase of ``fn(*args)``; ``moved``: the bytes a call must read and write."""
  t0 = time.perf_counter()
  lowered = jax.jit(fn).lower(*args)
  t1 = time.perf_counter()
  compiled = lowered.compile()
  t2 = time.perf_counter()
  jax.block_until_ready(compiled(*args))
  t3 = time.perf_counter()
  # Samples of calls issued back to back for about 2 ms (the GPU benchmarks' method).
  steady = np.median(_bench.call_times_ms(compiled, *args, warmup=1, iters=calls, batch_ms=2.0))
  print(f"{name}: lower {t1 - t0:.2f} s, compile {t2 - t1:.2f} s, first call {t3 - t2:.3f} s, "
        f"steady {steady:.3f} ms/call, {moved / steady / 1e9:.2f} TB/s (median of {calls} "
        "samples)", flush=True)


def probe(rows: int, hidden: int, dtype, impl: str, calls: int, stages: int | None = None) -> None:
  """Both phases of ``impl``; ``stages``: Mosaic GPU's ``mosaic_gpu_max_stages`` for the run."""
  if stages is not None:
    from jax_normgrad.pallas import config  # pylint: disable=g-import-not-at-top
    with bench_lib.tuning(mosaic_gpu_max_stages=stages):
      plans = [config.mosaic_gpu_plan(hidden, jnp.dtype(dtype).itemsize, backward=b,
                                      params=1 + (not b), in_place=not b) for b in (False, True)]
      got = ", ".join(f"{k} {p.stages if p else 'pieces'}{' in place' if p and p.in_place else ''}"
                      for k, p in zip(("fwd", "bwd"), plans))
      print(f"mosaic_gpu_max_stages={stages}: stages {got}", flush=True)
      jax.clear_caches()  # the plan is read at trace time
      probe(rows, hidden, dtype, impl, calls)
    jax.clear_caches()
    return
  k = jax.random.split(jax.random.key(0), 4)
  x = jax.random.normal(k[0], (rows, hidden), jnp.float32).astype(dtype)
  dy = jax.random.normal(k[1], (rows, hidden), jnp.float32).astype(dtype)
  w = (1 + 0.1 * jax.random.normal(k[2], (hidden,))).astype(dtype)
  b = (0.1 * jax.random.normal(k[3], (hidden,))).astype(dtype)
  tag = f"{impl} LayerNorm {rows}x{hidden} {jnp.dtype(dtype).name}"
  fwd = lambda x, w, b: jn.layer_norm_fwd(x, hidden, w, b, implementation=impl)
  size = x.size * x.dtype.itemsize
  _phases(f"{tag} fwd", fwd, (x, w, b), calls, 2 * size)
  _, mean, rstd = jax.jit(fwd)(x, w, b)
  bwd = lambda dy, x, m, r, w, b: jn.layer_norm_backward(dy, x, hidden, m, r, w, b, implementation=impl)
  _phases(f"{tag} bwd", bwd, (dy, x, mean, rstd, w, b), calls, 3 * size)


# ----------------------------------------------------------------------------
# --lowered: the modules a compile is given, without a GPU.


@contextlib.contextmanager
def _captured_kernels():
  """Wraps JAX's Mosaic GPU lowering to record ``(name, seconds, module)`` per kernel.

  JAX internals, a probe's only way in: the kernel body's lowering is timed,
  and the module is taken where the ``mosaic_gpu`` custom call serializes it
  (``_mosaic_gpu_lowering_rule``). Both are looked up as module attributes
  at each call, so wrapping them there is enough; they are restored on exit.
  The body's lowering differs by version: before jax 0.12 ``plgpu.kernel``
  lowers as a ``pallas_call`` (``lower_pipelined_jaxpr_to_module``), from
  0.12 through ``mpmd_map`` (``lower_unpipelined_jaxpr_to_module``).
  """
  from jax._src.pallas.mosaic_gpu import lowering  # pylint: disable=g-import-not-at-top
  from jax.experimental.mosaic.gpu import core  # pylint: disable=g-import-not-at-top
  kernels, pending = [], []
  body = ("lower_unpipelined_jaxpr_to_module" if _JAX_VERSION >= (0, 12)
          else "lower_pipelined_jaxpr_to_module")
  lower, rule = getattr(lowering, body), core._mosaic_gpu_lowering_rule

  def timed_lower(*args, **kwargs):
    t0 = time.perf_counter()
    result = lower(*args, **kwargs)
    pending.append(time.perf_counter() - t0)
    return result

  def capture(ctx, *args, module, **kwargs):
    name = str(module.operation.attributes["sym_name"]).strip('"')
    kernels.append((name, pending.pop() if pending else float("nan"), module))
    return rule(ctx, *args, module=module, **kwargs)

  setattr(lowering, body, timed_lower)
  core._mosaic_gpu_lowering_rule = capture
  try:
    yield kernels
  finally:
    setattr(lowering, body, lower)
    core._mosaic_gpu_lowering_rule = rule


def _module_size(module) -> tuple[int, collections.Counter, int]:
  """``(ops, ops by name, bytecode bytes)`` of a Mosaic GPU module."""
  names = collections.Counter()

  def walk(op):
    for region in op.regions:
      for block in region.blocks:
        for inner in block.operations:
          names[inner.operation.name] += 1
          walk(inner.operation)

  walk(module.operation)
  buf = io.BytesIO()
  module.operation.write_bytecode(buf)
  return sum(names.values()), names, len(buf.getvalue())


def _lowered_cases(shapes, dtype):
  """``(tag, f, args)``: LayerNorm forward and backward, RMSNorm backward per shape; GroupNorm."""
  sds = jax.ShapeDtypeStruct
  f32, impl = jnp.float32, "mosaic_gpu"
  for rows, h in shapes:
    x, p, st = sds((rows, h), dtype), sds((h,), dtype), sds((rows,), f32)
    tag = f"{rows}x{h} {jnp.dtype(dtype).name}"
    yield (f"LayerNorm {tag} fwd", lambda x, w, b, h=h: jn.layer_norm_fwd(
        x, h, w, b, implementation=impl), (x, p, p))
    yield (f"LayerNorm {tag} bwd", lambda dy, x, m, r, w, b, h=h: jn.layer_norm_backward(
        dy, x, h, m, r, w, b, implementation=impl), (x, x, st, st, p, p))
    yield (f"RMSNorm {tag} bwd", lambda dy, x, r, w, h=h: jn.rms_norm_backward(
        dy, x, h, r, w, implementation=impl), (x, x, st, p))
  for axis, shape in ((-1, (8, 32, 32, 320)), (1, (8, 320, 32, 32))):
    def grad(x, w, b, axis=axis):
      loss = lambda x, w, b: jnp.sum(jn.group_norm(
          x, 32, w, b, channel_axis=axis, activation="silu", implementation=impl).astype(f32))
      return jax.grad(loss, argnums=(0, 1, 2))(x, w, b)
    yield (f"GroupNorm+silu {shape} axis {axis} {jnp.dtype(dtype).name} grad", grad,
           (sds(shape, dtype), sds((320,), dtype), sds((320,), dtype)))


def lowered(shapes, dtype) -> None:
  """Prints, per case, the export time, each kernel's lowering and module, the XLA ops."""
  for tag, f, args in _lowered_cases(shapes, dtype):
    with _captured_kernels() as kernels:
      t0 = time.perf_counter()
      text = jax.export.export(jax.jit(f), platforms=["cuda"])(*args).mlir_module()
      total = time.perf_counter() - t0
    hlo = collections.Counter(re.findall(r"= (?:\"?)(stablehlo\.\w+)", text))
    hlo.pop("stablehlo.custom_call", None)
    top = ", ".join(f"{n.split('.')[1]} {c}" for n, c in hlo.most_common(3))
    print(f"{tag}: export {total:.2f} s; XLA ops outside the kernels {sum(hlo.values())} "
          f"({top})", flush=True)
    for name, seconds, module in kernels:
      ops, names, size = _module_size(module)
      print(f"  {name}: lowered in {seconds:.2f} s, {ops} ops ({names['scf.for']} scf.for), "
            f"bytecode {size / 1024:.1f} KiB", flush=True)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--shapes", default="1024x1024,32768x1024")
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--impls", default="triton,mosaic_gpu")
  parser.add_argument("--calls", type=int, default=20)
  parser.add_argument("--dump-every", type=float, default=45.0)
  parser.add_argument("--stages", default="",
                      help="Mosaic GPU: run once per mosaic_gpu_max_stages in this list "
                           "(e.g. 2,8: the first kernels' double buffer, then the default)")
  parser.add_argument("--lowered", action="store_true",
                      help="no GPU: export for cuda, print each kernel's lowering and module size")
  args = parser.parse_args(argv)
  shapes = [tuple(map(int, shape.split("x"))) for shape in args.shapes.split(",")]
  if args.lowered:
    print(f"jax {jax.__version__}, Mosaic GPU kernels exported for cuda", flush=True)
    lowered(shapes, jnp.dtype(args.dtype))
    return 0
  # sys.__stderr__: the process's fd 2 even where sys.stderr is replaced (pytest's capture).
  faulthandler.dump_traceback_later(args.dump_every, repeat=True, file=sys.__stderr__)
  print(f"jax {jax.__version__}, {jax.devices()}", flush=True)
  for rows, hidden in shapes:
    shape = f"{rows}x{hidden}"
    for impl in args.impls.split(","):
      runs = [int(s) for s in args.stages.split(",") if s] if impl == "mosaic_gpu" else []
      for stages in runs or [None]:
        try:
          probe(rows, hidden, jnp.dtype(args.dtype), impl, args.calls, stages)
        except Exception as e:  # a phase that fails: say so, go on with the next
          print(f"{impl} {shape}: {type(e).__name__}: {str(e)[:400]}", flush=True)
  faulthandler.cancel_dump_traceback_later()
  return 0


if __name__ == "__main__":
  sys.exit(main())
