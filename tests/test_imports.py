"""The import graph of ``jax_normgrad/`` has no circle: each module stands on those below it.

Read from the source (the AST of every module), not by importing: importing
any submodule runs ``jax_normgrad/__init__.py`` first, which imports most of
the package in one fixed order, so a fresh interpreter would not see a circle
that this order happens to survive. An edge is an import of a module of the
package anywhere in a module, at the top or inside a function (a deferred
import is still a dependency: it only hides the circle until the call):

* ``import a.b.c``, ``from a.b import c`` (c a module): to ``a.b.c``, and to
  the packages above it that are not above the importer (importing a module
  runs its packages' ``__init__`` first);
* ``from a.b import name`` (name bound in ``a/b/__init__.py``): to ``a.b``.
  A name that is neither (the compiled extension) is no edge.
"""

from __future__ import annotations

import ast
import pathlib

import jax_normgrad

PACKAGE = pathlib.Path(jax_normgrad.__file__).resolve().parent


def _modules() -> dict[str, tuple[pathlib.Path, bool]]:
  """Module name -> (source file, is a package)."""
  modules = {}
  for path in sorted(PACKAGE.rglob("*.py")):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    is_package = parts[-1] == "__init__"
    modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
  return modules


def _bound_names(tree: ast.Module) -> set[str]:
  """The names a module binds at its top level (in ``if`` / ``try`` blocks too, not in functions)."""
  names, todo = set(), list(tree.body)
  while todo:
    node = todo.pop()
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      names.add(node.name)
    elif isinstance(node, (ast.Import, ast.ImportFrom)):
      names.update((a.asname or a.name).split(".")[0] for a in node.names)
    elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
      targets = node.targets if isinstance(node, ast.Assign) else [node.target]
      names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
    elif isinstance(node, (ast.If, ast.Try, ast.With)):
      todo.extend(node.body + getattr(node, "orelse", []) + getattr(node, "finalbody", [])
                  + [s for h in getattr(node, "handlers", []) for s in h.body])
  return names


def _ancestors(name: str) -> list[str]:
  parts = name.split(".")
  return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_graph() -> dict[str, set[str]]:
  """Module -> the modules of the package it imports (see the module docstring)."""
  modules = _modules()
  trees = {m: ast.parse(path.read_text(), str(path)) for m, (path, _) in modules.items()}
  graph: dict[str, set[str]] = {}
  for module, (_, is_package) in modules.items():
    package = module if is_package else module.rpartition(".")[0]
    above = set(_ancestors(module)) | ({module} if is_package else set())
    named, run = set(), set()  # modules imported by name; packages whose __init__ merely runs
    for node in ast.walk(trees[module]):
      if isinstance(node, ast.Import):
        named.update(a.name for a in node.names)
        continue
      if not isinstance(node, ast.ImportFrom):
        continue
      if node.level:  # relative: from the importer's package up
        base = package.split(".")[:len(package.split(".")) - node.level + 1]
        source = ".".join(base + ([node.module] if node.module else []))
      else:
        source = node.module
      for alias in node.names:
        if f"{source}.{alias.name}" in modules:
          named.add(f"{source}.{alias.name}")
        elif source in modules and alias.name in _bound_names(trees[source]):
          named.add(source)
        else:  # not a Python module of the package (the compiled extension)
          run.add(source)
    edges = set()
    for target in named | run:
      while target and target not in modules:  # "import a.b.c" of a name inside a.b
        target = target.rpartition(".")[0]
      if not target:
        continue
      edges.update(a for a in _ancestors(target) if a not in above)
      if target in named or target not in above:
        edges.add(target)
    graph[module] = edges - {module}
  return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """A circle of ``graph`` as ``[a, b, ..., a]``, or None (depth-first search)."""
  state: dict[str, int] = {}  # 1: on the current path, 2: done
  path: list[str] = []

  def visit(node):
    state[node] = 1
    path.append(node)
    for nxt in sorted(graph.get(node, ())):
      if state.get(nxt) == 1:
        return path[path.index(nxt):] + [nxt]
      if nxt not in state and (cycle := visit(nxt)):
        return cycle
    path.pop()
    state[node] = 2
    return None

  for node in sorted(graph):
    if node not in state and (cycle := visit(node)):
      return cycle
  return None


