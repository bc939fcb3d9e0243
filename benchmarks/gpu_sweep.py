"""Sweep of the GPU kernels' tile heuristics: ``config.Tuning`` overrides side by side, one process.

Run from the repository root on a machine with a GPU::

    python benchmarks/gpu_sweep.py --out sweep.json
    python benchmarks/gpu_sweep.py --configs default,rows1 --rows "ln 32768x1024 bfloat16"

Each configuration's forward and backward (``layer_norm_fwd`` /
``layer_norm_backward`` and their RMSNorm and GroupNorm equivalents: the
kernels alone, as in ``bench_gpu.py``; for the ``add_*`` rows the fused
residual op's forward, and its forward + backward in the "bwd" column) are
compiled under its override (``bench_lib.tuning``, with ``jax.clear_caches()``
around it), then every
compiled function is timed in interleaved rounds, so that each figure sees
the same machine state. Samples are calls issued back to back and blocked
once (``_bench.call_times_ms(batch_ms=...)``). Each configuration's outputs
are compared with the default's: a heuristic that changes the result beyond
float32 reordering is reported, not timed as if it were right.

On a machine with no GPU, ``--smoke`` runs tiny shapes through the CPU
kernels, where the overrides change nothing: a check of the script (the test
suite runs it so).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np

import jax_normgrad as jn
from jax_normgrad import _bench

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import bench_gpu  # noqa: E402
import bench_lib  # noqa: E402

ROWS = [("ln", (32768, 1024), jnp.bfloat16), ("ln", (32768, 1024), jnp.float32),
        ("rms", (32768, 1024), jnp.bfloat16), ("ln", (16384, 4096), jnp.bfloat16),
        ("rms", (16384, 4096), jnp.float32), ("ln", (4096, 16384), jnp.float32),
        ("gn_nhwc", (8, 256, 64, 64, 32), jnp.float32),
        # Issue 27's rows behind (H200, 2026-11-26): the residual form's forward and its
        # forward + backward (add_*; "+f32" a float32 residual stream).
        ("add_ln", (16384, 4096), jnp.bfloat16), ("add_rms", (16384, 4096), jnp.float32),
        ("add_rms", (32768, 1024), jnp.float32), ("add_rms+f32", (16384, 4096), jnp.bfloat16),
        ("add_ln", (16384, 4096), jnp.float32),
        # A UNet's channels-last GroupNorms (32 groups of 2 and 8 channels, batch 32): the
        # sample-wide kernels, split or whole, against the per-group ones (2026-11-27).
        ("gn_nhwc", (32, 64, 32, 32, 32), jnp.float32), ("gn_nhwc", (32, 64, 32, 32, 32), jnp.bfloat16),
        ("gn_nhwc", (32, 256, 8, 8, 32), jnp.float32),
        # bench_models' GPU transformer (batch 32 x 256 tokens of 512): the residual form's
        # norm at a model's size, where the partial sums took two launches of about 7 us
        # beside a 26 us backward kernel (H100, 2026-11-27; one launch since).
        ("add_ln", (8192, 512), jnp.float32), ("add_ln", (8192, 512), jnp.bfloat16),
        # The SD-class UNet's channels-last GroupNorms (batch 8, 32 groups of 10, 20 and 40
        # channels), slower than XLA's in that model's step (H200, 2026-11-28).
        ("gn_nhwc", (8, 320, 64, 64, 32), jnp.bfloat16), ("gn_nhwc", (8, 640, 32, 32, 32), jnp.bfloat16),
        ("gn_nhwc", (8, 1280, 16, 16, 32), jnp.bfloat16), ("gn_nhwc", (8, 320, 64, 64, 32), jnp.float32),
        ("gn_nhwc", (8, 640, 32, 32, 32), jnp.float32)]
SMOKE_ROWS = [("ln", (24, 40), jnp.float32), ("gn_nhwc", (2, 6, 3, 5, 3), jnp.float32),
              ("add_rms+f32", (24, 40), jnp.bfloat16)]
#: name -> tuning changes (bench_lib.tuning's keys). "default" is the package's own.
CONFIGS = {
    "default": {},
    # The partials reduction before 2026-11-26: 128 columns x 16 rows a step, 4 warps.
    "partials_old": {"gpu_partials_cols": 128, "gpu_partials_tile": 2048,
                     "gpu_partials_warps": 4},
    # Every GPU tuning of 2026-11-25 (before the 2026-11-26 sweep).
    "before_11_26": {"gpu_partials_cols": 128, "gpu_partials_tile": 2048,
                     "gpu_partials_warps": 4, "gpu_fwd_bytes_per_thread": 16,
                     "gpu_max_warps_bwd": 32},
    # num_stages > 1 where it is 1 now: on sm_90 Triton compiled both with no shared-memory
    # stages (the loops' loads were not pipelined), so neither was timed.
    "partials_stages3": {"gpu_partials_stages": 3},
    "pipeline_all": {"gpu_small_tile": 1 << 16},
    "fwd_bpt32": {"gpu_fwd_bytes_per_thread": 32},
    "fwd_bpt64": {"gpu_fwd_bytes_per_thread": 64},
    "bwd_bpt32": {"gpu_bwd_bytes_per_thread": 32},
    "fwd_warps64": {"gpu_warps_per_sm_fwd": 64},
    "fwd_one_row": {"gpu_warps_per_sm_fwd": 1 << 14},  # a program per row, or nearly
    "bwd_warps64": {"gpu_warps_per_sm": 64},
    # The partial sums in one step of up to 512 rows (16384 elements), where a model's
    # small columns (512) leave 16-32 programs walking 528 partial rows 128 at a time.
    "partials_tile16k": {"gpu_partials_tile": 16384},
    # The partial sums as a fixed-order tree in XLA (one fusion, no kernel of their own).
    "partials_xla": {"gpu_partials_in_xla": True},
    # The residual form's forward at 4 elements per thread (the float32 rule until
    # 2026-11-26, 16 bytes) and at 16 (the 16-bit form at the plain forward's 32 bytes).
    "res_fwd_e4": {"gpu_fwd_residual_elems_per_thread": 4},
    "res_fwd_e16": {"gpu_fwd_residual_elems_per_thread": 16},
    # Channels-last GroupNorm with narrow groups: the sample-wide kernels unsplit (one
    # persistent kernel each way), and the per-group kernels (the rule before 2026-11-27).
    "nhwc_whole": {"gpu_nhwc_split": False},
    "nhwc_per_group": {"gpu_nhwc_group_bytes": 0, "gpu_nhwc_group_bytes_fwd": 0},
    "nhwc_fwd_64": {"gpu_nhwc_group_bytes_fwd": 64},
    # The sample-wide kernels' tiles halved and doubled (rows of a sample per program).
    "nhwc_tiles_half": {"gpu_nhwc_max_tile_fwd": 4096, "gpu_nhwc_max_tile_bwd": 2048},
    "nhwc_tiles_double": {"gpu_nhwc_max_tile_fwd": 16384, "gpu_nhwc_max_tile_bwd": 8192},
    # Groups of a channel count that is not a power of two (10, 20) in the sample-wide kernels
    # (the default), or in the per-group ones ("_off"); "_fwd64": the forward's too up to 64
    # bytes a group, as the backward's.
    "nhwc_odd_groups": {"gpu_nhwc_odd_groups": True},
    "nhwc_odd_off": {"gpu_nhwc_odd_groups": False},
    "nhwc_odd_groups_fwd64": {"gpu_nhwc_odd_groups": True, "gpu_nhwc_group_bytes_fwd": 64},
}


def residual_workload(kind, shape, dtype):
  """An ``add_*`` row: the fused op's forward as "fwd", its forward + backward as "bwd"."""
  residual_dtype = jnp.float32 if kind.endswith("+f32") else None
  ln = kind.startswith("add_ln")
  x, r, w, b, dy, dh = bench_lib.residual_inputs(shape, dtype, residual_dtype)

  def fwd(x, r, w, b):
    if ln:
      return jn.add_layer_norm(x, r, w, b, residual_dtype=residual_dtype)
    return jn.add_rms_norm(x, r, w, residual_dtype=residual_dtype)

  fwd_bwd = bench_lib.residual_variants("ln" if ln else "rms", dtype, residual_dtype)["fused"]
  return types.SimpleNamespace(name=_name(kind, shape, dtype), nbytes_fwd=0, nbytes_bwd=0,
                               ours_fwd=(fwd, (x, r, w, b)),
                               ours_bwd=(fwd_bwd, (x, r, w, b, dy, dh)))


