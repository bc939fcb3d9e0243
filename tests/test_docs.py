"""The docs name only what the repository has: files, Python names, Markdown links and anchors.

Read: README.md, BENCHMARKS.md, docs/*.md, the notebooks' Markdown cells, the
comments and docstrings of the Python sources, and the shell, CMake and C++
sources' text. Checked:

* repo-relative paths (``tests/cases.py``, ``jax_normgrad/pallas/{gpu,tpu}.py``,
  ``pallas/kernels.py``, ``.ci/run``, a glob such as ``jax_normgrad/pallas/mosaic_gpu_*.py``)
  exist; a file name written without its folder (``guarantees.md``, ``gpu_target.py``) is
  some file's name in the repository;
* dotted names in the package (``jax_normgrad.pallas.common``) resolve (imported, then
  attributes);
* a module's attribute named with its path (``tests/cases.child_env``) or as
  ``_module.attr`` (the package's private modules: ``_dispatch.choose``)
  is defined in that module (its source's top-level names, then class bodies);
* Markdown links ``[text](target)`` and ``[ref]: target`` resolve, their
  ``#anchor`` to a heading of the target (GitHub's slugs), and so does any
  ``docs/spec.md#bad-input`` written in prose, comments or docstrings.

BENCHMARKS-history.md is history: the files its runs used may be gone.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import io
import json
import os
import pathlib
import re
import sys
import tokenize

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

#: Top-level folders whose paths are checked, and the package's subpackages, which docstrings
#: name relative to it (``pallas/kernels.py``).
ROOT_DIRS = ("jax_normgrad", "tests", "benchmarks", "docs", "csrc", "examples", "notebooks",
             "cmake", ".ci")
PACKAGE_DIRS = ("pallas", "ops", "primitives")
#: Folders that are not read, each with why; nor are hidden ones other than .ci (git, caches,
#: virtual environments).
SKIP_DIRS = {
    "build": "build output (git-ignored)",
    "dist": "built wheels (git-ignored)",
    "tests/third_party": "vendored tests; its README names paths of the libraries' repositories",
    "benchmarks/recorded": "recorded results (JSON), named by the benchmarks that wrote them",
}
#: Paths that are named but need not exist in a checkout, each with why.
ALLOWED_MISSING = {
    "benchmarks/results": "the benchmarks' output folder, git-ignored, created by a run",
    "jax_normgrad/_jax_normgrad": "the compiled extension: built into the installed package",
}
#: The file names checked where written without a folder (``api.md``, ``gpu_target.py``);
#: others (``env.txt``, ``gpu.json``) are mostly files a run writes.
BARE_EXTENSIONS = ("md", "py", "ipynb")

_SEGMENT = r"(?:[\w.*-]|\{[\w.,-]+\})+"
_PATH = re.compile(
    rf"(?<![\w./$-])((?:{'|'.join(re.escape(d) for d in ROOT_DIRS + PACKAGE_DIRS)})"
    rf"(?:/{_SEGMENT})+/?)")
_BARE_FILE = re.compile(rf"(?<![\w./$<-])([\w-]+\.(?:{'|'.join(BARE_EXTENSIONS)}))(?![\w/-])")
_DOTTED = re.compile(r"(?<![\w.])(jax_normgrad(?:\.[A-Za-z_]\w*)+)")
_PRIVATE_ATTR = re.compile(r"(?<![\w./])(_[a-z]\w*)((?:\.[A-Za-z_]\w*)+)")
_MD_LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)|^\[[^\]\n]+\]:\s*(\S+)", re.M)
_MD_ANCHOR = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[\w.-]+\.md)#([\w-]+)")


def _skipped(path: pathlib.Path, folder: bool) -> bool:
  rel = path.relative_to(ROOT)
  folders = rel.parts if folder else rel.parts[:-1]
  return any(rel.as_posix() == d or rel.as_posix().startswith(d + "/") for d in SKIP_DIRS) or any(
      (part.startswith(".") and part != ".ci") or part == "__pycache__" for part in folders)


@functools.cache
def _files() -> tuple[pathlib.Path, ...]:
  out = []
  for folder, dirs, files in os.walk(ROOT):
    here = pathlib.Path(folder)
    dirs[:] = sorted(d for d in dirs if not _skipped(here / d, folder=True))
    out += [here / f for f in sorted(files) if not _skipped(here / f, folder=False)]
  return tuple(out)


@functools.cache
def _basenames() -> frozenset[str]:
  return frozenset(p.name for p in _files())


def _python_text(path: pathlib.Path) -> str:
  """A Python source's comments and docstrings (and module-level text constants, doc fragments)."""
  source = path.read_text()
  parts = [t.string for t in tokenize.generate_tokens(io.StringIO(source).readline)
           if t.type == tokenize.COMMENT]
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, (ast.Expr, ast.Assign)) and isinstance(node.value, ast.Constant) and (
        isinstance(node.value.value, str)):
      parts.append(node.value.value)
  return "\n".join(parts)


