"""Where a step's notebook shows an exercise's answer, so that a learner's copy can hide it and the course's
notebook can say "try the exercise first" just before it.

A cell shows the answer when its source or saved output holds at least half of the lines of the exercise's
function bodies (each function counted alone; its docstring and comments left out): a printed
inspect.getsource, a diff that adds the function, a code block in the prose.
"""
import ast

import nbformat

HIDDEN = "# This cell showed the answer of exercise {id}: hidden in your copy. Write it yourself, then check it."
MIN_LINE = 12  # shorter lines (return x, else:) say too little to be a piece of the answer


def body_lines(exercise, folder):
    """For each function of the exercise: its body's distinctive lines (stripped), as the step's code has them."""
    from exercise import function_node

    bodies = []
    for file, qualname in exercise["functions"]:
        source = (folder / file).read_text()
        node = function_node(ast.parse(source), qualname)
        first = node.body[0]
        has_doc = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and len(node.body) > 1
        start = node.body[1].lineno if has_doc else first.lineno
        lines = [line.strip() for line in source.splitlines()[start - 1:node.end_lineno]]
        bodies.append([line for line in lines if len(line) >= MIN_LINE and not line.startswith("#")])
    return bodies


def cell_text(cell):
    """A cell's source and the text of its saved outputs."""
    parts = [cell.source]
    for output in cell.get("outputs", []):
        parts.append(output.get("text", ""))
        parts += [v if isinstance(v, str) else "".join(v) for k, v in output.get("data", {}).items()
                  if k.startswith("text/")]
    return "\n".join(parts)


def shows_answer(cell, bodies):
    text = cell_text(cell)
    return any(lines and 2 * sum(line in text for line in lines) >= len(lines) for lines in bodies)


def answer_cells(notebook, exercise, folder):
    """Indices of the notebook's cells that show the exercise's answer."""
    bodies = body_lines(exercise, folder)
    return [i for i, cell in enumerate(notebook.cells) if shows_answer(cell, bodies)]


def hide_answers(path, exercise, folder):
    """Rewrite the notebook at path (a learner's copy): each cell that shows the answer loses its source and
    outputs, and says why. Returns the indices of the cells hidden."""
    notebook = nbformat.read(path, as_version=4)
    hidden = answer_cells(notebook, exercise, folder)
    for i in hidden:
        cell = notebook.cells[i]
        cell.source = HIDDEN.format(id=exercise["id"])
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
        else:
            cell.source = cell.source.lstrip("# ")
    nbformat.write(notebook, path)
    return hidden
