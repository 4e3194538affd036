"""Check, without running a notebook, that its saved outputs which print the step's own code are current.

    python tests/saved_outputs.py STEP_DIR[=NOTEBOOK] ...   ->  prints a JSON report {STEP_DIR[=NOTEBOOK]: ...}

NOTEBOOK defaults to STEP_DIR/notebook.ipynb (the tests pass an edited copy as a control). The notebooks print
their own source in three ways, and each is recomputed here from the files as they are now:

  * source cells: `print(inspect.getsource(obj))`, support/notebook.py's `show(*objects)` (getsource of each)
    and its line-numbered excerpts `lines(module, *patterns)` (`schedule.py:94: ...`, through getsourcelines),
    and a file's docstring (`ast.get_docstring`). These statements alone are run again; the
    cell's other statements (training runs, plots) are not. Assignments, imports and definitions print nothing;
    what any other statement printed is a gap of unknown text. The saved output must be the recomputed texts,
    in order, with the gaps in between: exactly equal where no gap separates them. A gap may not continue a
    printed definition (a line indented deeper than it, or a decorator before it) nor a numbered excerpt (another
    `file.py:N:` line), so an old, longer definition cannot hide behind a gap.
  * file tables: a cell that runs `git diff` (the line counts of step 01, every step's table of lines added and
    removed against the previous step) or parses source files with `ast` (step 03's table of where step 02's
    functions went) is run whole, and its printed text and Markdown tables must equal the saved ones exactly.

Cells are numbered as in the notebook's JSON, from 0, markdown cells included. A statement that needs a name
bound elsewhere (say `replay = plots.import_replay()`) gets it by running the top-level assignment that binds it,
in the same cell or an earlier one. The notebook runs from its folder, with that folder first on sys.path, as in
Jupyter. Nothing here starts a process other than `git`.

Speed: this process imports torch, matplotlib and IPython once, then forks one child per step, which imports
that step's modules (two steps never meet in one process, since they share module names).
"""
import ast
import contextlib
import difflib
import io
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE_CALLS = {".getsource", ".getsourcelines", ".get_docstring"}  # inspect's and ast's, as called_names names them
NUMBERED = re.compile(r"^[\w.]+\.py:\d+: ")  # a line of step 07's lines(): "schedule.py:94: ..."
DISPLAY = "\u27e6{}\u27e7\n"  # how a display (a Markdown table, a figure) sits between printed text in a flat string
MAX_DIFF_LINES = 16


def cell_code(cell) -> str:
    """The cell's code, its IPython magics (%matplotlib inline) turned into `pass` so the lines keep their places."""
    text = "".join(cell["source"])
    return "\n".join("pass" if line.lstrip().startswith(("%", "!")) else line for line in text.splitlines())


def called_names(node) -> set:
    """What the node calls: `f` for f(...), `.f` for x.f(...) (so plt.show() is not the notebooks' show())."""
    return {c.func.id if isinstance(c.func, ast.Name) else "." + c.func.attr for c in ast.walk(node)
            if isinstance(c, ast.Call) and isinstance(c.func, (ast.Name, ast.Attribute))}


def runs_git_or_parses(node) -> bool:
    """The node runs `git ...` (a list literal that starts with "git") or parses source with ast.parse."""
    for n in ast.walk(node):
        if isinstance(n, ast.List) and n.elts and isinstance(n.elts[0], ast.Constant) and n.elts[0].value == "git":
            return True
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "parse" \
                and isinstance(n.func.value, ast.Name) and n.func.value.id == "ast":
            return True
    return False


def saved_items(cell):
    """The cell's saved outputs as (kind, text): printed text (stdout), Markdown, or another display."""
    items = []
    for out in cell.get("outputs", []):
        join = (lambda v: "".join(v) if isinstance(v, list) else v)
        if out["output_type"] == "stream" and out["name"] == "stdout":
            items.append(("text", join(out["text"])))
        elif out["output_type"] in ("display_data", "execute_result"):
            data = out["data"]
            kind = "markdown" if "text/markdown" in data else "image" if "image/png" in data else "display"
            items.append((kind, join(data["text/markdown"]) if kind == "markdown" else ""))
        elif out["output_type"] == "error":
            items.append(("error", out.get("ename", "")))
    return items