def _markdown_of_notebook(path: pathlib.Path) -> str:
  cells = json.loads(path.read_text())["cells"]
  return "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")


def _without_code_blocks(markdown: str) -> str:
  return re.sub(r"^```.*?^```", "", markdown, flags=re.M | re.S)


@functools.cache
def _docs() -> tuple[tuple[pathlib.Path, str, bool], ...]:
  """(file, the text read, whether it is Markdown) of every file the checks read."""
  out = []
  for path in _files():
    rel = path.relative_to(ROOT).as_posix()
    if rel == "BENCHMARKS-history.md":
      continue
    if path.suffix == ".md":
      out.append((path, path.read_text(), True))
    elif path.suffix == ".ipynb":
      out.append((path, _markdown_of_notebook(path), True))
    elif path.suffix == ".py":
      out.append((path, _python_text(path), False))
    elif path.suffix in (".sh", ".cc", ".h", ".toml", ".txt") or rel.startswith(".ci/"):
      out.append((path, path.read_text(), False))
  return tuple(out)


def _expand(pattern: str) -> list[str]:
  """``a/{b,c}.py`` -> ``a/b.py``, ``a/c.py`` (shell brace expansion)."""
  m = re.search(r"\{([^{}]*)\}", pattern)
  if not m:
    return [pattern]
  return [e for alt in m.group(1).split(",")
          for e in _expand(pattern[:m.start()] + alt + pattern[m.end():])]


def _module_path(rel: str) -> pathlib.Path | None:
  """The repository file of a repo- or package-relative path (None: none)."""
  for base in ((ROOT, ROOT / "jax_normgrad") if rel.split("/")[0] in PACKAGE_DIRS else (ROOT,)):
    if "*" in rel:
      found = sorted(base.glob(rel))
      if found:
        return found[0]
    elif (base / rel).exists():
      return base / rel
  return None


@functools.cache
def _defined_names(path: pathlib.Path) -> dict[str, frozenset[str]]:
  """A Python file's top-level names (key ""), and each top-level class's body names."""
  tree = ast.parse(path.read_text())

  def names(body):
    out = set()
    for node in body:
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        out.add(node.name)
      elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
          out.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
      elif isinstance(node, (ast.Import, ast.ImportFrom)):
        out.update((a.asname or a.name).split(".")[0] for a in node.names)
      elif isinstance(node, (ast.If, ast.Try, ast.With)):
        out |= names(getattr(node, "body", []) + getattr(node, "orelse", []) +
                     [n for h in getattr(node, "handlers", []) for n in h.body])
    return out

  result = {"": frozenset(names(tree.body))}
  for node in tree.body:
    if isinstance(node, ast.ClassDef):
      result[node.name] = frozenset(names(node.body))
  return result


def _has_attrs(path: pathlib.Path, attrs: list[str]) -> bool:
  defined = _defined_names(path)
  if attrs[0] not in defined[""]:
    return False
  return len(attrs) == 1 or attrs[0] not in defined or attrs[1] in defined[attrs[0]]


