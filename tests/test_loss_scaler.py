"""Step 07's loss scalers against Megatron-LM's rules, on scripted overflow sequences.

The scalers run in a subprocess (tests/check_loss_scaler.py: the pytest process never imports a
step's modules). What they report is compared with expected_states below, which reads the rules
off the history of overflows instead of keeping Megatron's counters, and for the named scenarios
also with scales written out by hand. Broken variants of the scaler (check_loss_scaler.CONTROLS) must
fail the same comparison.
"""
import json
import random
import sys

import pytest

from conftest import STEPS
import harness
from harness import REPO

SCALER_STEPS = [s for s in STEPS if s >= "step07"]
CHECKS = REPO / "tests" / "check_loss_scaler.py"


def scaler_args(initial_scale=2.0**16, min_scale=1.0, growth_interval=4, hysteresis=2):
    return dict(initial_scale=initial_scale, min_scale=min_scale, growth_interval=growth_interval,
                hysteresis=hysteresis)


GROWTH = "growth after exactly growth_interval clean steps, counted from the last overflow or growth"
# name: (DynamicGradScaler's arguments, found_inf for each step, log2 of the scale after each step)
SCENARIOS = {
    "hysteresis counts overflows since the last growth, not in a row":
        (scaler_args(), [1, 0, 1], [16, 16, 15]),
    "once hysteresis is spent, every overflow backs off until the next growth":
        (scaler_args(), [1, 1, 1, 0, 1, 0, 0, 1], [16, 15, 14, 14, 13, 13, 13, 12]),
    "the scale never goes below min_scale":
        (scaler_args(initial_scale=2.0**4, min_scale=2.0**2, hysteresis=1), [1, 1, 1, 0, 1, 1], [3, 2, 2, 2, 2, 2]),
    GROWTH:
        (scaler_args(), [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0],
         [16, 16, 16, 17, 17, 17, 17, 18, 18, 18, 18, 18, 18, 18, 18, 19, 19]),
    "growth refills the hysteresis tracker":
        (scaler_args(growth_interval=2), [1, 0, 0, 1, 1, 0, 1], [16, 16, 17, 17, 16, 16, 15]),
    "Megatron's defaults from 2^32: 17 skipped steps down to 2^16, growth 1000 clean steps later":
        (scaler_args(initial_scale=2.0**32, growth_interval=1000), [1] * 17 + [0] * 1000,
         [32] + list(range(31, 15, -1)) + [16] * 999 + [17]),
    "a random sequence":  # two steps in five overflow: 40 growths, 42 backoffs, 14 overflows at the floor
        (scaler_args(min_scale=2.0**12, growth_interval=3, hysteresis=3),
         random.Random(7).choices([0, 1], weights=[3, 2], k=300), None),
}
# Each broken variant in check_loss_scaler.CONTROLS, and the scenario that must catch it.
CAUGHT_BY = {
    "hysteresis refilled by a clean step": "hysteresis counts overflows since the last growth, not in a row",
    "hysteresis not refilled by growth": "growth refills the hysteresis tracker",
    "clean-step count kept through an overflow": GROWTH,
    "grows one clean step late": GROWTH,
    "grows one clean step early": GROWTH,
    "no floor": "the scale never goes below min_scale",
}


def expected_states(flags, initial_scale, min_scale, growth_interval, hysteresis):
    """[scale, 1/scale, growth_tracker, hysteresis_tracker] before any step and after each one.

    Megatron's rules, stated without its counters: the scale doubles at every multiple of
    growth_interval within a run of clean steps (a run ends at an overflow); an overflow
    halves it, not below min_scale, when it is at least the hysteresis-th overflow since the
    last growth. The trackers: the clean steps into the current window, and hysteresis minus
    the overflows since the last growth (below zero once it is spent)."""
    states = [[initial_scale, 1 / initial_scale, 0, hysteresis]]
    scale, run, last_growth = initial_scale, 0, -1
    for step, found_inf in enumerate(flags):
        run = 0 if found_inf else run + 1
        if run > 0 and run % growth_interval == 0:
            scale, last_growth = scale * 2, step
        overflows = sum(flags[last_growth + 1: step + 1])
        if found_inf and overflows >= hysteresis:
            scale = max(scale / 2, min_scale)
        states.append([scale, 1 / scale, run % growth_interval, hysteresis - overflows])
    return states


