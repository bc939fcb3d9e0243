"""Smoke tests of benchmarks/bench_cpu.py, bench_gpu.py, bench_models.py and gpu_session.sh on tiny shapes (no timing asserted)."""

from __future__ import annotations

import importlib.util
import io
import os
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_normgrad as jn
from jax_normgrad import _bench

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_lib  # noqa: E402  (the benchmarks' sibling module)
import cases

_SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "bench_cpu.py"


@pytest.fixture(scope="module")
def bench_cpu():
  spec = importlib.util.spec_from_file_location("bench_cpu", _SCRIPT)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


@pytest.mark.parametrize("kind,shape,dtype", [("ln", (24, 40), jnp.float32),
                                              ("gn", (2, 6, 3, 5, 3), jnp.bfloat16)])
def test_measure_interleaves_rounds(bench_cpu, kind, shape, dtype, monkeypatch):
  pauses = []
  monkeypatch.setattr(bench_cpu.time, "sleep", pauses.append)
  row = bench_cpu.measure(kind, shape, dtype, bandwidth=20.0, iters=4, rounds=2)
  assert row["rounds"] == 2
  assert row["settle_s"] == bench_cpu.SETTLE_S
  # One pause before every column of every round: ours and XLA's backward,
  # forward and grad, XLA's one pass, and PyTorch's backward and forward
  # where installed.
  columns = 7 + (2 if "bwd_torch_ms" in row else 0)
  assert pauses == [bench_cpu.SETTLE_S] * (2 * columns)
  for variant in ("bwd", "fwd", "grad"):
    for who in ("ours", "xla"):
      assert row[f"{variant}_{who}_ms"] > 0
    assert len(row[f"{variant}_vs_xla_rounds"]) == 2
  assert row["bwd_vs_xla"] == pytest.approx(row["bwd_xla_ms"] / row["bwd_ours_ms"])
  # The forward's floor: x read and y written, against the backward's three tensors.
  assert row["fwd_floor_ms"] == pytest.approx(row["bwd_floor_ms"] * 2 / 3)
  assert row["fwd_xla_vs_floor"] == pytest.approx(row["fwd_xla_ms"] / row["fwd_floor_ms"])
  assert row["fwd_vs_xla"] == pytest.approx(row["fwd_xla_ms"] / row["fwd_ours_ms"])
  assert row["fwd_xla_vs_pass"] == pytest.approx(row["fwd_xla_ms"] / row["fwd_pass_ms"])
  if "bwd_torch_ms" in row:  # PyTorch is optional
    assert len(row["bwd_vs_torch_rounds"]) == 2
  bench_cpu.print_table([row])


def test_model_rows_are_the_issues(bench_cpu):
  """Issue 29's shapes: channels-last GroupNorm 8x8x8x128 to 8x32x32x320 (32 groups), LayerNorm 8x256x512 to 8x1024x1024."""
  rows = {(k, s) for k, s, _ in bench_cpu.MODEL_ROWS}
  assert {("gn_nhwc", (8, 128, 8, 8, 32)), ("gn_nhwc", (8, 320, 32, 32, 32)),
          ("ln", (8 * 256, 512)), ("ln", (8 * 1024, 1024))} <= rows
  # NHWC rows time the channels-last kernels (Flax's layout).
  wl = bench_cpu._bench.group_norm_workload(2, 6, 3, 5, 3, channels_last=True)
  assert wl.name.startswith("GroupNorm 2x3x5x6 NHWC")