def test_no_import_circle_in_the_package():
  graph = import_graph()
  assert len(graph) > 20 and "jax_normgrad.pallas.common" in graph
  cycle = find_cycle(graph)
  assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_pallas_layers():
  """The layers of ``pallas/`` (its ``__init__`` docstring): the kernel modules stand on
  ``common``, ``kernels`` (the entry) on them, and the lowerings and the dispatcher
  (``jax_normgrad._dispatch``) on the entry."""
  graph = import_graph()
  p = "jax_normgrad.pallas."
  modules = {p + "gpu", p + "tpu", p + "mosaic_gpu"}
  assert not graph[p + "common"] & (modules | {p + "kernels", "jax_normgrad._dispatch"})
  for k in modules:
    assert p + "common" in graph[k] and p + "kernels" not in graph[k], k
  assert modules <= graph[p + "kernels"]
  assert p + "kernels" in graph["jax_normgrad._dispatch"]
  assert p + "kernels" in graph[p + "layer_norm"] and p + "kernels" in graph[p + "group_norm"]


def test_mosaic_gpu_layers():
  """``mosaic_gpu`` (its docstring): the entry module routes to the rows, pieces and GroupNorm
  modules, the pieces stand on the other two, GroupNorm on the rows (its whole segments), and
  all three on the shared TMA / SMEM plumbing, which stands on none of them; the description
  of what they launch stands on them all."""
  graph = import_graph()
  p = "jax_normgrad.pallas.mosaic_gpu"
  pipeline, rows, pieces, gn = p + "_pipeline", p + "_rows", p + "_pieces", p + "_group_norm"
  kernels = {rows, pieces, gn}
  assert kernels <= graph[p] and pipeline not in graph[p]
  assert {rows, gn} <= graph[pieces] and rows in graph[gn]
  assert not graph[rows] & (kernels | {p}) and not graph[gn] & ({pieces, p})
  for k in kernels:
    assert pipeline in graph[k] and p not in graph[k], k
  assert not graph[pipeline] & (kernels | {p, "jax_normgrad.pallas.kernels"})
  assert "jax_normgrad.pallas.common" in graph[pipeline]
  # What they launch, for explain: above them all, imported by the entry to the kernels only.
  describe = p + "_describe"
  assert {p, pieces, gn, pipeline} <= graph[describe]
  assert describe in graph["jax_normgrad.pallas.kernels"]
  assert not any(describe in graph[k] for k in kernels | {p, pipeline})


def test_the_check_sees_deferred_and_relative_imports(tmp_path, monkeypatch):
  # A circle through an import inside a function, and one through a relative
  # import of a name bound in a package's __init__, are both found.
  pkg = tmp_path / "jax_normgrad"
  (pkg / "sub").mkdir(parents=True)
  (pkg / "__init__.py").write_text("from jax_normgrad import a\nNAME = 1\n")
  (pkg / "a.py").write_text("def f():\n  from jax_normgrad.sub import b\n")
  (pkg / "sub" / "__init__.py").write_text("")
  (pkg / "sub" / "b.py").write_text("from .. import NAME\nfrom . import c\n")
  (pkg / "sub" / "c.py").write_text("from jax_normgrad import _ext  # not a .py module\n")
  monkeypatch.setattr(__import__(__name__), "PACKAGE", pkg)
  graph = import_graph()
  assert graph["jax_normgrad.a"] == {"jax_normgrad.sub", "jax_normgrad.sub.b"}
  assert graph["jax_normgrad.sub.b"] == {"jax_normgrad", "jax_normgrad.sub.c"}
  assert graph["jax_normgrad.sub.c"] == set()
  assert find_cycle(graph) == ["jax_normgrad", "jax_normgrad.a", "jax_normgrad.sub.b",
                               "jax_normgrad"]
  (pkg / "sub" / "b.py").write_text("from . import c\n")
  assert find_cycle(import_graph()) is None
