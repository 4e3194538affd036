"""The READMEs stay true: each quoted command is run again and what it prints compared, as the notebooks'
saved outputs are (tests/test_saved_outputs.py); and every command they show names files, flags
and exercises that exist, and every relative link a file.

A quote is a fenced block right after an HTML comment, which GitHub does not show:

    <!-- output of: torchrun --nproc_per_node 4 step01_naive/train.py -->
    ```
    step   0  loss 5.6038    597.2 ms       1715 tokens/s
    ...
    ```

or, for several commands, `<!-- commands and output -->` before a block whose `$ ` lines are the commands,
each followed by what it prints. Compared is every line except what depends on the machine's speed: times,
tokens/s, the measured busy, bubble and all-to-all fractions, F:B:W ratios and the chain they make longest
(masked on both sides, MEASURED below).
torchrun's own log lines (its OMP_NUM_THREADS banner) are not compared: the test starts the ranks itself. A line
`...` stands for lines left out; the lines between two `...` must be printed together, in that order.

A quote that is one `error:` line is a refusal: it is checked in one process per step by check_bad_flags.py (the
step's own `train.parse_args`, before any process group exists, as under torchrun). Any other command runs as
harness.launch starts the course's runs (one process per rank with the environment torchrun gives, gloo, one
thread each), with `--device cpu`, in a scratch folder, the commands of one README in their order (a `--resume`
finds the checkpoint an earlier command saved); rank 0's output is compared, since rank 0 prints the step lines
and the reports. `python tests/...` commands run in a scratch copy of tests/, so no folder of yours is touched.
A failure names the README, the line of the quote and what was printed instead.

The numbers the READMEs quote are recomputed from the code (tests/readme_numbers.py): read times, diff sizes,
every function and file size.
"""
import json
import re
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import harness
from readme_numbers import path_table_problems, sizes_problems

REPO = Path(__file__).resolve().parent.parent
READMES = [REPO / "README.md", *sorted(REPO.glob("step0*/README.md")), REPO / "tests" / "README.md", REPO / "FAQ.md"]
CATALOGUE = sorted((REPO / "tests").glob("exercises*.py"))  # the exercises, by id="..."
QUOTE = re.compile(r"<!-- (?:output of: (?P<command>.+?)|commands and output) -->\n```[a-z]*\n(?P<body>.*?)```",
                   re.S)
TORCHRUN = re.compile(r"torchrun --nproc_per_node (\d+) (.*)")
TORCHRUN_LOG = re.compile(r"^[IWE]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ ")  # torchrun's own logging, not the course's
MEASURED = [  # what depends on the machine's speed, never on the code: masked on both sides
    (re.compile(r"\d+\.\d+ ms\b"), "<t> ms"),
    (re.compile(r"\d+ tokens/s"), "<r> tokens/s"),
    (re.compile(r"busy \d\.\d+ +bubble \d\.\d+"), "busy <b> bubble <b>"),
    (re.compile(r"all-to-all \d\.\d+$"), "all-to-all <f>"),  # step 08's experts: its share of the window
    (re.compile(r"hidden -?\d+%"), "hidden <p>%"),  # step 08's overlapped pair: the link time its compute hid
    (re.compile(r"F:B:W = 1:\d+\.\d+:\d+\.\d+( = \d\.\d+)?"), "F:B:W = <measured>"),
    (re.compile(r"\(\d+\.\d s\)"), "(<t> s)"),
    (re.compile(r"MiB in \d+\.\d+ s$"), "MiB in <t> s"),
    (re.compile(r"idle = \S+ \(the longest"), "idle = <the chain the measured times make> (the longest"),
]
LAUNCH_TIMEOUT = 120


def quotes(readme: Path):
    """[(line of the first quoted line, command, [(line, text), ...])] of one README, in its order."""
    text, found = readme.read_text(), []
    for match in QUOTE.finditer(text):
        first = text.count("\n", 0, match.start("body")) + 1
        lines = [(first + i, line) for i, line in enumerate(match["body"].rstrip("\n").split("\n"))]
        if match["command"]:
            found.append((first, match["command"].strip(), lines))
            continue
        for number, line in lines:
            if line.startswith("$ "):
                found.append((number, line[2:].strip(), []))
            elif found:
                found[-1][2].append((number, line))
    return found