def _check_path(token: str) -> str | None:
  """None where ``token`` (a path, maybe ending in ``.attr``) names what the repository has."""
  token = token.rstrip(".,/")
  if any(token.startswith(a) for a in ALLOWED_MISSING):
    return None
  for rel in _expand(token):
    if _module_path(rel) is not None:
      continue
    # tests/cases.child_env: a module's attribute, named by the module's path.
    head, _, tail = rel.rpartition("/")
    module, *attrs = tail.split(".")
    source = _module_path(f"{head}/{module}.py") if attrs else None
    if source is None or not _has_attrs(source, attrs):
      return rel
  return None


def _resolve_dotted(name: str) -> bool:
  parts = name.split(".")
  obj = None
  for i in range(len(parts), 0, -1):
    try:
      obj = importlib.import_module(".".join(parts[:i]))
    except ImportError:
      continue
    for attr in parts[i:]:
      if not hasattr(obj, attr):
        try:  # A submodule not imported by its package.
          obj = importlib.import_module(f"{obj.__name__}.{attr}")
        except (ImportError, AttributeError):
          return False
      else:
        obj = getattr(obj, attr)
    return True
  return False


@functools.cache
def _private_modules() -> dict[str, tuple[pathlib.Path, ...]]:
  """The package's private modules by name (``_dispatch`` -> its file)."""
  out: dict[str, list[pathlib.Path]] = {}
  for p in (ROOT / "jax_normgrad").rglob("_*.py"):
    if p.stem != "__init__":
      out.setdefault(p.stem, []).append(p)
  return {k: tuple(v) for k, v in out.items()}


