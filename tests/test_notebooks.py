"""The notebooks in notebooks/ execute without error (a temporary copy, run with nbclient)."""

from __future__ import annotations

import pathlib
import shutil

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def test_notebooks_are_found():
  assert {p.name for p in NOTEBOOKS} >= {"quickstart.ipynb", "precision.ipynb",
                                         "performance.ipynb"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(path, tmp_path):
  if path.stem == "quickstart":
    pytest.importorskip("flax")
  copy = tmp_path / path.name
  shutil.copy(path, copy)
  book = nbformat.read(copy, as_version=4)
  # Stored without outputs, so a diff of a notebook is a diff of its code.
  assert all(not c.get("outputs") for c in book.cells if c.cell_type == "code"), path.name
  nbclient.NotebookClient(book, timeout=300, kernel_name="python3",
                          resources={"metadata": {"path": str(tmp_path)}}).execute()
  errors = [o for c in book.cells if c.cell_type == "code" for o in c.outputs
            if o.output_type == "error"]
  assert not errors, errors