def flat(items) -> str:
    return "".join(text if kind == "text" else DISPLAY.format(kind) + text + ("\n" if text else "")
                   for kind, text in items)


class Recorder(io.TextIOBase):
    """stdout and IPython's display() in one list of (kind, text) items, in the order they came."""

    def __init__(self):
        self.items = []

    def write(self, s):
        if self.items and self.items[-1][0] == "text":
            self.items[-1] = ("text", self.items[-1][1] + s)
        elif s:
            self.items.append(("text", s))
        return len(s)

    def display(self, *objs, **_):
        for obj in objs:
            text = getattr(obj, "data", None) if type(obj).__name__ == "Markdown" else None
            self.items.append(("markdown", text) if isinstance(text, str) else ("display", ""))


def shared_helpers(step_dir: Path, trees):
    """The definitions a notebook imports from its step's support/notebook.py (show, lines, numstat, ...): a
    source or table helper there counts as one defined in the notebook."""
    names = {a.name for tree in trees for n in tree.body
             if isinstance(n, ast.ImportFrom) and n.module == "support.notebook" for a in n.names}
    if not names:
        return []
    module = ast.parse((step_dir / "support" / "notebook.py").read_text())
    return [n for n in module.body if isinstance(n, ast.FunctionDef) and n.name in names]


class Notebook:
    """One notebook's cells, run piece by piece in one namespace from the step's folder."""

    def __init__(self, path: Path, recorder: Recorder, step_dir: Path):
        self.path, self.recorder = path, recorder
        self.cells = json.loads(path.read_text())["cells"]
        self.trees = {i: ast.parse(cell_code(c)) for i, c in enumerate(self.cells) if c["cell_type"] == "code"}
        self.ns = {"__name__": "__main__", "display": recorder.display}
        defs = [n for tree in self.trees.values() for n in tree.body if isinstance(n, ast.FunctionDef)]
        defs += shared_helpers(step_dir, self.trees.values())
        # the notebook's own helpers that print source (show, lines) or tables of files (added_lines, numstat)
        self.source_helpers = {d.name for d in defs if called_names(d) & SOURCE_CALLS}
        self.numbered_helpers = {d.name for d in defs if ".getsourcelines" in called_names(d)}
        self.table_helpers = {d.name for d in defs if runs_git_or_parses(d)}

    def run(self, node, cell: int):
        """Execute `node` (a cell's module or one statement) and return what it printed; bind names it lacks."""
        code = compile(node if isinstance(node, ast.Module) else ast.Module([node], []), f"<cell {cell}>", "exec")
        bound = set()
        while True:
            self.recorder.items = []
            try:
                with contextlib.redirect_stdout(self.recorder):
                    exec(code, self.ns)
                return list(self.recorder.items)
            except NameError as err:
                binder = self.binder(err.name, cell, node)
                if binder is None or err.name in bound:
                    raise
                bound.add(err.name)
                self.run(binder, cell)

    def binder(self, name, cell, before):
        """The last top-level assignment to `name` before `before` in this cell, else in an earlier cell."""
        for i in sorted((i for i in self.trees if i <= cell), reverse=True):
            body = self.trees[i].body
            if i == cell:
                body = body[:body.index(before)] if before in body else []
            for stmt in reversed(body):
                if isinstance(stmt, ast.Assign) and name in {n.id for t in stmt.targets for n in ast.walk(t)
                                                             if isinstance(n, ast.Name)}:
                    return stmt
        return None

    def define(self, i):
        """Run the cell's imports and definitions (what the checked statements may call)."""
        for stmt in self.trees[i].body:
            if isinstance(stmt, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef)):
                with contextlib.suppress(Exception):  # a later statement that needs it says what is missing
                    self.run(stmt, i)

    def kind(self, stmt) -> str:
        if isinstance(stmt, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef, ast.Assign, ast.AugAssign,
                             ast.AnnAssign, ast.Pass)):
            return "silent"
        calls = called_names(stmt)
        if calls & ({".getsourcelines"} | self.numbered_helpers):
            return "numbered"
        if calls & (SOURCE_CALLS | self.source_helpers):
            return "block"
        printed = stmt.value if isinstance(stmt, ast.Expr) else None
        if isinstance(printed, ast.Call) and isinstance(printed.func, ast.Name) and printed.func.id == "print" \
                and all(isinstance(a, ast.Constant) for a in printed.args) and not printed.keywords:
            return "constant"
        return "gap"


