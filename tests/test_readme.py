"""The README: its set-up commands (.ci/run runs exactly the test command), its example, its links."""

import contextlib
import io
import pathlib
import re

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _commands():
  return re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text())


def test_ci_runs_the_readme_test_command():
  commands = _commands()
  test_cmd = next(c for c in commands if "pytest" in c)
  ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
  assert test_cmd in ci_lines


def test_readme_main_job_command():
  assert "pip install . && python -m jax_normgrad" in _commands()


def test_readme_example_runs():
  """The example's gradients are not zero, agree with XLA's autodiff, and it says what ran."""
  block = re.findall(r"```python\n(.+?)\n```", (ROOT / "README.md").read_text(), re.S)[0]
  namespace = {}
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    exec(compile(block, "README.md", "exec"), namespace)  # pylint: disable=exec-used
  ours, xla = namespace["ours"], namespace["xla"]
  assert set(ours) == set(xla) == {"w", "b", "proj"}
  for name in ours:
    ref = np.asarray(xla[name])
    assert np.abs(ref).max() > 1e-3, name  # a gradient worth comparing
    np.testing.assert_allclose(np.asarray(ours[name]), ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
  lines = out.getvalue().splitlines()
  import jax  # pylint: disable=g-import-not-at-top
  import jax_normgrad as jn  # pylint: disable=g-import-not-at-top
  platform = jax.default_backend()
  assert lines[0] == f"{platform} {jn.default_implementations()['jax_normgrad_layer_norm_bwd']}"
  if platform == "cpu":
    assert lines[0] == "cpu ffi"
  assert [line.split()[0] for line in lines[1:]] == ["w", "b", "proj"]


def _slug(heading: str) -> str:
  """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
  return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_benchmark_links_resolve():
  """Every link to a section of BENCHMARKS.md (or its history) names a heading there."""
  docs = [ROOT / "README.md", ROOT / "BENCHMARKS.md", ROOT / "BENCHMARKS-history.md",
          *sorted((ROOT / "docs").glob("*.md"))]
  anchors = {}
  for name in ("BENCHMARKS.md", "BENCHMARKS-history.md"):
    text = (ROOT / name).read_text()
    anchors[name] = {_slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}
  links = 0
  for doc in docs:
    text = doc.read_text()
    for target, anchor in re.findall(r"(BENCHMARKS(?:-history)?\.md)#([\w-]+)", text):
      links += 1
      assert anchor in anchors[target], (doc.name, target, anchor)
    for anchor in re.findall(r"\]\(#([\w-]+)\)", text):  # within the same file
      if doc.name in anchors:
        assert anchor in anchors[doc.name], (doc.name, anchor)
  assert links >= 6  # the README's figures link to their sections


def test_version_stage_test_ids_exist():
  """Every test the version stages (.ci/oldest-jax, .ci/newest-jax) name still exists.

  They name single tests (.ci/lib.sh's smoke of the op suites, and .ci/version-tests.txt's
  coverage-selected cases of the kernel-matrix modules): one renamed test makes pytest
  collect nothing under xdist, and the stage fails with "no tests ran". Collected here, in
  the README's test command, the failure names the missing id."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  out = subprocess.run(
      ["bash", "-c", ". .ci/lib.sh && version_stage_tests && stage_benchmark_tests"], cwd=ROOT,
      check=True, capture_output=True, text=True).stdout.split("\n")
  ids = [a for a in out if "::" in a and not a.startswith("--")]
  assert len(ids) > 20, ids
  run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:xdist",
                        "-p", "no:cacheprovider", *ids], cwd=ROOT, capture_output=True, text=True)
  assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
