"""The numbers the READMEs quote, recomputed from the code (tests/test_readmes.py holds them to it): each
notebook's read time, each step's diff beside the previous step's (the idea, support/ and each side road
apart, as the top README's path table quotes them), and every file and function size of a step README's
reading list.
"""
import ast
import json
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DIFF, SIGNED = ["diff", "-ruN", "-x", "notebook.ipynb", "-x", "README.md", "-x", "__pycache__"], r"\+(\d+)(?: [−-](\d+))?"


def read_minutes(step: Path) -> int:
    """The notebook's prose (its markdown cells' words) at 200 words a minute."""
    cells = json.loads((step / "notebook.ipynb").read_text())["cells"]
    words = sum(len("".join(c["source"]).split()) for c in cells if c["cell_type"] == "markdown")
    return round(words / 200)


def diff_per_file(before: Path, after: Path):
    """{file: [added, removed]} of the README's diff command between two step folders, as diff counts them."""
    out = subprocess.run([*DIFF, str(before), str(after)], capture_output=True, text=True).stdout.splitlines()
    counts, name, header = {}, None, 0
    for line in out:
        if line.startswith("diff "):
            name, header = Path(line.split()[-1]).relative_to(after).as_posix(), 2
            counts[name] = [0, 0]
        elif header and line.startswith(("--- ", "+++ ")):
            header -= 1  # the two file names, not changed lines
        elif line[:1] in "+-" and line:
            counts[name][line[0] == "-"] += 1
    return counts


def summed(counts, keep):
    """[added, removed] summed over the files whose name `keep` accepts."""
    return [sum(v[i] for name, v in counts.items() if keep(name)) for i in (0, 1)]


def signed(text: str):
    """[(added, removed)] of each +A −B in text (−0 for a new file's +A)."""
    return [(int(a), int(r or 0)) for a, r in re.findall(SIGNED, text)]


def path_table_problems(text: str):
    """The top README's path table against the code: each step's read time, its idea's diff (outside support/
    and the side roads it names), support/'s and each side road's."""
    problems, steps = [], sorted(p for p in REPO.glob("step0*") if p.is_dir())
    row = re.compile(r"^\| \[\d\d [^]]+\]\((step0\d_\w+)\) \| (.*) \|$", re.M)
    rows = {m[1]: [cell.strip() for cell in m[2].split("|")] for m in row.finditer(text)}
    for before, step in zip([None, *steps], steps):
        idea, diff, beside, read = rows[step.name][-4:]
        if read != f"{read_minutes(step)} min":
            problems.append(f"{step.name}: read {read}, but the notebook's prose reads in {read_minutes(step)} min")
        if before is None:
            continue
        counts = diff_per_file(before, step)
        roads = re.findall(r"([\w/]+\.py) \+", beside)
        want = [("the idea", diff, summed(counts, lambda n: not n.startswith("support/") and n not in roads))]
        want += [("support/", re.search(r"support/ ([^;]*)", beside)[1] if "support/" in beside else "+0 −0",
                  summed(counts, lambda n: n.startswith("support/")))]
        want += [(road, re.search(re.escape(road) + r" ([^,;]*)", beside)[1], counts.get(road, [0, 0]))
                 for road in roads]
        for what, quoted, (added, removed) in want:
            if signed(quoted) != [(added, removed)]:
                problems.append(f"{step.name}: {what} quoted {quoted}, but diff counts +{added} −{removed}")
    return problems


def reading_list(text: str):
    """The items of a step README's numbered reading list, each joined into one line."""
    items, current = [], None
    for line in text.splitlines():
        if re.match(r"\d+\. ", line):
            current = [line]
            items.append(current)
        elif current is not None and line.startswith("   "):
            current.append(line.strip())
        else:
            current = None
    return [" ".join(item) for item in items]


def sizes_problems(step: Path, text: str):
    """Every `file.py` (N) and `name` (N) of the reading list against the code: a file's lines, a def's or class's
    lines from its def to its end (found in the item's files); and the README's total diff."""
    problems = []
    for item in reading_list(text):
        files = re.findall(r"`([\w/]+\.py)`", item)
        trees = [ast.parse((step / f).read_text()) for f in files]
        for name, quoted in re.findall(r"`([\w./]+)(?:\([^`]*\))?` \((\d+)", item):
            if name.endswith(".py"):
                got = len((step / name).read_text().splitlines())
            else:
                nodes = [n for tree in trees for n in ast.walk(tree)
                         if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == name]
                got = nodes[0].end_lineno - nodes[0].lineno + 1 if nodes else None
            if got != int(quoted):
                problems.append(f"{step.name}/README.md: `{name}` ({quoted}), but the code has {got} lines")
    steps = sorted(p for p in REPO.glob("step0*") if p.is_dir())
    for quoted in re.findall(r"(?:Diff: |step0\d_\w+` \()(\+\d+ [−-]\d+) lines", text):
        total = summed(diff_per_file(steps[steps.index(step) - 1], step), lambda n: True)
        if signed(quoted) != [tuple(total)]:
            problems.append(f"{step.name}/README.md: diff {quoted}, but diff counts +{total[0]} −{total[1]}")
    return problems