def excerpt(cell_code_text: str, stmt) -> str:
    text = ast.get_source_segment(cell_code_text, stmt) or ""
    first = text.splitlines()[0] if text else ""
    return first if len(first) <= 100 else first[:97] + "..."


def diff(saved: str, expected: str) -> list:
    """The lines that differ, saved (-) against the current code (+), around the best-matching span of `saved`."""
    old, new = saved.splitlines(keepends=True), expected.splitlines(keepends=True)
    blocks = [b for b in difflib.SequenceMatcher(None, old, new, autojunk=False).get_matching_blocks() if b.size]
    if blocks:  # cut `saved` to the span the expected text lines up with, so unrelated output stays out
        start = max(0, blocks[0].a - blocks[0].b)
        end = blocks[-1].a + blocks[-1].size + (len(new) - blocks[-1].b - blocks[-1].size)
        old = old[start:end]
    lines = [line.rstrip("\n") for line in difflib.unified_diff(old, new, "saved output", "current code", n=1)]
    return lines[:MAX_DIFF_LINES] + ([f"... ({len(lines) - MAX_DIFF_LINES} more diff lines)"]
                                     if len(lines) > MAX_DIFF_LINES else [])


def continues(kind, known: str, line: str, after: bool) -> bool:
    """Could `line`, next to `known` (what one statement of this kind printed), be a left-over of an older version
    of it? A definition goes on with deeper-indented lines and may start with a decorator; an excerpt with lines
    numbered like its own."""
    indents = [len(k) - len(k.lstrip()) for k in known.splitlines() if k.strip()]
    if not line.strip() or not indents:
        return False
    if kind == "numbered":
        return bool(NUMBERED.match(line))
    indent = len(line) - len(line.lstrip())
    if kind == "block":
        return indent > min(indents) if after else line.lstrip().startswith("@") and indent == min(indents)
    return False


def match_parts(parts, saved: str):
    """parts: [("known", text, first kind, last kind, first statement's text, last's) | ("gap",)], consecutive
    statements' texts joined. None if `saved` fits them, else what differs."""
    pattern = "".join(re.escape(p[1]) if p[0] == "known" else "(.*?)" for p in parts)
    found = re.fullmatch(pattern, saved, re.DOTALL)
    if found:
        gap = 0
        for i, part in enumerate(parts):
            if part[0] != "gap":
                continue
            gap += 1
            text = found.group(gap)
            before = parts[i - 1] if i > 0 else None
            after = parts[i + 1] if i + 1 < len(parts) else None
            lines = text.splitlines()
            if before and lines and continues(before[3], before[5], lines[0], after=True):
                return [f"after the current code's text comes a line that continues it: {lines[0]!r}"]
            if after and lines and continues(after[2], after[4], lines[-1], after=False):
                return [f"before the current code's text comes a line that belongs to it: {lines[-1]!r}"]
        return None
    pos, anchored = 0, True  # the first text that cannot be placed, and how it differs from what is there
    for part in parts:
        if part[0] == "gap":
            anchored = False
            continue
        at = (pos if saved.startswith(part[1], pos) else -1) if anchored else saved.find(part[1], pos)
        if at < 0:
            return diff(saved[pos:], part[1])
        pos, anchored = at + len(part[1]), True
    return diff(saved[pos:], "") if pos != len(saved) else ["(the texts fit, in another order)"]


