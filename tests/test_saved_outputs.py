"""Every saved notebook output that prints a step's own code equals what the code prints now (tests/saved_outputs.py).

No notebook is executed: the printing statements alone are run again, one process per step. Controls: a copy
of a notebook whose outputs are first set to the recomputed ones passes, and the same copy with one line of one
such output edited fails, naming the copy, the cell and the edited line; for each kind of output.
"""
import copy
import json
import re
import sys

import pytest

import harness
from conftest import REPO, STEPS
from saved_outputs import match_parts

CHECKER = REPO / "tests" / "saved_outputs.py"


def check(*targets):
    """The checker's report on STEP_DIR[=NOTEBOOK] targets, from one process that forks one child per target."""
    done = harness.run([sys.executable, str(CHECKER), *map(str, targets)], capture_output=True, text=True,
                       timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def report(step_dirs):
    """{step: the checker's report on its notebook}, made once for all steps."""
    found = check(*(step_dirs[step] for step in STEPS))
    return {step: found[str(step_dirs[step])] for step in STEPS}


@pytest.mark.parametrize("step", STEPS)
def test_saved_source_outputs_are_current(step, report):
    got = report[step]
    assert got["checked"], f"{got['notebook']}: no saved output that prints the step's code was found"
    problems = [f"{p['notebook']} cell {p['cell']} ({p['code']}):\n    " + "\n    ".join(p["diff"])
                for p in got["problems"]]
    if problems:
        pytest.fail(f"{len(problems)} saved output(s) no longer match the code; re-execute the notebook:\n"
                    + "\n".join(problems), pytrace=False)


def stream(text):
    return {"output_type": "stream", "name": "stdout", "text": text}


def markdown(text):
    return {"output_type": "display_data", "metadata": {},
            "data": {"text/markdown": text, "text/plain": "<IPython.core.display.Markdown object>"}}


def edit_one_line(outputs, kind):
    """A copy of `outputs` with one line changed, and that line as changed: a definition gets a comment on its
    second line; elsewhere the first whole number of the first line that has one goes up by 1."""
    edited = copy.deepcopy(outputs)
    out = next(o for o in edited if o.get("text") or o.get("data"))
    key = ("text",) if "text" in out else ("data", "text/markdown")
    holder = out if len(key) == 1 else out["data"]
    text = holder[key[-1]]
    if kind == "definition":
        line = [line for line in text.splitlines() if line.strip()][1]
        changed = line + "  # edited"
    else:
        line = next(line for line in text.splitlines() if re.search(r"\b\d+\b", line))
        changed = re.sub(r"\b\d+\b", lambda d: str(int(d.group()) + 1), line, count=1)
    holder[key[-1]] = text.replace(line, changed, 1)
    return edited, changed


CONTROL_KINDS = {  # which checked cell to edit, for each kind of output
    "definition": lambda r: r["kind"] == "source" and r["kinds"] == ["block"],
    "numbered lines": lambda r: "numbered" in r["kinds"] and r["expected"] is not None,
    "Markdown table": lambda r: r["kind"] == "table" and any(k == "markdown" for k, _ in r["expected"] or []),
    "printed counts": lambda r: r["kind"] == "table" and r["expected"] and all(k == "text" for k, _ in r["expected"]),
}
LEFT_OVER = "        left_over()"  # deeper than any definition the notebooks print


def control_cases(report):
    """[(name, step, cell, outputs made current or None, edited outputs or the text to append to, the edited line,
    what the checker must say)]: one cell of each kind in CONTROL_KINDS, and a currently passing definition
    followed by other output, where an old, longer definition (a last method since removed) is left behind."""
    def first(want):
        return next(((step, rec) for step in STEPS for rec in report[step]["checked"] if want(rec)), (None, None))

    cases = []
    for name, want in CONTROL_KINDS.items():
        step, rec = first(want)
        assert rec is not None, f"no cell of kind {name!r} in any notebook: the control has nothing to edit"
        outputs = [stream(text) if kind == "text" else markdown(text) for kind, text in rec["expected"]]
        edited, changed = edit_one_line(outputs, name)
        cases.append((name, step, rec["cell"], outputs, edited, changed, "-" + changed))
    step, rec = first(lambda r: r["kind"] == "source" and r.get("ok") and any(
        part is not None and nxt is None for part, nxt in zip(r["parts"], r["parts"][1:])))
    assert rec is not None, "no passing cell prints a definition followed by other output: nothing to edit"
    known = next(part for part, nxt in zip(rec["parts"], rec["parts"][1:]) if part is not None and nxt is None)
    cases.append(("definition before other output", step, rec["cell"], None, known, LEFT_OVER, "continues it"))
    return cases


def test_an_edited_output_fails(report, step_dirs, tmp_path):
    cases = control_cases(report)
    targets = []
    for n, (name, step, cell, outputs, edited, changed, _) in enumerate(cases):
        notebook = json.loads((step_dirs[step] / "notebook.ipynb").read_text())
        if outputs is None:  # insert the left-over line right after the current definition, in the saved output
            texts = [o for o in notebook["cells"][cell]["outputs"] if o.get("name") == "stdout"]
            for out in texts:
                text = "".join(out["text"])
                if edited in text:
                    out["text"] = text.replace(edited, edited + changed + "\n\n", 1)  # edited: the definition
                    break
            variants = {"edited": notebook}
        else:
            variants = {}
            for variant, outs in (("current", outputs), ("edited", edited)):
                nb = copy.deepcopy(notebook)
                nb["cells"][cell]["outputs"] = outs
                variants[variant] = nb
        for variant, nb in variants.items():
            path = tmp_path / f"control{n}_{variant}.ipynb"
            path.write_text(json.dumps(nb))
            targets.append(f"{step_dirs[step]}={path}")
    found = check(*targets)
    failures = []
    for n, (name, step, cell, outputs, _, changed, said) in enumerate(cases):
        about = [p for p in found[f"{step_dirs[step]}={tmp_path / f'control{n}_edited.ipynb'}"]["problems"]
                 if p["cell"] == cell]
        if not about or str(tmp_path / f"control{n}_edited.ipynb") != about[0]["notebook"] \
                or not any(said in line for line in about[0]["diff"]):
            failures.append(f"{name} ({step} cell {cell}, edited to {changed!r}): the checker said {about}")
        if outputs is not None:
            current = found[f"{step_dirs[step]}={tmp_path / f'control{n}_current.ipynb'}"]["problems"]
            if any(p["cell"] == cell for p in current):
                failures.append(f"{name} ({step} cell {cell}): the outputs as recomputed fail: {current}")
    if failures:
        pytest.fail("\n".join(failures), pytrace=False)


DEF = "def f():\n    return 1\n\n"
NUMBERED = "a.py:3: x = 1\n"


@pytest.mark.parametrize("parts, saved, passes", [
    ([("known", DEF, "block", "block", DEF, DEF), ("gap",)], DEF + "other output\n", True),
    ([("known", DEF, "block", "block", DEF, DEF), ("gap",)], DEF + "    return 2\n\nother output\n", False),
    ([("gap",), ("known", DEF, "block", "block", DEF, DEF)], "other output\n" + DEF, True),
    ([("gap",), ("known", DEF, "block", "block", DEF, DEF)], "other output\n@cache\n" + DEF, False),
    ([("known", NUMBERED, "numbered", "numbered", NUMBERED, NUMBERED), ("gap",)], NUMBERED + "other\n", True),
    ([("known", NUMBERED, "numbered", "numbered", NUMBERED, NUMBERED), ("gap",)], NUMBERED + "a.py:9: y\n", False),
    ([("known", DEF, "block", "block", DEF, DEF)], DEF + "x\n", False),  # no gap: nothing may follow
], ids=["block+gap", "block+left-over", "gap+block", "decorator+block", "lines+gap", "lines+left-over", "exact"])
def test_gap_rules(parts, saved, passes):
    """The rules that keep an older, longer text from hiding next to a gap of unknown output; each has its control."""
    assert (match_parts(parts, saved) is None) == passes, match_parts(parts, saved)
