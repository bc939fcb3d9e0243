"""python -m jax_normgrad: exit status, the JSON report, the progress bar, --plot."""

from __future__ import annotations

import json
import subprocess
import sys

import jax.numpy as jnp
import pytest

import cases
from jax_normgrad import __main__ as cli
from jax_normgrad import _bench


def test_cli_json_parses_and_exits_0():
  run = subprocess.run([sys.executable, "-m", "jax_normgrad", "--json", "--no-timing"],
                       capture_output=True, text=True)
  assert run.returncode == 0, run.stderr[-3000:]
  report = json.loads(run.stdout)
  assert report["ok"] is True and report["platform"] == cases.PLATFORM
  kernel = {"cpu": "ffi", "cuda": "triton", "rocm": "triton", "tpu": "mosaic_tpu"}[cases.PLATFORM]
  assert report["implementations"] == {
      "jax_normgrad_group_norm_bwd": kernel, "jax_normgrad_group_norm_fwd": kernel,
      "jax_normgrad_layer_norm_bwd": kernel, "jax_normgrad_layer_norm_fwd": kernel}
  assert set(report["primitive_ops"]) == set(report["implementations"]) == set(report["why"])
  assert all(w.startswith(f"the default on {cases.PLATFORM} (") for w in report["why"].values())
  assert set(report["settings"]) == {"JAX_NORMGRAD_FORWARD", "JAX_NORMGRAD_GPU_BACKEND"}
  assert {"jax", "jaxlib", "jax_normgrad", "python"} <= set(report["versions"])
  ops = {c["op"] for c in report["checks"]}
  for op in ("layer_norm_backward", "grad(layer_norm)", "rms_norm_fwd", "rms_norm_backward",
             "grad(rms_norm)", "group_norm_backward NHWC", "layer_norm_grad",
             "layer_norm_backward_from_normalized"):
    assert op in ops
  assert all(c["ok"] for c in report["checks"]) and report["timings"] == []


def test_default_implementations_is_what_the_cli_reports():
  import jax_normgrad as jn  # pylint: disable=g-import-not-at-top
  impls = jn.default_implementations()
  assert impls == cli._report_platform()["implementations"]
  assert jn.default_implementations(cases.PLATFORM) == impls
  assert set(jn.default_implementations("cpu").values()) == {"ffi"}
  assert set(jn.default_implementations("tpu").values()) == {"mosaic_tpu"}
  with pytest.raises(ValueError, match="platform"):
    jn.default_implementations("gpu")  # jax.default_backend()'s word, not a lowering platform


@pytest.fixture
def tiny(monkeypatch):
  """The CLI with two tiny workloads and no checks, so timing and plotting run in seconds."""
  monkeypatch.setattr(cli, "_checks", lambda: [{"op": "x", "dtype": "float32",
                                                "max_rel_err": 0.0, "ok": True}])
  monkeypatch.setattr(cli, "_workloads", lambda quick: [
      lambda: _bench.layer_norm_workload(64, 128, jnp.float32),
      lambda: _bench.rms_norm_workload(64, 128, jnp.float32)])


def test_cli_timing_json_progress_and_plot(tiny, tmp_path, capsys):
  png = tmp_path / "timings.png"
  assert cli.main(["--json", "--plot", str(png)]) == 0
  out, err = capsys.readouterr()
  report = json.loads(out)
  assert [r["workload"] for r in report["timings"]] == ["LayerNorm 64x128 float32",
                                                        "RMSNorm 64x128 float32"]
  for r in report["timings"]:
    assert all(r[k] > 0 for k in ("bwd_ours_ms", "bwd_xla_ms", "grad_ours_ms", "grad_xla_ms"))
  assert "timing" in err  # the progress bar, on stderr
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_text_progress_without_tqdm(tiny, monkeypatch, capsys):
  monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm fails
  monkeypatch.setitem(sys.modules, "tqdm.auto", None)
  monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # a terminal: one line, rewritten
  assert cli.main(["--quick"]) == 0
  out, err = capsys.readouterr()
  assert "4/8" in err and "[####################] 8/8" in err.splitlines()[-1]
  assert err.count("\r") == 8
  assert "LayerNorm 64x128 float32" in out and "All checks passed." in out


def test_cli_progress_in_a_log_is_one_line_per_step(tiny, capsys):
  """stderr not a terminal (a log, CI; tqdm installed or not): plain lines, no \\r frames."""
  assert cli.main(["--quick"]) == 0
  _, err = capsys.readouterr()
  lines = [line for line in err.splitlines() if line.startswith("timing ")]
  assert "\r" not in err
  assert [line.split()[1] for line in lines] == [f"{i}/8" for i in range(1, 9)]
  assert lines[-1].endswith("RMSNorm 64x128 float32: grad xla")


def test_cli_plot_without_matplotlib_is_a_clear_error(monkeypatch, capsys):
  monkeypatch.setattr(cli, "_have_matplotlib", lambda: False)
  with pytest.raises(SystemExit) as exit_:
    cli.main(["--plot", "x.png"])
  assert exit_.value.code == 2
  assert "--plot needs matplotlib" in capsys.readouterr().err