def test_plot_writes_into_a_new_folder(bench_cpu, tmp_path):
  pytest.importorskip("matplotlib")
  rows = [{"sweep": True, "dtype": "float32", "shape": [2 ** 23 // h, h], "nbytes": 3 * 2 ** 25,
           "bwd_ours_ms": 3.0, "bwd_xla_ms": 9.0, "bwd_floor_ms": 2.0} for h in (256, 1024)]
  path = tmp_path / "not" / "yet" / "sweep.png"
  bench_cpu.plot(rows, str(path))
  assert path.stat().st_size > 0


def test_cpu_model_names_the_caches(bench_cpu):
  model = bench_cpu.cpu_model()
  assert isinstance(model, str)
  if pathlib.Path("/sys/devices/system/cpu/cpu0/cache/index0").exists():
    assert "L1" in model


# ----------------------------------------------------------------------------
# benchmarks/bench_gpu.py on the CPU, tiny shapes: the script a GPU machine runs first.


def _load_script(name):
  import sys
  path = _SCRIPT.parent / name
  spec = importlib.util.spec_from_file_location(path.stem, path)
  mod = importlib.util.module_from_spec(spec)
  sys.modules[path.stem] = mod  # flax's modules (dataclasses) look their module up there
  spec.loader.exec_module(mod)
  return mod


def test_bench_gpu_smoke_run_writes_every_column(tmp_path, capsys):
  """Every column and the roof: each copy candidate (the Pallas copy in interpret mode, each
  configuration tried) and the fastest; torch's columns where it imports (not in the test extra)."""
  import json
  bench_gpu = _load_script("bench_gpu.py")
  out = tmp_path / "gpu.json"
  assert bench_gpu.main(["--smoke", "--iters", "2", "--rounds", "1", "--out", str(out)]) == 0
  result = json.loads(out.read_text())
  rows = result["rows"]
  assert [r["kind"] for r in rows] == [k for k, _, _ in bench_gpu.SMOKE_ROWS]
  assert {"jax", "jax_normgrad"} <= set(result["versions"]) and result["machine"]["platform"]
  torch_ran = result["peers"]["torch"] is not None
  assert torch_ran == ("torch" in result["versions"])
  # tokamax (Python 3.12+) where it imports; else its absence said, not a silent gap.
  tokamax_ran = result["peers"]["tokamax"] is not None
  assert tokamax_ran or "tokamax" in result["peers"]["tokamax_absent"]
  assert result["commit"] is None or len(result["commit"]) >= 7
  assert result["peers"]["liger_kernel"] is None  # CUDA only
  labels = {f"{b} B, {w} warps" for b, w in bench_gpu.SMOKE_PALLAS_COPY_CONFIGS}
  for r in rows:
    assert "errors" not in r, r["errors"]
    assert {"jnp_copy", "two_copies", "xla_neg", "pallas_copy"} <= set(r["roof"])
    assert ("torch_clone" in r["roof"]) == torch_ran
    assert set(r["pallas_copy"]["tried_gbs"]) == labels and r["pallas_copy"]["config"] in labels
    assert all(c["gbs"] > 0 for c in r["roof"].values())
    assert r["roof_gbs"] == max(c["gbs"] for c in r["roof"].values())
    assert r["roof_gbs"] == r["roof"][r["roof_by"]]["gbs"]
    for v in bench_gpu.VARIANTS:
      assert r[f"{v}_vs_xla"] == pytest.approx(r[f"{v}_xla_ms"] / r[f"{v}_ours_ms"])
      for who in ("ours", "xla"):
        assert r[f"{v}_{who}_of_roof"] == pytest.approx(r[f"{v}_{who}_gbs"] / r["roof_gbs"])
    for v in ("fwd", "bwd"):
      timed = {w: r[f"{v}_{w}_ms"] for w in bench_gpu.WHO if f"{v}_{w}_ms" in r}
      assert set(timed) == ({"ours", "xla"} | ({"torch"} if torch_ran else set())
                            | ({"tokamax"} if tokamax_ran and r["kind"] in ("ln", "rms") else set()))
      assert r[f"{v}_fastest"] == min(timed, key=timed.get)
      if torch_ran:  # the same function of the same inputs
        assert r[f"{v}_torch_max_rel_err"] < (2e-2 if r["dtype"] == "bfloat16" else 1e-4)
  text = capsys.readouterr().out
  assert "GroupNorm 2x3x5x6 NHWC g3 bfloat16" in text
  assert "forward: ms, TB/s" in text and "backward: ms, TB/s" in text


def test_bench_gpu_pallas_copy_copies_with_a_masked_last_block():
  """The roof's Pallas copy (interpret mode): exact, whole blocks or a masked last one."""
  bench_gpu = _load_script("bench_gpu.py")
  for shape, dtype in (((37, 5), jnp.float32), ((64, 8), jnp.bfloat16), ((3,), jnp.float32)):
    x = jax.random.normal(jax.random.key(0), shape).astype(dtype)
    for block_bytes in (64, 256):
      y = bench_gpu.pallas_copy(x, block_bytes=block_bytes, num_warps=4, interpret=True)
      assert y.shape == x.shape and y.dtype == x.dtype
      np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(x, np.float32))
  with pytest.raises(ValueError, match="block_bytes"):
    bench_gpu.pallas_copy(jnp.ones(8), block_bytes=24, num_warps=4, interpret=True)


class _FakePeers:
  """A stand-in for bench_gpu.Peers: a torch forward that runs (JAX's own layer), a Liger
  backward that fails when timed, and a torch backward whose output differs from ours."""

  torch = "fake"

  def variants(self, kind, shape, wl):
    ours_y = wl.ours_fwd[0](*wl.ours_fwd[1])[0]
    ours_dx = wl.ours_bwd[0](*wl.ours_bwd[1])[0]

    def fail():
      raise RuntimeError("no CUDA here")

    first = lambda a: np.asarray(a.reshape(-1).astype(jnp.float32))
    return ({"fwd_torch": (*wl.xla_fwd, None), "bwd_torch": (*wl.xla_bwd, None),
             "bwd_liger": (fail, (), None)},
            {"fwd_torch": first(ours_y), "bwd_torch": 2 * first(ours_dx)},
            {"fwd_liger": "ImportError: none"})


def test_bench_gpu_peers_columns_and_failures():
  """A peer's columns join the row like ours; one that fails is left out with its error."""
  bench_gpu = _load_script("bench_gpu.py")
  row = bench_gpu.measure("ln", (24, 40), jnp.float32, iters=1, rounds=1, peers=_FakePeers(),
                          pallas_configs=bench_gpu.SMOKE_PALLAS_COPY_CONFIGS)
  assert row["fwd_torch_ms"] > 0 and row["bwd_torch_ms"] > 0
  assert row["fwd_torch_of_roof"] == pytest.approx(row["fwd_torch_gbs"] / row["roof_gbs"])
  assert "bwd_liger_ms" not in row and "fwd_liger_ms" not in row
  assert set(row["errors"]) == {"bwd_liger", "fwd_liger"}
  assert "no CUDA here" in row["errors"]["bwd_liger"]
  assert row["fwd_torch_max_rel_err"] == 0 and row["bwd_torch_max_rel_err"] == pytest.approx(1)
  others = min(row["bwd_xla_ms"], row["bwd_torch_ms"])
  assert row["bwd_ours_vs_best_other"] == pytest.approx(others / row["bwd_ours_ms"])
  out = io.StringIO()
  bench_gpu.print_table([row], out=out)
  lines = out.getvalue().splitlines()
  head = next(l for l in lines if l.startswith("| row |"))
  line = next(l for l in lines if l.startswith("| LayerNorm 24x40"))
  assert line.count("|") == head.count("|") == 9
  assert line.split("|")[head.split("|").index(" Liger ")] == " - "  # its forward failed


