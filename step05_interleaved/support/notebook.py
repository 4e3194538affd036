"""What the notebooks share to show the code and their results: a function's source, a Markdown table, and
train.py's flags as it parses them. train.py never imports it."""
import inspect

from IPython.display import Markdown, display


def show(*objects):
    """Print the source of each function, class or module, as this step has it."""
    for obj in objects:
        print(inspect.getsource(obj))


def table(headers, rows):
    """Display rows under headers as a Markdown table."""
    lines = ["| " + " | ".join(map(str, headers)) + " |", "|" + "---|" * len(headers)]
    display(Markdown("\n".join(lines + ["| " + " | ".join(map(str, row)) + " |" for row in rows])))


def parse(*flags, world):
    """train.py's flags as it parses them on `world` ranks, without CUDA: build_parser, then check_config fills
    in what depends on the world size and enforces the rules."""
    from config import build_parser, check_config  # this step's flags: the notebook runs in the step's folder

    return check_config(build_parser().parse_args([str(f) for f in flags]), world, False)