def normal(line: str) -> str:
    for pattern, mask in MEASURED:
        line = pattern.sub(mask, line)
    return " ".join(line.split())


def mismatch(readme: Path, command: str, quoted, printed: str):
    """None if `printed` shows every quoted line as quoted, else one line naming the README's line."""
    where = readme.relative_to(REPO)
    shown = [normal(line) for line in printed.splitlines() if not TORCHRUN_LOG.match(line)]
    kept = [(n, line) for n, line in quoted if not TORCHRUN_LOG.match(line)]
    segments, current = [], []
    for n, line in kept:
        if line.strip() == "...":
            segments.append(current)
            current = []
        else:
            current.append((n, normal(line)))
    segments.append(current)
    at = 0
    for index, segment in enumerate(segments):
        if not segment:
            continue
        anchored = index == 0  # no `...` before it: the output starts here
        start = at if anchored else next((i for i in range(at, len(shown)) if shown[i] == segment[0][1]), None)
        if start is None:
            return f"{where}:{segment[0][0]}: `{command}` printed no line `{segment[0][1]}`"
        for offset, (n, want) in enumerate(segment):
            got = shown[start + offset] if start + offset < len(shown) else "(nothing more)"
            if got != want:
                return f"{where}:{n}: `{command}` printed `{got}` where the README quotes `{want}`"
        at = start + len(segment)
    if segments[-1] and at != len(shown):
        return f"{where}:{segments[-1][-1][0]}: `{command}` printed more after it: `{shown[at]}`"
    return None


def step_command(command: str):
    """(world, script, flags) of a `torchrun ... stepNN/train.py` or `python stepNN/train.py` command, else None."""
    launched = TORCHRUN.match(command)
    world, rest = (int(launched[1]), launched[2]) if launched else (1, command.removeprefix("python "))
    words = rest.split()
    if not words or not re.fullmatch(r"step0\d_\w+/train\.py", words[0]):
        return None
    return world, words[0], words[1:]


def is_refusal(quoted) -> bool:
    kept = [line for _, line in quoted if not TORCHRUN_LOG.match(line)]
    return len(kept) == 1 and kept[0].startswith("error:")


