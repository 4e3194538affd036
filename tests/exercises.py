"""The course's exercises, as data: one function (or a small group) per exercise that carries a step's idea.

tests/exercise.py reads this catalogue (list, start, check); tests/test_exercises.py proves every entry.
Each entry:

  id        "NN.name", NN the step
  step      the step folder the learner's copy is made from
  functions [(file, qualified name)]: each keeps its signature and docstring, its body becomes a stub
  summary   one line: the task, also the stub's message
  task      a paragraph: what to write and why
  checks    the graded checks, fastest first (see CHECKS in tests/exercise.py):
              ("replay", [schedule, ...])      the step's schedules replayed without a model, pp <= 4, m <= 8
              ("replay", [...], "pipedream")   ... then PipeDream's weight versions (tests/weight_versions.py)
              ("replay", [...], "two_way")     ... then DualPipe's eight phases (tests/two_way.py)
              ("equivalence", world, flags)    one small run against the single device (tests/harness.py)
              ("pytest", node id, ...)         the step's own tests of that function
              ("verbs",)                       step 01's verbs alone on a fake transport (tests/check_exercises.py)
  hints     three levels, shown one more at a time (check shows the first, --hint N up to N): the idea, where
            to look, the answer's key; a (key word, hint) pair is shown instead of the first level when the
            check's report holds the key word (a deadlock calls for another hint than a wrong microbatch)
  wrong     the typical wrong answers and the incomplete ones: (what, file, old text, new text, key words the
            diagnosis must show), old and new texts or tuples of them (several places); applied to the course's
            own code, each must fail its checks with those words in the diagnosis (tests/test_exercises.py)
  hide      (optional) [(file, text, instead)]: other text of the step's files that states the answer (a
            docstring's formula, a table); the learner's copy has `instead` (tests/test_exercises.py checks each
            text is in the code once, and gone from a started copy)
  right     other right answers: (what, file, old text, new text), applied the same way; each must pass
            every check (tests/test_exercises.py): the checks grade behaviour, not the course's wording

The entries are in tests/exercises_01_04.py, tests/exercises_05_08.py and (step 08's side road of the experts)
tests/exercises_experts.py; step 08's design challenges, where the
learner writes a schedule as a list instead of a function, in tests/exercises_design.py (their format is there). A function that moves to another
file or is renamed is updated there, in one place.
"""

from exercises_01_04 import EXERCISES as STEPS_01_04
from exercises_05_08 import EXERCISES as STEPS_05_08
from exercises_experts import EXERCISES as EXPERTS
from exercises_design import CHALLENGES

EXERCISES = STEPS_01_04 + STEPS_05_08 + EXPERTS
ALL = EXERCISES + CHALLENGES  # the order of `list` and of each pass's "next"

BY_ID = {exercise["id"]: exercise for exercise in ALL}