class _FakeTokamax:
  """A stand-in for the tokamax package (which needs Python 3.12): its ``layer_norm`` signature,
  computed by jnp, with a custom VJP whose residuals hold x, y and the statistics, as tokamax's
  Triton op keeps them."""

  __version__ = "fake"

  @staticmethod
  def layer_norm(x, scale, offset, *, axis=-1, epsilon=1e-6, scale_offset=0.0,
                 subtract_mean=True, implementation=None):
    assert axis == -1 and scale_offset == 0.0 and implementation == "xla"

    def stats(x):
      x32 = x.astype(jnp.float32)
      mean = jnp.mean(x32, -1, keepdims=True) if subtract_mean else jnp.zeros_like(x32[..., :1])
      return mean, jax.lax.rsqrt(jnp.mean(jnp.square(x32 - mean), -1, keepdims=True) + epsilon)

    def y_of(x, scale, offset, mean, rstd):
      y = (x.astype(jnp.float32) - mean) * rstd * scale.astype(jnp.float32)
      return (y if offset is None else y + offset.astype(jnp.float32)).astype(x.dtype)

    @jax.custom_vjp
    def f(x, scale, offset):
      return y_of(x, scale, offset, *stats(x))

    def fwd(x, scale, offset):
      mean, rstd = stats(x)
      y = y_of(x, scale, offset, mean, rstd)
      return y, (x, scale, offset, y, mean, rstd)

    def bwd(res, dy):
      x, scale, offset = res[:3]
      return jax.vjp(lambda x, s, o: y_of(x, s, o, *stats(x)), x, scale, offset)[1](dy)

    f.defvjp(fwd, bwd)
    return f(x, scale, offset)


def test_bench_gpu_tokamax_column():
  """tokamax's column joins the LayerNorm and RMSNorm rows like a peer's (not GroupNorm's): its
  forward returns y and the statistics only, its results are checked against ours, and on a
  CPU it runs tokamax's XLA code (no Triton call in its module)."""
  bench_gpu = _load_script("bench_gpu.py")
  tok = bench_gpu.Tokamax("cpu", module=_FakeTokamax)
  assert tok.info["tokamax"] == {"version": "fake", "implementation": "xla"}
  assert bench_gpu.Tokamax("gpu", enabled=False).info["absent"] == "--no-peers"
  row = bench_gpu.measure("ln", (24, 40), jnp.float32, iters=1, rounds=1, tokamax=tok,
                          pallas_configs=bench_gpu.SMOKE_PALLAS_COPY_CONFIGS[:1])
  assert "errors" not in row, row["errors"]
  assert row["fwd_tokamax_ms"] > 0 and row["bwd_tokamax_ms"] > 0
  assert row["fwd_tokamax_of_roof"] == pytest.approx(row["fwd_tokamax_gbs"] / row["roof_gbs"])
  assert row["fwd_tokamax_max_rel_err"] < 1e-4 and row["bwd_tokamax_max_rel_err"] < 1e-4
  assert row["tokamax_kernel_calls"] == 0
  out = io.StringIO()
  bench_gpu.print_table([row], out=out)
  head = next(l for l in out.getvalue().splitlines() if l.startswith("| row |"))
  line = next(l for l in out.getvalue().splitlines() if l.startswith("| LayerNorm 24x40"))
  assert line.split("|")[head.split("|").index(" tokamax ")] != " - "
  # RMSNorm: y and the statistics from the forward, dx from the backward, as XLA's.
  wl = bench_gpu.workload("rms", (16, 72), jnp.bfloat16)
  timed, outputs, errors = tok.variants("rms", wl)
  assert not errors and set(timed) == {"fwd_tokamax", "bwd_tokamax"}
  fwd, args, _ = timed["fwd_tokamax"]
  assert [a.shape for a in jax.tree.leaves(fwd(*args))] == [(16, 72), (16, 1), (16, 1)]
  want = {"fwd_tokamax": wl.xla_fwd[0](*wl.xla_fwd[1]), "bwd_tokamax": wl.xla_bwd[0](*wl.xla_bwd[1])[0]}
  for name, got in outputs.items():
    assert _bench.max_rel_err(got, np.asarray(want[name].reshape(-1).astype(jnp.float32))) < 2e-2
  assert tok.variants("gn_nhwc", None) == ({}, {}, {})  # no GroupNorm in tokamax


def test_bench_gpu_rows_are_the_issues():
  bench_gpu = _load_script("bench_gpu.py")
  names = {(k, s, jnp.dtype(d).name) for k, s, d in bench_gpu.ROWS}
  for kind in ("ln", "rms"):
    for shape in ((32768, 1024), (16384, 4096), (4096, 16384)):
      assert {(kind, shape, "bfloat16"), (kind, shape, "float32")} <= names
  assert ("gn", (8, 256, 64, 64, 32), "float32") in names
  assert ("gn_nhwc", (8, 256, 64, 64, 32), "float32") in names


def test_bench_gpu_residual_smoke_run(tmp_path, capsys):
  """--residual: the fused form's rows (fused, unfused, XLA) and the pre-norm stack's step."""
  import json
  bench_gpu = _load_script("bench_gpu.py")
  out = tmp_path / "gpu.json"
  assert bench_gpu.main(["--smoke", "--residual", "--iters", "1", "--rounds", "1",
                         "--out", str(out)]) == 0
  rows = json.loads(out.read_text())["rows"]
  assert len(rows) == len(bench_gpu.SMOKE_RESIDUAL_ROWS) + len(bench_lib.STACK_ROWS)
  for r in rows:
    assert r["unfused_vs_fused"] == pytest.approx(r["unfused_ms"] / r["fused_ms"])
    if "xla_ms" in r:
      assert r["xla_vs_fused"] == pytest.approx(r["xla_ms"] / r["fused_ms"])
  text = capsys.readouterr().out
  assert "add_rms_norm 16x72 bfloat16" in text and "mlp stack step 2x(32x64, ffn 32)" in text
  assert "add_rms_norm 16x72 bfloat16, float32 residual stream" in text
  assert [r["residual_dtype"] for r in rows[:3]] == ["float32", "bfloat16", "float32"]