class Runner:
    """Runs the quoted commands, each once per README (stateless ones once in all), refusals per step in one go."""

    def __init__(self, scratch: Path):
        self.scratch, self.cache, self.refusals = scratch, {}, {}

    def printed(self, readme: Path, command: str, quoted) -> str:
        stateful = any(word in command for word in ("--save", "--resume"))
        key = (readme if stateful else None, command)
        if key not in self.cache:
            self.cache[key] = self._run(readme, command, quoted)
        return self.cache[key]

    def _run(self, readme, command, quoted):
        folder = self.scratch / "runs" / readme.parent.name  # beside the links to the step folders (_refuse_all)
        folder.mkdir(parents=True, exist_ok=True)
        if command.startswith("python tests/"):
            return self._tool(command)
        world, script, flags = step_command(command)
        if is_refusal(quoted):
            return self._refusal(script.split("/")[0], world, flags)
        flags = flags if "--device" in flags else [*flags, "--device", "cpu"]
        out = folder / f"launch{len(self.cache)}"
        try:
            harness.launch([sys.executable, str(REPO / script), *flags], world, out, LAUNCH_TIMEOUT, cwd=folder)
        except harness.RunFailed:
            pass  # a run that ends with an error (a diverged loss): its quote shows that error
        return (out / "rank0.log").read_text()

    def _refusal(self, step, world, flags):
        if not self.refusals:
            self._refuse_all()
        found = self.refusals[step][world, tuple(flags)]
        assert found["exit_code"] == 2, f"{step} {' '.join(flags)}: exit code {found['exit_code']}, not 2"
        return found["last_line"]

    def _refuse_all(self):
        """Every README's refusals, one check_bad_flags.py process per step, all started at once."""
        cases = {}
        for readme in READMES:
            for _, command, quoted in quotes(readme) if readme.exists() else []:
                if is_refusal(quoted) and step_command(command):
                    world, script, flags = step_command(command)
                    cases.setdefault(script.split("/")[0], []).append([world, flags])
        for step in REPO.glob("step0*"):  # a quoted path such as step01_naive/model.py names the course's file
            if not (self.scratch / step.name).exists():
                (self.scratch / step.name).symlink_to(step, target_is_directory=True)

        def refuse(step):
            path = self.scratch / f"{step}_refusals.json"
            path.write_text(json.dumps(cases[step]))
            done = harness.run([sys.executable, str(REPO / "tests" / "check_bad_flags.py"), str(REPO / step),
                                str(path)], cwd=self.scratch, capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, done.stderr[-3000:]
            return {(w, tuple(f)): r for (w, f), r in zip(cases[step], json.loads(done.stdout))}

        with ThreadPoolExecutor(len(cases)) as pool:  # one process per step, all at once
            self.refusals.update(zip(cases, pool.map(refuse, cases)))

    def _tool(self, command):
        """A course tool (tests/exercise.py) in a scratch copy of the course: it writes only there."""
        course = self.scratch / "course"
        if not course.exists():
            shutil.copytree(REPO / "tests", course / "tests", ignore=shutil.ignore_patterns("__pycache__"))
            for step in REPO.glob("step0*"):
                (course / step.name).symlink_to(step, target_is_directory=True)
        done = harness.run([sys.executable, *command.split()[1:]], cwd=course, capture_output=True, text=True,
                           timeout=300)
        return done.stdout + done.stderr


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    return Runner(tmp_path_factory.mktemp("readmes"))


QUOTED = [r for r in READMES if r.exists() and quotes(r)]


@pytest.mark.parametrize("readme", QUOTED, ids=[str(r.relative_to(REPO)) for r in QUOTED])
def test_quoted_output_is_what_the_command_prints(readme, runner):
    problems = [mismatch(readme, command, quoted, runner.printed(readme, command, quoted))
                for _, command, quoted in quotes(readme)]
    problems = [p for p in problems if p]
    assert not problems, "\n".join(problems) + "\n(run the command, paste what it prints)"


def test_an_edited_quote_fails_naming_the_readme_and_line(runner):
    """The control: the Start-here run and a refusal, each with one quoted line changed, must fail."""
    readme = REPO / "README.md"
    for _, command, quoted in quotes(readme)[:1] + [q for q in quotes(REPO / "step01_naive" / "README.md")
                                                     if is_refusal(q[2])][:1]:
        printed = runner.printed(readme, command, quoted)
        assert mismatch(readme, command, quoted, printed) is None
        n, line = next((n, line) for n, line in quoted if "loss" in line or line.startswith("error:"))
        edited = [(m, re.sub(r"\d", lambda d: str((int(d[0]) + 1) % 10), text, count=1) if m == n else text)
                  for m, text in quoted]
        found = mismatch(readme, command, edited, printed)
        assert found and found.startswith(f"README.md:{n}:"), found


# ---------------------------------------------------------------------------------- commands name what exists

def shown_commands(readme: Path):
    """[(line, command)]: every command of a README's bash blocks and `$ ` lines (continuations joined)."""
    found, text = [], readme.read_text()
    for block in re.finditer(r"```(bash)?\n(.*?)```", text, re.S):
        first = text.count("\n", 0, block.start(2)) + 1
        pending = ""
        for i, line in enumerate(block[2].split("\n")):
            if block[1] != "bash" and not line.startswith("$ "):
                continue
            line = (pending + " " + line.removeprefix("$ ").split(" #")[0]).strip()
            if line.endswith("\\"):
                pending = line[:-1]
                continue
            pending = ""
            if line:
                found.append((first + i, line))
    return found


def missing(command: str):
    """What a command names that the course does not have: a file, a step's flag, an exercise."""
    words, problems = command.split(), []
    for i, word in enumerate(words):
        if re.fullmatch(r"(step0\d_\w+|tests)/[\w/.]+\.(py|ipynb)", word) and not (REPO / word).exists():
            problems.append(f"no file {word}")
        if re.fullmatch(r"step0\d_\w+/train\.py", word) and (REPO / word).exists():
            sources = "".join(p.read_text() for p in (REPO / word).parent.rglob("*.py"))
            problems += [f"{word} has no flag {flag}" for flag in words[i + 1:]
                         if flag.startswith("--") and f'"{flag.split("=")[0]}"' not in sources]
        if word == "tests/exercise.py" and i + 2 < len(words) and words[i + 1] in ("start", "check", "mistake"):
            if not any(f'id="{words[i + 2]}"' in catalogue.read_text() for catalogue in CATALOGUE):
                problems.append(f"no exercise {words[i + 2]}")
    return problems


def broken_links(readme: Path, text: str):
    """[(line, target)]: the README's relative links whose file or folder does not exist."""
    return [(text.count("\n", 0, link.start()) + 1, link[1]) for link in re.finditer(r"\]\(([^)#\s]+)[^)]*\)", text)
            if not re.match(r"[a-z]+://", link[1]) and not (readme.parent / link[1]).exists()]


def test_readme_commands_name_files_and_flags_that_exist():
    problems = [f"{readme.relative_to(REPO)}:{n}: `{command}`: {p}" for readme in READMES if readme.exists()
                for n, command in shown_commands(readme) for p in missing(command)]
    problems += [f"{readme.relative_to(REPO)}:{n}: no file {target}" for readme in READMES if readme.exists()
                 for n, target in broken_links(readme, readme.read_text())]
    assert broken_links(REPO / "README.md", "see [it](step09_none/README.md)"), "a broken link is not caught"
    assert not problems, "\n".join(problems)
    controls = ["torchrun --nproc_per_node 2 step04_1f1b/train.py --no-such-flag", "python step09_none/train.py",
                "python tests/exercise.py start 04.nothing"]
    assert all(missing(c) for c in controls), [c for c in controls if not missing(c)]


def test_ci_runs_the_test_commands_of_the_readme():
    """.ci/run runs the README's test commands, as written and in order: each `pytest` command shown there,
    but those that narrow the run to a part (-k). Control: a CI that adds a flag to one of them fails."""
    def ci_commands(script: str):
        return [line.split(" #")[0].strip() for line in script.splitlines() if line.startswith("pytest")]

    shown = [command for _, command in shown_commands(REPO / "README.md")
             if command.startswith("pytest") and " -k " not in command]
    script = (REPO / ".ci" / "run").read_text()
    assert shown and ci_commands(script) == shown, f"README: {shown}; .ci/run: {ci_commands(script)}"
    assert ci_commands(script.replace("pytest -m", "pytest -x -m")) != shown, "the control passed"


# ---------------------------------------------------------------------------------- numbers that cannot go stale

def test_quoted_sizes_read_times_and_diffs_are_the_codes():
    """Read times, diff sizes and every function or file size the READMEs quote are recomputed from the code.
    Control: each kind of number, drifted by one in the text, is caught."""
    top = (REPO / "README.md").read_text()
    problems = path_table_problems(top)
    for readme in sorted(REPO.glob("step0*/README.md")):
        problems += sizes_problems(readme.parent, readme.read_text())
    assert not problems, "\n".join(problems)
    drifted = re.sub(r"\| (\d+) min \|", lambda m: f"| {int(m[1]) + 1} min |", top, count=1)
    assert path_table_problems(drifted), "a drifted read time is not caught"
    drifted = re.sub(r"\| \+(\d+) ", lambda m: f"| +{int(m[1]) + 1} ", top, count=1)
    assert path_table_problems(drifted), "a drifted diff size is not caught"
    step01 = (REPO / "step01_naive" / "README.md").read_text()
    assert sizes_problems(REPO / "step01_naive", step01.replace("`recv_forward` (6 lines)", "`recv_forward` (7 lines)"))
    step02 = (REPO / "step02_gpipe" / "README.md").read_text()
    assert sizes_problems(REPO / "step02_gpipe", re.sub(r"\(\+(\d+) ", lambda m: f"(+{int(m[1]) + 1} ", step02))
