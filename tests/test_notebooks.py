"""Every notebook in notebooks/ runs top to bottom in a fresh Jupyter kernel."""

import os
import pathlib

import pytest

pytestmark = pytest.mark.multiworker

nbformat = pytest.importorskip("nbformat", reason="notebook tests need the [test] extras")
nbclient = pytest.importorskip("nbclient", reason="notebook tests need the [test] extras")

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def test_there_are_at_least_three_clean_notebooks():
    assert len(NOTEBOOKS) >= 3
    for path in NOTEBOOKS:
        notebook = nbformat.read(path, as_version=4)
        for cell in notebook.cells:
            if cell.cell_type == "code":
                assert not cell.outputs, f"{path.name} has committed outputs"
                assert cell.execution_count is None, f"{path.name} has execution counts"


@pytest.mark.timeout(600)
# The slow lane (the README's fast lane stays within its budget; the quickstart's path,
# strategy + distribute_dataset + fit, is the fast lane's most tested one).
@pytest.mark.slow
@pytest.mark.parametrize("path", [pytest.param(path, id=path.stem) for path in NOTEBOOKS])
def test_notebook_executes(path, monkeypatch):
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "2")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        notebook, timeout=420, kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
    )
    client.execute()
    text = "".join(
        output.get("text", "")
        for cell in notebook.cells if cell.cell_type == "code"
        for output in cell.outputs
    )
    if path.stem.startswith("02"):
        # The launcher really started two worker processes and streamed their output.
        assert "[worker 0]" in text
    assert "Traceback" not in text