def test_gpu_sweep_smoke_run(tmp_path, capsys):
  """The tile-heuristic sweep: every configuration of every row timed and checked against the
  default (on CPU the overrides change nothing, so the outputs agree exactly)."""
  import json
  sweep = _load_script("gpu_sweep.py")
  out = tmp_path / "sweep.json"
  assert sweep.main(["--smoke", "--iters", "2", "--rounds", "1", "--configs",
                     "default,partials_old", "--out", str(out)]) == 0
  rows = json.loads(out.read_text())["rows"]
  assert [r["kind"] for r in rows] == [k for k, _, _ in sweep.SMOKE_ROWS]
  for r in rows:
    assert set(r["configs"]) == {"default", "partials_old"}
    for c in r["configs"].values():
      assert c["fwd_ms"] > 0 and c["bwd_ms"] > 0
      assert c["fwd_max_rel_err_vs_default"] == c["bwd_max_rel_err_vs_default"] == 0
  assert "partials_old fwd / bwd ms" in capsys.readouterr().out


def test_call_times_ms_batches_calls():
  """batch_ms: each sample is the mean of calls issued back to back; as many samples as asked."""
  calls = []
  fn = lambda x: calls.append(1) or x + 1
  times = _bench.call_times_ms(fn, jnp.ones(4), warmup=1, iters=3, batch_ms=1e6)
  assert len(times) == 3 and all(t >= 0 for t in times)
  assert len(calls) == 1 + 5 + 3 * 100  # warm-up, the estimate, 3 samples of at most 100 calls


def test_call_times_ms_blocks_with_the_given_wait():
  """block: another framework's wait (torch's synchronize), once per warm-up call, the
  estimate and each sample."""
  waits = []
  times = _bench.call_times_ms(lambda: 1, warmup=2, iters=3, batch_ms=1e6,
                               block=lambda results: waits.append(results))
  assert len(times) == 3
  assert waits[:2] == [1, 1] and waits[2] == [1] * 5 and waits[3:] == [[1] * 100] * 3


def test_call_times_ms_warms_up_for_warmup_ms(monkeypatch):
  """warmup_ms: untimed calls go on until that long after the first (a fake clock: 1 ms per call)."""
  clock = [0.0]
  monkeypatch.setattr(_bench.time, "perf_counter", lambda: clock[0])
  calls = []

  def fn(x):
    calls.append(1)
    clock[0] += 1e-3
    return x

  times = _bench.call_times_ms(fn, jnp.ones(4), warmup=1, iters=2, warmup_ms=5.0)
  assert len(times) == 2
  assert len(calls) == 5 + 2  # warm-up calls until 5 ms had passed, then the timed ones


# ----------------------------------------------------------------------------
# benchmarks/bench_models.py: the norms inside small models, on tiny models.


def test_bench_models_quick_unet_reports_share_and_savings(tmp_path, capsys):
  import json
  pytest.importorskip("flax")
  bench_models = _load_script("bench_models.py")
  out = tmp_path / "models.json"
  assert bench_models.main(["--quick", "--model", "unet", "--settle-ms", "0", "--profile-rounds", "1",
                           "--trace-calls", "1", "--out", str(out)]) == 0
  result = json.loads(out.read_text())
  assert {"jax", "jax_normgrad", "flax", "optimizer", "loadavg_start", "loadavg_end", "commit",
          "device", "gpu_backend"} <= set(result["info"])
  assert result["info"]["device"].startswith("cpu") and result["info"]["gpu_backend"] is None
  (row,) = result["rows"]
  # One trace of the variants with the kernel forward: each one's ops in its own window.
  assert pathlib.Path(row["trace_file"]).stat().st_size > 0
  traced = [v for v in row["variants"] if f"{v}_trace" in row]
  assert traced == [v for v in row["variants"] if not v.endswith("_xla")]
  for v in traced:
    assert row[f"{v}_trace"]["span"] >= row[f"{v}_trace"]["busy"] > 0
  assert row["flax_kernel_targets"] == {}
  assert sum(row["fused_kernel_targets"].values()) == row["fused_custom_calls"]
  assert all(t.startswith("jax_normgrad_") for t in row["fused_kernel_targets"])
  assert row["variants"] == list(bench_models.unet_variants())
  # flax's layers and the identities run no kernel; every package variant does.
  assert row["flax_custom_calls"] == row["identity_custom_calls"] == row["affine_custom_calls"] == 0
  for v in row["variants"]:
    assert row[f"{v}_ms"] > 0
    if v not in bench_models.BASELINES:
      assert row[f"{v}_custom_calls"] > 0
      assert row[f"{v}_vs_flax"] == pytest.approx(row["flax_ms"] / row[f"{v}_ms"])
      assert row[f"{v}_loss"] == pytest.approx(row["flax_loss"], rel=1e-4)
  assert row["norm_share"] == pytest.approx((row["flax_ms"] - row["identity_ms"]) / row["flax_ms"])
  assert row["norm_ms_affine"] == pytest.approx(row["flax_ms"] - row["affine_ms"])
  # The variants differ in their norms only: the same parameters (the affine
  # stand-in's too), less the identities' norms.
  assert row["ours_params"] == row["flax_params"] == row["affine_params"] > row["identity_params"]
  text = capsys.readouterr().out
  assert "norms:" in text and "traced:" in text
  # One round pairs nothing: no interval.
  assert row["ours_saves_paired"] is None and row["ours_saves_vs_affine_paired"] is None
  # The op-time profile: every variant's, split into matmuls and the rest.
  assert row["profile_rounds"] == 1
  for v in row["variants"]:
    op = row[f"{v}_op_ms"]
    assert op["matmul"] > 0 and op["other"] > 0
    assert op["ops"] == pytest.approx(op["matmul"] + op["other"])
  flax_other, id_other = row["flax_op_ms"]["other"], row["identity_op_ms"]["other"]
  if flax_other > id_other:
    assert row["ours_saves_by_op_time"] == pytest.approx(
        (flax_other - row["ours_op_ms"]["other"]) / (flax_other - id_other))
  assert result["info"]["keep_freed_memory"] is False  # not asked for: the process's allocator untouched