def _slug(heading: str) -> str:
  """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
  return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@functools.cache
def _anchors(path: pathlib.Path) -> frozenset[str]:
  text = _markdown_of_notebook(path) if path.suffix == ".ipynb" else path.read_text()
  return frozenset(_slug(h.replace("`", "")) for h in
                   re.findall(r"^#+ (.+?)\s*#*$", _without_code_blocks(text), re.M))


def _check_link(doc: pathlib.Path, target: str) -> str | None:
  if re.match(r"[a-z]+:", target):  # https:, mailto:
    return None
  file, _, anchor = target.partition("#")
  path = (doc.parent / file).resolve() if file else doc
  if not path.exists():
    return target
  if anchor and path.suffix in (".md", ".ipynb") and anchor not in _anchors(path):
    return target
  return None


def _problems() -> tuple[list[str], dict[str, int]]:
  problems, counts = [], dict(paths=0, files=0, dotted=0, private=0, links=0, anchors=0)
  for path, text, markdown in _docs():
    rel = path.relative_to(ROOT).as_posix()
    prose = _without_code_blocks(text) if markdown else text
    for token in _PATH.findall(text):
      counts["paths"] += 1
      if (bad := _check_path(token)) is not None:
        problems.append(f"{rel}: no such file or attribute: {bad}")
    for name in _BARE_FILE.findall(text):
      counts["files"] += 1
      if name not in _basenames():
        problems.append(f"{rel}: no file named {name}")
    for name in _DOTTED.findall(text):
      counts["dotted"] += 1
      if not _resolve_dotted(name.rstrip(".")):
        problems.append(f"{rel}: {name} does not resolve")
    for module, attrs in _PRIVATE_ATTR.findall(text):
      sources = _private_modules().get(module)
      if sources and attrs[1:] not in BARE_EXTENSIONS:  # not _layers.py
        counts["private"] += 1
        if not any(_has_attrs(s, attrs.split(".")[1:]) for s in sources):
          problems.append(f"{rel}: {module}{attrs} is not defined in {module}.py")
    if markdown:
      for link in _MD_LINK.findall(prose):
        counts["links"] += 1
        if (bad := _check_link(path, link[0] or link[1])) is not None:
          problems.append(f"{rel}: broken link {bad}")
    for file, anchor in _MD_ANCHOR.findall(prose):
      target = next((p for p in (path.parent / file, ROOT / file, ROOT / "docs" / file)
                     if p.exists()), None)
      counts["anchors"] += 1
      if target is None or anchor not in _anchors(target.resolve()):
        problems.append(f"{rel}: no heading for {file}#{anchor}")
  return problems, counts


def test_docs_name_only_what_the_repository_has():
  problems, counts = _problems()
  assert not problems, "\n".join(problems)
  # The checks read what they should: each kind of reference is found in numbers.
  assert all(n >= 10 for n in counts.values()), counts


@pytest.mark.parametrize("text,bad", [
    ("the contract, `SPEC.md`", "no file named SPEC.md"),
    ("see `tests/no_such_module.py`", "no such file or attribute: tests/no_such_module.py"),
    ("`jax_normgrad/ops/{layer_norm,no_such}.py`", "jax_normgrad/ops/no_such.py"),
    ("`tests/cases.no_such_helper`", "tests/cases.no_such_helper"),
    ("`jax_normgrad.no_such_function`", "jax_normgrad.no_such_function does not resolve"),
    ("`_dispatch.no_such_rule`", "_dispatch.no_such_rule is not defined"),
    ("[a link](no_such.md)", "broken link no_such.md"),
    ("[a section](api.md#no-such-heading)", "no heading for api.md#no-such-heading"),
])
def test_a_doc_naming_what_is_missing_fails(text, bad, monkeypatch):
  """Each check fails on a doc that names what is missing (here a docs/ page with ``text``)."""
  doc = ROOT / "docs" / "api.md"
  monkeypatch.setattr(sys.modules[__name__], "_docs", lambda: ((doc, text, True),))
  problems, _ = _problems()
  assert any(bad in p for p in problems), problems


def test_what_exists_passes(monkeypatch):
  text = ("`tests/cases.child_env`, `pallas/kernels.py`, `jax_normgrad/{flax,nnx}.py`, "
          "`jax_normgrad.layer_norm`, `_validation.check_eps`, [spec](spec.md#bad-input), "
          "`mosaic_gpu_*.py`, `jax_normgrad/pallas/mosaic_gpu_*.py`, README.md")
  doc = ROOT / "docs" / "api.md"
  monkeypatch.setattr(sys.modules[__name__], "_docs", lambda: ((doc, text, True),))
  assert _problems()[0] == []


# ----------------------------------------------------------------------------
# The docs' tables of code facts, compared with the code.


def _table(path: pathlib.Path, header: str) -> list[list[str]]:
  """The rows (cells, stripped) of the Markdown table of ``path`` whose header row starts with
  ``header``."""
  lines = path.read_text().splitlines()
  start = next(i for i, line in enumerate(lines) if line.startswith(header))
  rows = []
  for line in lines[start + 2:]:
    if not line.startswith("|"):
      break
    rows.append([c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]])
  return rows


def _quoted(cell: str) -> list[str]:
  """The implementation names a cell lists, in order (backticked, with or without quotes)."""
  return re.findall(r'`"?(\w+)"?`', cell)


def test_dispatch_tables_are_the_dispatchers():
  """docs/dispatch.md's implementations are ``_dispatch.IMPLEMENTATIONS``, and its preference
  table is ``_dispatch.preferences`` for every platform and GPU backend setting."""
  from jax_normgrad import _dispatch, _platforms, _settings  # pylint: disable=g-import-not-at-top
  doc = ROOT / "docs" / "dispatch.md"
  assert [_quoted(r[0])[0] for r in _table(doc, "| `implementation=`")] == list(
      _dispatch.IMPLEMENTATIONS)
  told = {}
  for label, none, pallas in _table(doc, "| platform | `None` tries"):
    platform = label.split(",")[0]
    backend = "mosaic_gpu" if "JAX_NORMGRAD_GPU_BACKEND=mosaic_gpu" in label else None
    none = _quoted(none)
    told[platform, backend] = (none, none if pallas == "the same" else _quoted(pallas))
  expected = {}
  for platform in _platforms.PLATFORMS:
    for backend in (None,) + _settings.CHOICES[_settings.GPU_BACKEND_ENV]:
      settings = _settings.Settings(gpu_backend=backend)
      prefs = tuple(list(_dispatch.preferences(platform, i, settings)) for i in (None, "pallas"))
      if backend is None or prefs != expected[platform, None]:
        expected[platform, backend] = prefs
  assert told == expected


def test_the_platform_and_activation_tables_are_the_code():
  """docs/api.md's platform table names each platform's default implementation first, and every
  implementation of its preference list; docs/spec.md's activations are
  ``_activations.ACTIVATIONS``."""
  from jax_normgrad import _activations, _dispatch, _settings  # pylint: disable=g-import-not-at-top
  doc = ROOT / "docs" / "api.md"
  platforms = {"CPU": "cpu", "NVIDIA GPU": "cuda", "AMD GPU": "rocm", "TPU": "tpu"}
  rows = _table(doc, "| platform | `implementation=None` runs")
  assert [r[0] for r in rows] == list(platforms)
  for label, runs, also in rows:
    preferences = _dispatch.preferences(platforms[label], None, _settings.Settings())
    assert _quoted(runs)[0] == preferences[0], label
    named = {n for n in _quoted(runs) + _quoted(also) if n in _dispatch.IMPLEMENTATIONS}
    assert set(preferences) <= named, label
  assert tuple(_quoted(r[0])[0] for r in _table(ROOT / "docs" / "spec.md", "| activation |")) == (
      _activations.ACTIVATIONS)


def test_the_config_fields_the_docs_set_exist():
  """Every configuration field docs/api.md sets (``config.override(field=...)``, a backend
  configuration's keyword) is a field of a backend's configuration."""
  from jax_normgrad.pallas import backend_config  # pylint: disable=g-import-not-at-top
  fields = {f.name for c in (backend_config.TritonConfig, backend_config.MosaicGpuConfig,
                             backend_config.MosaicTpuConfig) for f in dataclasses.fields(c)}
  text = (ROOT / "docs" / "api.md").read_text()
  calls = re.findall(r"(?:override|Config)\(([^()]*)", text)
  named = {k for call in calls for k in re.findall(r"(\w+)=", call)}
  named |= {n for n in re.findall(r"`(\w+)`", text) if re.match(r"(gpu|tpu|mosaic_gpu)_", n)
            and not n.endswith(("_plan", "_pieces", "_ctas"))}
  assert named and named <= fields, named - fields


#: The op suites: modules with one base class per op, subclassed per implementation.
OP_SUITES = ("test_layer_norm.py", "test_rms_norm.py", "test_group_norm.py", "test_add_norm.py",
             "test_layer_norm_grad.py", "test_layer_norm_options.py", "test_higher_order.py")


def _where_tested() -> list[list[str]]:
  return _table(ROOT / "docs" / "development.md", "| op | C++ FFI")


def test_where_each_op_is_tested_names_what_exists():
  """docs/development.md's op x backend table names only test modules, classes and tests that
  exist, and names every op suite's class of an implementation."""
  rows = _where_tested()
  assert len(rows) >= 6 and all(len(r) == 6 for r in rows)
  named = set()
  for row in rows:
    assert row[1] and row[5], row[0]  # the C++ kernels and the reference test every op
    for cell in row[1:]:
      for module, name in re.findall(r"`(test_\w+\.py)(?:::(\w+))?`", cell):
        path = ROOT / "tests" / module
        assert path.exists(), module
        if name:
          assert name in _defined_names(path)[""], f"{module}::{name}"
          named.add(f"{module}::{name}")
  for module in OP_SUITES:
    tree = ast.parse((ROOT / "tests" / module).read_text())
    suites = {c.name for c in tree.body if isinstance(c, ast.ClassDef) and c.name.startswith("Test")
              and c.bases}
    assert suites and {f"{module}::{s}" for s in suites} <= named, module