def recompute(nb: Notebook, i: int, tree, kinds, whole: bool):
    """(parts for match_parts, the cell's whole expected output as items or None where gaps leave it unknown)."""
    if whole:
        items = nb.run(tree, i)
        text = flat(items)
        return [("known", text, "table", "table", text, text)], items
    parts, items = [], []
    for stmt, kind in zip(tree.body, kinds):
        if kind == "gap":
            parts += [("gap",)] if not parts or parts[-1][0] != "gap" else []
        elif kind != "silent":
            printed = nb.run(stmt, i)
            items += printed
            text = flat(printed)
            if parts and parts[-1][0] == "known":  # no gap between: the two texts must touch
                known = parts[-1]
                parts[-1] = ("known", known[1] + text, known[2], kind, known[4], text)
            else:
                parts.append(("known", text, kind, kind, text, text))
    return parts, items if all(p[0] == "known" for p in parts) else None


def check_notebook(step_dir: Path, notebook: Path):
    """{"notebook", "checked": [one record per checked cell], "problems": [...]}, in this (fresh) process."""
    import IPython.display
    recorder = Recorder()
    IPython.display.display = recorder.display  # what `from IPython.display import display` gets in the cells
    nb = Notebook(notebook, recorder, step_dir)
    label = os.path.relpath(notebook, step_dir.parent) if notebook.is_relative_to(step_dir.parent) else str(notebook)
    checked, problems = [], []
    for i, tree in nb.trees.items():
        nb.define(i)
        whole = runs_git_or_parses(tree) or bool(called_names(tree) & nb.table_helpers)
        kinds = [nb.kind(stmt) for stmt in tree.body]
        if not whole and not {"block", "numbered"} & set(kinds):
            continue
        shown = [s for s, k in zip(tree.body, kinds) if k in ("block", "numbered") or not isinstance(s, ast.FunctionDef)
                 and (runs_git_or_parses(s) or called_names(s) & nb.table_helpers)]  # the statement to name
        record = dict(cell=i, code=excerpt(cell_code(nb.cells[i]), (shown or tree.body)[0]),
                      kind="table" if whole else "source", kinds=sorted(set(kinds) - {"silent"}))
        checked.append(record)
        try:
            parts, record["expected"] = recompute(nb, i, tree, kinds, whole)
        except Exception as err:  # the code the cell shows is gone or broken: that output is stale too
            problems.append(dict(notebook=label, cell=i, code=record["code"],
                                 diff=[f"cannot recompute it: {type(err).__name__}: {err}"]))
            continue
        record["parts"] = [p[1] if p[0] == "known" else None for p in parts]  # None: a gap
        differs = match_parts(parts, flat(saved_items(nb.cells[i])))
        record["ok"] = not differs
        if differs:
            problems.append(dict(notebook=label, cell=i, code=record["code"], diff=differs))
    return dict(notebook=label, checked=checked, problems=problems)


def only_git(popen):
    class GitOnly(popen):
        def __init__(self, args, *rest, **kw):
            argv = [args] if isinstance(args, (str, bytes)) else list(args)
            if Path(str(argv[0])).name != "git":
                raise RuntimeError(f"the saved-output checker starts no process but git: {argv[:3]}")
            super().__init__(args, *rest, **kw)
    return GitOnly


def check_target(target: str):
    """Child process: one step's notebook, with the step's folder as cwd and first on sys.path."""
    step, _, notebook = target.partition("=")
    step_dir = Path(step).resolve()
    notebook = Path(notebook).resolve() if notebook else step_dir / "notebook.ipynb"
    os.chdir(step_dir)
    sys.path.insert(0, str(step_dir))
    subprocess.Popen = only_git(subprocess.Popen)
    with tempfile.TemporaryDirectory() as scratch:  # WORK = tempfile.mkdtemp(...) of the setup cells lands here
        tempfile.tempdir = scratch
        try:
            return target, check_notebook(step_dir, notebook)
        finally:
            tempfile.tempdir = None


def main(targets):
    os.environ.setdefault("MPLBACKEND", "Agg")
    import IPython.display  # noqa: F401  (imported once, before the fork, with the heavy modules the steps use)
    import matplotlib.pyplot  # noqa: F401
    import torch  # noqa: F401
    context = multiprocessing.get_context("fork")
    with context.Pool(min(len(targets), os.cpu_count() or 1), maxtasksperchild=1) as pool:
        report = dict(pool.map(check_target, targets, chunksize=1))
    json.dump(report, sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1:])