def test_saves_interval_from_paired_rounds():
  """The saved share from paired rounds: a slow spell common to a round cancels; the interval covers the truth."""
  rng = np.random.default_rng(3)
  spell = rng.normal(0.0, 60.0, size=40)  # the machine's speed, shared by a round's steps
  flax, base, variant = (t + spell + rng.normal(0.0, 4.0, size=40) for t in (1200.0, 1150.0, 1160.0))
  estimate, low, high = bench_lib.saves_interval(flax, variant, base)
  assert low <= 0.8 <= high  # the truth: (1200 - 1160) / (1200 - 1150)
  assert high - low < 0.4  # the +-60 ms spells would swamp the 50 ms norm time unpaired
  assert low <= estimate <= high
  assert bench_lib.saves_interval(flax, variant, base) == (estimate, low, high)  # fixed seed
  # Exact rounds: a point; too few rounds or no norm time: None.
  assert bench_lib.saves_interval([3, 3, 3], [1, 1, 1], [1, 1, 1]) == (1.0, 1.0, 1.0)
  assert bench_lib.saves_interval(flax[:2], variant[:2], base[:2]) is None
  assert bench_lib.saves_interval(flax, variant, flax + 1.0) is None
  with pytest.raises(ValueError, match="rounds"):
    bench_lib.saves_interval(flax, variant[:-1], base)


def test_bench_models_tuned_variants_trace_under_their_override():
  """``base@key=value``: the base variant's model, its step traced under config.override."""
  bench_models = _load_script("bench_models.py")
  from jax_normgrad.pallas import config
  assert bench_models.split_variant("fused@gpu_nhwc_split=False@gpu_nhwc_max_tile_fwd=4096") == (
      "fused", {"gpu_nhwc_split": False, "gpu_nhwc_max_tile_fwd": 4096})
  assert bench_models.split_variant("ours") == ("ours", {})
  # A step per variant (as training_step makes), reading the tuning while it is traced.
  step = lambda: jax.jit(lambda x: x * config.interpret_programs())
  x = jnp.ones((2,), jnp.float32)
  compiled = bench_models.compile_steps({"ours": (step(), (x,)),
                                         "ours@interpret_programs=7": (step(), (x,))})
  assert float(compiled["ours"][0](x)[0]) == config.interpret_programs()
  assert float(compiled["ours@interpret_programs=7"][0](x)[0]) == 7.0


def test_bench_models_transformer_variants_lower_to_their_kernels():
  """The pre-norm stack's variants, lowered only (no compile): the fused add + norm is one kernel."""
  pytest.importorskip("flax")
  bench_models = _load_script("bench_models.py")
  calls = {}
  causal = bench_models.MODELS["gpt2"][1]["quick"]  # GPT-2's mask too
  for v in bench_models.TRANSFORMER_VARIANTS:
    model, x, target = bench_models.transformer_setup(v, "layer", causal)
    params = bench_models.init_params(model, x)
    step = jax.jit(lambda p, x, t, model=model: jax.grad(
        lambda p: jnp.mean(jnp.square(model.apply(p, x) - t)))(p))
    calls[v] = bench_lib.custom_calls(step.lower(params, x, target).as_text())
  assert calls["flax"] == calls["identity"] == calls["affine"] == 0
  # Per block two adds + norms, and the first norm: add_layer_norm's forward and
  # backward replace the drop-in's, each add one kernel less XLA pass.
  assert 0 < calls["ours"] <= calls["dropin"]


def test_bench_models_realistic_sizes_are_the_issues():
  """Issue 52's sizes: an SD-class UNet (64x64 latent, 320/640/1280, 32 groups, batch 8), GPT-2
  small (12 x 768, 1024 causal tokens, batch 16), DiT-B (12 x 768, 256 tokens, batch 64); each
  model's norms as built (shapes only: no step is compiled)."""
  pytest.importorskip("flax")
  bm = _load_script("bench_models.py")
  sd, gpt2, dit = (bm.MODELS[n][1]["full"] for n in ("sd_unet", "gpt2", "dit_b"))
  assert (sd.batch, sd.side, sd.channels, sd.groups, sd.in_channels) == (
      8, 64, (320, 640, 1280), 32, 4)
  assert (gpt2.batch, gpt2.tokens, gpt2.width, gpt2.blocks, gpt2.causal) == (
      16, 1024, 768, 12, True)
  assert (dit.batch, dit.tokens, dit.width, dit.blocks, dit.causal) == (64, 256, 768, 12, False)
  assert bm.model_names("realistic,unet") == ["sd_unet", "gpt2", "dit_b", "unet"]
  assert bm.model_names("all") == ["unet", "transformer"]
  with pytest.raises(ValueError, match="--model"):
    bm.model_names("gpt3")
  assert bm.model_size("gpt2", quick=False, size=None, gpu=False) == ("full", gpt2)
  assert bm.model_size("unet", quick=False, size=None, gpu=True) == ("gpu", bm.UNET_SIZES["gpu"])
  assert bm.model_size("dit_b", quick=True, size="gpu", gpu=True)[0] == "quick"
  assert bm.unet_norm_shapes(sd)[:2] == ["8x64x64x320 (4x)", "8x32x32x320 (1x)"]
  model, x, _ = bm.unet_setup("flax", sd, jnp.bfloat16)
  params = jax.eval_shape(model.init, jax.random.key(0), x)["params"]
  assert x.shape == (8, 64, 64, 4) and x.dtype == jnp.bfloat16
  norms = [k for k in jax.tree_util.tree_flatten_with_path(params)[0]
           if "GroupNorm" in jax.tree_util.keystr(k[0]) and k[0][-1].key == "scale"]
  assert len(norms) == 13
  for name, size in (("gpt2", gpt2), ("dit_b", dit)):
    model, x, _ = bm.transformer_setup("flax", "layer", size, jnp.bfloat16)
    params = jax.eval_shape(model.init, jax.random.key(0), x)["params"]
    assert x.shape == (size.batch, size.tokens, 768) and model.causal == size.causal
    assert 84e6 < bm.count_params(params) < 86e6, name  # 12 blocks of 768, no embeddings
    assert sum("LayerNorm" in jax.tree_util.keystr(k) for k, _ in
               jax.tree_util.tree_flatten_with_path(params)[0]) == 2 * 25  # scale and bias


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_realistic_model_norms_lower_for_cuda(dtype):
  """The realistic models' norms lower to the Triton kernels for cuda (no GPU here): the SD-class
  UNet's GroupNorm + SiLU at each level (10, 20 and 40 channels per group) and the
  transformers' residual add + LayerNorm over 16384 rows of 768, forward and backward."""
  bm = _load_script("bench_models.py")
  sd, gpt2 = bm.MODELS["sd_unet"][1]["full"], bm.MODELS["gpt2"][1]["full"]
  sds = lambda shape: jax.ShapeDtypeStruct(shape, dtype)
  check = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
  f32 = lambda t: jnp.sum(t.astype(jnp.float32))
  gn = jax.grad(lambda x, w, b: f32(jn.group_norm(x, sd.groups, w, b, channel_axis=-1,
                                                  activation="silu")), argnums=(0, 1, 2))
  add_ln = jax.grad(lambda x, r, w, b: sum(map(f32, jn.add_layer_norm(x, r, w, b))),
                    argnums=(0, 1, 2, 3))
  rows = gpt2.batch * gpt2.tokens
  cases_ = [(gn, (sds((sd.batch, sd.side >> i, sd.side >> i, c)), sds((c,)), sds((c,))))
            for i, c in enumerate(sd.channels)]
  cases_.append((add_ln, (sds((rows, gpt2.width)), sds((rows, gpt2.width)), sds((gpt2.width,)),
                          sds((gpt2.width,)))))
  for f, args in cases_:
    text = cases.export_for("cuda", jax.jit(f), args, disabled_checks=check).mlir_module()
    assert text.count("custom_call @__gpu$xla.gpu.triton") >= 3, args  # forward, backward, sums
    assert "custom_call @jax_normgrad_" not in text  # no CPU kernel


