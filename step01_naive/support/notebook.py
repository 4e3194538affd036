"""What the notebooks share to show the code and their results: a function's source (whole, or the lines that
match), a Markdown table, the lines a diff adds, and train.py's flags as it parses them. train.py never imports
it."""
import inspect
import subprocess

from IPython.display import Markdown, display

SKIPPED = ("notebook.ipynb", "README.md", "__pycache__", ".ipynb_checkpoints")  # what no diff table counts


def show(*objects):
    """Print the source of each function, class or module, as this step has it."""
    for obj in objects:
        print(inspect.getsource(obj))


def lines(module, *patterns):
    """Print the lines of a module's source that contain any of the patterns, with their line numbers."""
    source, start = inspect.getsourcelines(module)
    for i, line in enumerate(source, start or 1):
        if any(p in line for p in patterns):
            print(f"{module.__name__}.py:{i}: {line.rstrip()}")


def table(headers, rows):
    """Display rows under headers as a Markdown table."""
    head = ["| " + " | ".join(map(str, headers)) + " |", "|" + "---|" * len(headers)]
    display(Markdown("\n".join(head + ["| " + " | ".join(map(str, row)) + " |" for row in rows])))


def added_lines(path):
    """The lines of one file, as git counts them (`git diff --numstat` from nothing to the file)."""
    # git prints "added<TAB>deleted<TAB>name"; it exits with 1 because the files differ.
    out = subprocess.run(["git", "diff", "--no-index", "--numstat", "/dev/null", path],
                         capture_output=True, text=True).stdout
    return int(out.split()[0])


def numstat(prev, this):
    """(file, added, removed, how) for each file the diff from step folder prev to this shows, notebook and README
    left out; how is new, deleted or changed. Run from a step's folder: the folders are its siblings."""
    out = subprocess.run(["git", "diff", "--no-index", "--numstat", prev, this], cwd="..",
                         capture_output=True, text=True).stdout  # exit status 1 means "they differ"
    rows = []
    for line in out.splitlines():
        added, removed, path = line.split("\t")
        if any(skip in path for skip in SKIPPED):
            continue
        how = "new" if path.startswith("/dev/null") else "deleted" if path.endswith("/dev/null") else "changed"
        name = path.split(" => ")[0 if how == "deleted" else -1].replace("}", "").split("/", 1)[1]
        rows.append((name, int(added), int(removed), how))
    return rows


def parse(*flags, world):
    """train.py's flags as it parses them on `world` ranks, without CUDA: build_parser, then check_config fills
    in what depends on the world size and enforces the rules."""
    from config import build_parser, check_config  # this step's flags: the notebook runs in the step's folder

    return check_config(build_parser().parse_args([str(f) for f in flags]), world, False)
