"""Every step's notebook runs top to bottom on a CPU, in its own kernel, from its own folder. Its first code cell
(imports and setup) is short, and it imports the helpers that show code and results from support/notebook.py
rather than defining its own."""
import ast
import copy
import json
import time

import nbformat
import pytest
from nbclient import NotebookClient

from conftest import REPO, STEPS
from saved_outputs import cell_code

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


# ---- structure: the setup stays short, and the shared helpers are not copied into any notebook ----

FIRST_CELL_MAX_LINES = 15  # the first code cell: imports and setup, before the idea


def code_cells(notebook):
    """The notebook's code cells, in order (a notebook as its JSON reads)."""
    return [cell for cell in notebook["cells"] if cell["cell_type"] == "code"]


DRAWING = {"add_patch", "broken_barh", "barh", "annotate"}  # a function calling these draws a picture


def copied_helpers(notebook, shared):
    """(cell number among code cells, function name, why) for each helper a notebook defines that belongs in
    support/: one of support/notebook.py's, under its name or another (it prints source, parses train.py's flags,
    runs git or builds a Markdown table), or a drawing (it takes an `ax` or draws patches, bars or arrows), which
    belongs in support/plots.py."""
    found = []
    for n, cell in enumerate(code_cells(notebook)):
        for node in ast.walk(ast.parse(cell_code(cell))):
            if not isinstance(node, ast.FunctionDef):
                continue
            calls = {c.func.attr if isinstance(c.func, ast.Attribute) else getattr(c.func, "id", "")
                     for c in ast.walk(node) if isinstance(c, ast.Call)}
            strings = {c.value for c in ast.walk(node) if isinstance(c, ast.Constant) and isinstance(c.value, str)}
            why = ("has the name of a shared helper" if node.name in shared else
                   "prints source" if calls & {"getsource", "getsourcelines"} else
                   "parses train.py's flags" if calls & {"build_parser", "check_config"} else
                   "runs git" if "git" in strings else
                   "builds a Markdown table" if any("---|" in s for s in strings) else
                   "draws" if calls & DRAWING or "ax" in {a.arg for a in node.args.args} else None)
            if why:
                found.append((n, node.name, why))
    return found


def structure_problems(notebook, shared):
    """What breaks the two rules: a first code cell over FIRST_CELL_MAX_LINES lines, a copied helper."""
    problems = []
    first = "".join(code_cells(notebook)[0]["source"]).rstrip("\n")
    if len(first.splitlines()) > FIRST_CELL_MAX_LINES:
        problems.append(f"the first code cell has {len(first.splitlines())} lines (at most {FIRST_CELL_MAX_LINES})")
    problems += [f"code cell {n} (from 0) defines {name}, which {why}: "
                 f"{'draw it with support/plots.py' if why == 'draws' else 'import it from support/notebook.py'}"
                 for n, name, why in copied_helpers(notebook, shared)]
    return problems


def shared_helpers(step):
    """The names of the functions the step's support/notebook.py defines."""
    tree = ast.parse((REPO / step / "support" / "notebook.py").read_text())
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}


@pytest.mark.parametrize("step", STEPS)
def test_setup_is_short_and_helpers_are_shared(step):
    """The course's notebook keeps both rules (read, not run)."""
    notebook = json.loads((REPO / step / "notebook.ipynb").read_text())
    problems = structure_problems(notebook, shared_helpers(step))
    assert not problems, f"{step}/notebook.ipynb: " + "; ".join(problems)


def test_structure_control_fails_on_a_long_setup_and_a_copied_helper():
    """The control: step 01's notebook with its first code cell padded to 16 lines fails, and so does each of
    six helpers planted in a later cell: four copies of support/notebook.py's (named as there, or renamed) and
    two drawings."""
    notebook = json.loads((REPO / STEPS[0] / "notebook.ipynb").read_text())
    shared = shared_helpers(STEPS[0])
    assert not structure_problems(notebook, shared)
    long = copy.deepcopy(notebook)
    first = code_cells(long)[0]
    first["source"] = "".join(first["source"]).rstrip("\n") + "\n" + "pass\n" * FIRST_CELL_MAX_LINES
    assert any("first code cell" in p for p in structure_problems(long, shared))
    planted = {"show": "def show(*objects):\n    for o in objects:\n        print(inspect.getsource(o))\n",
               "flags": "def flags(*argv, world):\n    return check_config(build_parser().parse_args(argv), world, 0)\n",
               "diff": "def diff(a, b):\n    return subprocess.run(['git', 'diff', a, b]).stdout\n",
               "md": "def md(rows):\n    return '|' + '---|' * len(rows)\n",
               "grid": "def grid(ax, n):\n    ax.set_xlim(0, n)\n",
               "boxes": "def boxes(axes, xs):\n    axes[0].broken_barh(xs, (0, 1))\n"}
    for name, source in planted.items():
        copied = copy.deepcopy(notebook)
        cell = code_cells(copied)[3]
        cell["source"] = source + "\n\n" + "".join(cell["source"])
        assert [p for p in structure_problems(copied, shared) if f"defines {name}," in p], name