def test_bench_models_main_runs_the_realistic_models(tmp_path, monkeypatch):
  """``--model realistic --quick``: each model at its smoke size in each dtype, its default
  variants (the brief's five), a trace file of its own, a JSON row saved per model (the steps
  themselves: test_bench_models_quick_unet_reports_share_and_savings)."""
  import json
  pytest.importorskip("flax")
  bm = _load_script("bench_models.py")
  calls = []

  def measure_model(name, setups, **kw):
    calls.append((name, list(setups), kw))
    return {"model": name, "variants": list(setups)}

  monkeypatch.setattr(bm, "measure_model", measure_model)
  monkeypatch.setattr(bm, "print_row", lambda row: None)
  out = tmp_path / "m.json"
  assert bm.main(["--quick", "--model", "realistic", "--dtypes", "bfloat16,float32",
                  "--trace-calls", "2", "--out", str(out)]) == 0
  rows = json.loads(out.read_text())["rows"]
  assert [(r["name"], r["dtype"], r["size"]) for r in rows] == [
      (n, d, "quick") for d in ("bfloat16", "float32") for n in ("sd_unet", "gpt2", "dit_b")]
  for (name, variants, kw), row in zip(calls, rows):
    assert name.startswith(row["name"] + " ") and row["dtype"] in name
    assert variants == list(bm.REALISTIC_VARIANTS[bm.MODELS[row["name"]][0]])
    assert kw["trace_calls"] == 2 and kw["trace_path"] == (
        tmp_path / "m_traces" / f"{row['name']}_quick_{row['dtype']}.trace.json.gz")
  assert "causal" in calls[1][0] and "causal" not in calls[2][0]


def test_trace_steps_splits_one_trace_by_step(tmp_path):
  """Two steps in one trace: each one's ops are those inside its own annotation (a sine's step
  has no matmul, a matmul's has one)."""
  x = jnp.ones((64, 64), jnp.float32)
  steps = {}
  for name, f in (("sines", lambda x: jnp.sin(x) + 1), ("matmul", lambda x: x @ x)):
    compiled = jax.jit(f).lower(x).compile()
    steps[name] = (compiled, (x,), compiled.as_text())
  out = bench_lib.trace_steps(steps, calls=2, save_to=tmp_path / "t" / "trace.json.gz")
  assert (tmp_path / "t" / "trace.json.gz").stat().st_size > 0
  assert out["sines"]["matmul"] == 0 and out["sines"]["ops"] > 0
  assert out["matmul"]["matmul"] > 0
  for summary in out.values():
    assert summary["span"] >= summary["busy"] > 0


def test_bench_lib_tuning_changes_the_kernels_tuning():
  """bench_lib.tuning: the one way the benchmarks change a tuning; restored on exit."""
  from jax_normgrad.pallas import config
  before = config.interpret_programs()
  with bench_lib.tuning(interpret_programs=before + 4):
    assert config.interpret_programs() == before + 4
  assert config.interpret_programs() == before


def test_op_names_tells_matmul_fusions_by_their_whole_name():
  """A fusion calling ``fused_computation.1`` is not a matmul because ``fused_computation`` holds a dot."""
  hlo = "\n".join([
      "%fused_computation (p0: f32[4,4], p1: f32[4,4]) -> f32[4,4] {",
      "  ROOT %dot.0 = f32[4,4]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}",
      "}",
      "%fused_computation.1 (p0: f32[4,4], p1: f32[4,4]) -> f32[4,4] {",
      "  ROOT %add.0 = f32[4,4]{1,0} add(%p0, %p1)",
      "}",
      "ENTRY %main.1 (a: f32[4,4], b: f32[4,4]) -> f32[4,4] {",
      "  %mm = f32[4,4]{1,0} fusion(%a, %b), kind=kOutput, calls=%fused_computation",
      "  %ew = f32[4,4]{1,0} fusion(%mm, %b), kind=kLoop, calls=%fused_computation.1",
      "  ROOT %cc = f32[4,4]{1,0} custom-call(%ew), custom_call_target=\"jax_normgrad_layer_norm_fwd\"",
      "}",
  ])
  names, matmuls = bench_lib.op_names(hlo)
  assert {"mm", "ew", "cc", "dot.0", "add.0"} <= names
  assert "mm" in matmuls and "dot.0" in matmuls
  assert "ew" not in matmuls and "cc" not in matmuls


