"""Every step's notebook runs top to bottom on a CPU, in its own kernel, from its own folder."""
import time

import nbformat
import pytest
from nbclient import NotebookClient

from conftest import STEPS

NOTEBOOK_BUDGET_S = 180  # a reader on a 2-core laptop waits at most this long


@pytest.mark.parametrize("step", STEPS)
def test_notebook_executes(step, step_dirs):
    path = step_dirs[step] / "notebook.ipynb"
    assert path.is_file(), f"{step} has no notebook.ipynb"
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(notebook, timeout=NOTEBOOK_BUDGET_S, kernel_name="python3",
                            resources={"metadata": {"path": str(step_dirs[step])}})
    start = time.monotonic()
    client.execute()  # raises CellExecutionError naming the cell that failed
    elapsed = time.monotonic() - start
    assert elapsed < NOTEBOOK_BUDGET_S, f"{step}/notebook.ipynb took {elapsed:.0f} s"
