"""The notebooks in notebooks/: committed with their outputs, and they execute without error.

A reader browsing the repository sees the outputs (the plots included) as the
notebooks were last executed; the suite executes a copy of each again with nbclient.
To refresh the committed outputs, execute each notebook in place (nbclient's ``jupyter execute
--inplace notebooks/precision.ipynb``, and so on) and commit it.
"""

from __future__ import annotations

import base64
import json
import pathlib
import shutil

import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
#: The notebooks that plot, and the most bytes one committed notebook (its PNGs included) takes.
PLOTTING = {"precision", "performance"}
MAX_BYTES = 400_000


def test_notebooks_are_found():
  assert {p.name for p in NOTEBOOKS} >= {"quickstart.ipynb", "precision.ipynb",
                                         "performance.ipynb"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_committed_with_its_outputs(path):
  """Every code cell executed, in order, with no error; the plots stored as PNG; a modest size."""
  book = json.loads(path.read_text())
  code = [c for c in book["cells"] if c["cell_type"] == "code"]
  assert [c["execution_count"] for c in code] == list(range(1, len(code) + 1)), path.name
  outputs = [o for c in code for o in c["outputs"]]
  assert outputs and not [o for o in outputs if o["output_type"] == "error"], path.name
  pngs = [base64.b64decode(o["data"]["image/png"]) for o in outputs
          if "image/png" in o.get("data", {})]
  assert bool(pngs) == (path.stem in PLOTTING), path.name
  assert all(p.startswith(b"\x89PNG") for p in pngs)
  assert path.stat().st_size <= MAX_BYTES, path.stat().st_size


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(path, tmp_path):
  nbformat = pytest.importorskip("nbformat")
  nbclient = pytest.importorskip("nbclient")
  pytest.importorskip("ipykernel")
  pytest.importorskip("matplotlib")
  if path.stem == "quickstart":
    pytest.importorskip("flax")
  copy = tmp_path / path.name
  shutil.copy(path, copy)
  book = nbformat.read(copy, as_version=4)
  for cell in book.cells:  # the outputs checked are this run's
    if cell.cell_type == "code":
      cell.outputs, cell.execution_count = [], None
  nbclient.NotebookClient(book, timeout=300, kernel_name="python3",
                          resources={"metadata": {"path": str(tmp_path)}}).execute()
  errors = [o for c in book.cells if c.cell_type == "code" for o in c.outputs
            if o.output_type == "error"]
  assert not errors, errors
  pngs = [o for c in book.cells if c.cell_type == "code" for o in c.outputs
          if "image/png" in o.get("data", {})]
  assert bool(pngs) == (path.stem in PLOTTING), path.name