def test_gpu_mosaic_probe_runs(capsys):
  """The per-phase probe prints a line per phase of each implementation, and a failing one (no
  Mosaic GPU on this machine, or an unknown name) is reported and skipped, not raised."""
  probe = _load_script("gpu_mosaic_probe.py")
  assert probe.main(["--shapes", "8x128", "--dtype", "float32", "--impls", "xla,nosuch",
                     "--calls", "2"]) == 0
  text = capsys.readouterr().out
  assert "xla LayerNorm 8x128 float32 fwd: lower" in text
  assert "xla LayerNorm 8x128 float32 bwd: lower" in text and "ms/call" in text
  assert "nosuch 8x128: ValueError" in text


@cases.needs_mosaic_gpu
def test_gpu_mosaic_probe_stages(capsys):
  """``--stages``: the Mosaic GPU kernels once per stage cap (interpreted here), each run
  naming the stages its plans got, each phase its bandwidth."""
  probe = _load_script("gpu_mosaic_probe.py")
  assert probe.main(["--shapes", "4x256", "--dtype", "float32", "--impls", "mosaic_gpu",
                     "--stages", "2,3", "--calls", "1"]) == 0
  text = capsys.readouterr().out
  assert "mosaic_gpu_max_stages=2: stages fwd 2, bwd 2" in text
  assert "mosaic_gpu_max_stages=3: stages fwd 3, bwd 3" in text
  assert len(re.findall(r"mosaic_gpu LayerNorm 4x256 float32 (fwd|bwd): .* TB/s", text)) == 4


@cases.needs_mosaic_gpu
def test_gpu_mosaic_probe_lowered(capsys):
  """``--lowered`` (no GPU): a line per case with the XLA ops outside the kernels, and one per
  Mosaic GPU kernel with its lowering time and module size; JAX's lowering is restored."""
  from jax.experimental.mosaic.gpu import core
  rule = core._mosaic_gpu_lowering_rule
  probe = _load_script("gpu_mosaic_probe.py")
  assert probe.main(["--lowered", "--shapes", "64x256", "--dtype", "float32"]) == 0
  assert core._mosaic_gpu_lowering_rule is rule
  text = capsys.readouterr().out
  bwd = re.search(r"LayerNorm 64x256 float32 bwd: export .* XLA ops outside the kernels (\d+)",
                  text)
  assert bwd and int(bwd.group(1)) < 200, text
  assert re.search(r"  jax_normgrad_norm_bwd: lowered in [\d.]+ s, \d+ ops \(\d+ scf.for\)", text)
  assert "jax_normgrad_norm_bwd_sums: lowered" in text  # GroupNorm's


def test_gpu_trace_smoke_run(tmp_path):
  """The kernel-time trace: every function's compiled module written and its events summed
  (on CPU the host runtime's, matched to the module's instruction names)."""
  import json
  trace = _load_script("gpu_trace.py")
  assert trace.main(["--smoke", "--calls", "2", "--out", str(tmp_path)]) == 0
  kernels = json.loads((tmp_path / "kernels.json").read_text())["kernels"]
  assert set(kernels) == {name for name, _, _ in trace.jobs(smoke=True)}
  for name, table in kernels.items():
    assert (tmp_path / f"{name}.hlo.txt").read_text().startswith("HloModule")
    assert sum(us for us, _ in table.values()) > 0, name
  # The fused form's custom calls are among the events (its norms are kernels).
  assert any(k.startswith(("ffi_call", "custom-call")) for k in kernels["stack_bf16_f32stream_fused"])


def test_kernel_rows_harness_builds_and_runs(tmp_path):
  """benchmarks/kernel_rows.cc (the forward row loops alone) compiles against csrc/ and runs each op."""
  import subprocess
  exe = str(tmp_path / "kernel_rows")
  # The baseline ISA at -O1: any x86-64 CPU, a quick compile; the timings are not looked at.
  cases.build_against_csrc(str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks" /
                               "kernel_rows.cc"), exe, ["-O1", "-DJNG_ISA=generic", "-pthread"])
  for op, threads, outputs in [("ln", 1, 1), ("rms", 2, 3), ("add_ln", 2, 2), ("add_rms", 1, 1),
                               ("copy", 2, 2)]:
    out = subprocess.run([exe, op, "6", "37", str(threads), "3", str(outputs)], check=True,
                         capture_output=True, text=True).stdout
    assert f"({op} 6x37, {threads} thread" in out and len(out.split("us")[0].split()) == 5, out
    assert f"{outputs} output" in out, out
  for bad in (["nope", "6", "37", "1"], ["ln", "6", "37", "1", "3", "0"]):
    assert subprocess.run([exe, *bad], capture_output=True).returncode == 2, bad


