"""Every step's notebook runs top to bottom on a CPU, in its own kernel, from its own folder."""
import nbformat
import pytest
from nbclient import NotebookClient

from conftest import STEPS

CELL_TIMEOUT_S = 180


@pytest.mark.parametrize("step", STEPS)
def test_notebook_executes(step, step_dirs):
    path = step_dirs[step] / "notebook.ipynb"
    assert path.is_file(), f"{step} has no notebook.ipynb"
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(notebook, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                            resources={"metadata": {"path": str(step_dirs[step])}})
    client.execute()  # raises CellExecutionError naming the cell that failed
