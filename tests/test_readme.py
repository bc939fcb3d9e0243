"""The README's set-up commands: .ci/run runs exactly the test command."""

import pathlib
import re

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
  block = re.findall(r"```python\n(.+?)\n```", (ROOT / "README.md").read_text(), re.S)[0]
  namespace = {}
  exec(compile(block, "README.md", "exec"), namespace)
  grads = namespace["grads"]
  assert set(grads) == {"ln_w", "ln_b", "proj", "gn_w", "gn_b"}