def test_ab_builds_times_a_second_copy_of_the_kernels():
  """benchmarks/ab_builds.py against the installed build itself (an A/A run): both lowerings run."""
  import os
  import subprocess
  import sys
  from jax_normgrad import _ffi
  script = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "ab_builds.py"
  env = dict(os.environ, JAX_PLATFORMS="cpu")  # the CPU kernels, also on an accelerator machine
  rows = ("layer_norm:6x37:fwd,add_rms_norm:5x16:bwd,group_norm:2x3x3x32:grad,"
          "add_layer_norm:4x40:fwd:bfloat16:float32,group_norm+silu:2x3x3x32:bwd,"
          "group_norm_nchw+gelu:2x32x3x3:fwd:bfloat16")
  out = subprocess.run([sys.executable, str(script), _ffi._ext.__file__, "--rows", rows,
                        "--rounds", "2", "--iters", "2"], check=True, capture_output=True,
                       text=True, env=env).stdout
  for spec in rows.split(","):
    line = next(l for l in out.splitlines() if l.startswith(spec + ":"))
    assert "installed/other by round: median" in line and len(line.split("[")[1].split()) == 2, out
  bad = subprocess.run([sys.executable, str(script), _ffi._ext.__file__, "--rows", "nope:2x3:fwd"],
                       capture_output=True, text=True, env=env)
  assert bad.returncode != 0 and "expected OP:SHAPE:PASS" in bad.stderr
  bad = subprocess.run([sys.executable, str(script), _ffi._ext.__file__, "--rows",
                        "layer_norm:2x3:fwd:bfloat16:float32"], capture_output=True, text=True,
                       env=env)
  assert bad.returncode != 0 and "RESIDUAL_DTYPE (add ops)" in bad.stderr


# ----------------------------------------------------------------------------
# benchmarks/gpu_session.sh: the next GPU calls, checked without a GPU.

_SESSION = _SCRIPT.parent / "gpu_session.sh"


@pytest.mark.parametrize("plan", ["call-1", "call-2"])
def test_gpu_session_plans_fit_their_seconds(plan, tmp_path):
  """--dry-run: every stage of the plan known, each under its limit, all in the plan's seconds."""
  import subprocess
  run = subprocess.run(["bash", str(_SESSION), "--dry-run", plan], capture_output=True, text=True,
                       cwd=_SCRIPT.parent.parent, env={**os.environ, "OUT": str(tmp_path)},
                       timeout=60)
  assert run.returncode == 0, run.stdout + run.stderr
  lines = run.stdout.splitlines()
  planned = re.search(r"planned: (\d+) s of (\d+) s", run.stdout)
  assert planned and int(planned.group(1)) <= int(planned.group(2)), run.stdout
  stages = lines[0].split("stages: ")[1].split()
  assert [l.split()[0] for l in lines[1:-1]] == stages
  assert not list(tmp_path.iterdir())  # a dry run writes nothing


def test_gpu_session_plans_name_what_the_scripts_know():
  """The plans' settings name real things: gpu_sweep's configurations and rows, bench_models'
  models, variants and tuning keys, the probe's options; an unknown stage stops a dry run."""
  import subprocess
  from jax_normgrad.pallas import config
  text = _SESSION.read_text()
  settings = dict(re.findall(r': "\$\{(\w+):=(.*)\}"', text))
  sweep, bm = _load_script("gpu_sweep.py"), _load_script("bench_models.py")
  assert set(settings["SWEEP_CONFIGS"].split(",")) <= set(sweep.CONFIGS)
  assert set(settings["SWEEP_ROWS"].split(",")) <= {sweep._name(*r) for r in sweep.ROWS}
  fields = config.KEYS
  for model in re.findall(r"realistic-([a-z]\w*)", text):
    assert model in bm.MODELS, model
  for key, value in settings.items():
    if key.startswith("VARIANTS_"):
      kind = bm.MODELS[key.removeprefix("VARIANTS_")][0]
      known = bm.unet_variants() if kind == "unet" else bm.TRANSFORMER_VARIANTS
      for variant in value.split(","):
        base, tuning = bm.split_variant(variant)
        assert base in known and set(tuning) <= fields, variant
  if "PROBE_ARGS" in settings:
    args = settings["PROBE_ARGS"].split()
    assert set(args[::2]) <= {"--shapes", "--stages", "--calls", "--impls", "--dtype"}
    assert all(re.fullmatch(r"\d+x\d+", s) for s in args[args.index("--shapes") + 1].split(","))
    assert all(s.isdigit() for s in args[args.index("--stages") + 1].split(","))
  if "REALISTIC_DTYPES" in settings:
    assert set(settings["REALISTIC_DTYPES"].split(",")) <= {"bfloat16", "float32"}
  gpu = _load_script("bench_gpu.py")
  names = {f"{k} {'x'.join(map(str, shape))}" for k, shape, _ in gpu.ROWS}
  gn_only = re.search(r"only=\$\{GN_ONLY:-(.*)\}", text).group(1).split(",")
  assert set(gn_only) <= names, gn_only  # bench_gpu's --only matches these row names
  bad = subprocess.run(["bash", str(_SESSION), "--dry-run", "60", "nosuch"], capture_output=True,
                       text=True, cwd=_SCRIPT.parent.parent, timeout=60)
  assert bad.returncode == 2 and "unknown stage nosuch" in bad.stdout


def test_bench_rewrite_quick(tmp_path):
  """benchmarks/bench_rewrite.py --quick: the transformer under the rewrite, the drop-ins and flax."""
  pytest.importorskip("flax")
  import bench_rewrite  # noqa: E402  (the benchmarks' sibling script)
  out = tmp_path / "rewrite.json"
  assert bench_rewrite.main(["--quick", "--model", "transformer", "--out", str(out)]) == 0
  import json
  (row,) = json.loads(out.read_text())["rows"]
  assert row["rewrite_custom_calls"] > 0 and row["flax_custom_calls"] == 0
  assert row["trace_rewrite_s"] > 0 and row["compile_s"] > 0


def test_bench_rewrite_depth_sweep(tmp_path):
  """benchmarks/bench_rewrite.py --depth-sweep: the norms counted at each depth, both traces timed."""
  pytest.importorskip("flax")
  import bench_rewrite  # noqa: E402  (the benchmarks' sibling script)
  out = tmp_path / "depth.json"
  assert bench_rewrite.main(["--depth-sweep", "2,4", "--repeats", "1", "--out", str(out)]) == 0
  import json
  rows = json.loads(out.read_text())["rows"]
  assert [(r["blocks"], r["norms"]) for r in rows] == [(1, 3), (2, 5)]
  assert all(r["trace_plain_s"] > 0 and r["trace_rewrite_s"] > 0 for r in rows)