def resume_point(config, states):
    """The first step after which every field of the state differs from that of a fresh scaler
    at twice the initial scale, so that resuming from there shows any field that is not loaded."""
    fresh = [2 * config["initial_scale"], 0.5 / config["initial_scale"], 0, config["hysteresis"]]
    return next(k for k in range(1, len(states) - 1) if all(a != b for a, b in zip(states[k], fresh)))


def first_difference(found, expected, start=0):
    """Where two state sequences part, for the failure message."""
    if len(found) != len(expected):
        return f"{len(found)} states, expected {len(expected)}"
    step = next(i for i, (a, b) in enumerate(zip(found, expected)) if a != b)
    return f"after {start + step} steps: {found[step]}, expected {expected[step]} ([scale, 1/scale, trackers])"


def run_checks(step_dir):
    scenarios = {name: dict(config=config, flags=flags,
                            resume_at=resume_point(config, expected_states(flags, **config)))
                 for name, (config, flags, _) in SCENARIOS.items()}
    done = harness.run([sys.executable, str(CHECKS), str(step_dir)], input=json.dumps(scenarios),
                       capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    return scenarios, json.loads(done.stdout)


@pytest.mark.parametrize("step", SCALER_STEPS)
def test_dynamic_scaler_follows_megatron_rules(step, step_dirs):
    """Scale, 1/scale and both trackers after every step, exactly (all powers of two);
    the scale a Python float."""
    _, found = run_checks(step_dirs[step])
    for name, (config, flags, by_hand) in SCENARIOS.items():
        assert found[name]["scale_types"] == ["float"], name
        expected = expected_states(flags, **config)
        assert found[name]["dynamic"] == expected, f"{name}: {first_difference(found[name]['dynamic'], expected)}"
        if by_hand:
            assert [s[0] for s in found[name]["dynamic"][1:]] == [2.0**e for e in by_hand], name


@pytest.mark.parametrize("step", SCALER_STEPS)
def test_state_dict_round_trip_mid_sequence(step, step_dirs):
    """A fresh scaler (built with another initial scale) loaded with the state_dict after k steps,
    passed through JSON, continues exactly as the uninterrupted one."""
    scenarios, found = run_checks(step_dirs[step])
    for name, (config, flags, _) in SCENARIOS.items():
        k = scenarios[name]["resume_at"]
        expected = expected_states(flags, **config)[k:]
        assert found[name]["resumed"] == expected, \
            f"{name}, resumed after {k} steps: {first_difference(found[name]['resumed'], expected, start=k)}"


@pytest.mark.parametrize("step", SCALER_STEPS)
def test_constant_scaler_never_changes(step, step_dirs):
    """The same scale and 1/scale through every sequence, and after loading its own state_dict."""
    _, found = run_checks(step_dirs[step])
    for name, (config, flags, _) in SCENARIOS.items():
        scale = config["initial_scale"]
        assert found[name]["constant"]["states"] == [[scale, 1 / scale]] * (len(flags) + 1), name
        assert found[name]["constant"]["reloaded_scale"] == scale, name


@pytest.mark.parametrize("step", SCALER_STEPS)
def test_each_broken_scaler_is_caught(step, step_dirs):
    """Negative controls: each variant in check_loss_scaler.CONTROLS breaks one rule, and the
    comparison above must report a mismatch on the scenario written for that rule."""
    _, found = run_checks(step_dirs[step])
    for name in SCENARIOS:
        assert set(found[name]["controls"]) == set(CAUGHT_BY), "each control in check_loss_scaler.py needs its scenario"
    for control, name in CAUGHT_BY.items():
        config, flags, _ = SCENARIOS[name]
        assert found[name]["controls"][control] != expected_states(flags, **config), f"'{control}' passed '{name}'"