def _name(kind, shape, dtype) -> str:
  return f"{kind} {'x'.join(map(str, shape))} {jnp.dtype(dtype).name}"


def sweep_row(kind, shape, dtype, configs: dict, *, iters: int, rounds: int,
              batch_ms: float) -> dict:
  wl = (residual_workload if kind.startswith("add_") else bench_gpu.workload)(kind, shape, dtype)
  compiled, errors = {}, {}
  for name, changes in configs.items():
    jax.clear_caches()
    with bench_lib.tuning(**changes):
      for v in ("fwd", "bwd"):
        fn, args = getattr(wl, f"ours_{v}")
        compiled[name, v] = (jax.jit(fn).lower(*args).compile(), args)
    jax.clear_caches()
  for v in ("fwd", "bwd"):
    ref = compiled["default", v][0](*compiled["default", v][1]) if "default" in configs else None
    for name in configs:
      fn, args = compiled[name, v]
      errors[name, v] = 0.0 if ref is None else max(
          _bench.max_rel_err(u, w) for u, w in zip(jax.tree.leaves(fn(*args)), jax.tree.leaves(ref)))
  per_round = max(1, -(-iters // rounds))
  samples = {key: [] for key in compiled}
  for r in range(rounds):
    for key, (fn, args) in compiled.items():
      samples[key] += _bench.call_times_ms(fn, *args, warmup=2 if r == 0 else 1,
                                           iters=per_round, batch_ms=batch_ms)
  row = {"workload": wl.name, "kind": kind, "shape": list(shape), "dtype": jnp.dtype(dtype).name,
         "nbytes_fwd": wl.nbytes_fwd, "nbytes_bwd": wl.nbytes_bwd, "configs": {}}
  for name in configs:
    row["configs"][name] = {
        f"{v}_{what}": value for v in ("fwd", "bwd")
        for what, value in (("ms", float(np.median(samples[name, v]))),
                            ("max_rel_err_vs_default", errors[name, v]))}
  return row


def print_rows(rows, configs, out=sys.stdout):
  head = "| row | " + " | ".join(f"{c} fwd / bwd ms" for c in configs) + " |"
  print(head, file=out)
  print("|" + " --- |" * (len(configs) + 1), file=out)
  for row in rows:
    cells = []
    for c in configs:
      r = row["configs"][c]
      bad = max(r["fwd_max_rel_err_vs_default"], r["bwd_max_rel_err_vs_default"]) > 1e-3
      cells.append(f"{r['fwd_ms']:.3f} / {r['bwd_ms']:.3f}{' (DIFFERS)' if bad else ''}")
    print(f"| {row['workload']} | " + " | ".join(cells) + " |", file=out)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", type=pathlib.Path, required=True)
  parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names of CONFIGS")
  parser.add_argument("--rows", default="", help="comma-separated row names (default: all)")
  parser.add_argument("--iters", type=int, default=24)
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--batch-ms", type=float, default=2.0)
  parser.add_argument("--smoke", action="store_true", help="tiny shapes (a check of the script, no GPU)")
  args = parser.parse_args(argv)
  configs = {name: CONFIGS[name] for name in args.configs.split(",")}
  wanted = [r for r in args.rows.split(",") if r]
  rows_spec = [r for r in (SMOKE_ROWS if args.smoke else ROWS)
               if not wanted or _name(*r) in wanted]
  rows, info, versions = [], bench_gpu.machine(), _bench.versions()
  for kind, shape, dtype in rows_spec:
    rows.append(sweep_row(kind, shape, dtype, configs, iters=args.iters, rounds=args.rounds,
                          batch_ms=args.batch_ms))
    print_rows(rows[-1:], configs, out=sys.stderr)
    args.out.write_text(json.dumps({"machine": info, "versions": versions,
                                    "command": " ".join(sys.argv), "commit": bench_lib.commit(),
                                    "gpu_backend": bench_lib.gpu_backend(), "configs": configs,
                                    "rows": rows}, indent=1))
  print_rows(rows, configs)
  return 0


if __name__ == "__main__":
  sys.exit(main())
