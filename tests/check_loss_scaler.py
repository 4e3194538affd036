"""Step 07's loss scalers driven through scripted overflow sequences; what they did, as JSON.

    python tests/check_loss_scaler.py STEP_DIR < scenarios.json > found.json

Run by test_loss_scaler.py, which writes the scenarios and computes what to expect
itself. Each scenario is {"config": DynamicGradScaler's keyword arguments, "flags":
found_inf for each step, "resume_at": k}; for each, this writes
  "dynamic":     the scaler's state before any update, then after each one;
  "scale_types": the type names of every scale it reported;
  "resumed":     the same from step k on, by a fresh scaler built with twice the initial
                 scale and loaded with the first one's state_dict after k steps (through JSON);
  "constant":    [scale, inv_scale] of a ConstantGradScaler at the initial scale, likewise,
                 and its scale after loading its own state_dict;
  "controls":    the states of each broken variant in CONTROLS, which the test must tell
                 apart from the rules. A check that cannot fail would pass them too.
A state is [scale, inv_scale, growth_tracker, hysteresis_tracker], the trackers read
through state_dict() (the variants change them only through load_state_dict()).
"""
import json
import sys

sys.path.insert(0, sys.argv[1])
from loss_scaler import ConstantGradScaler, DynamicGradScaler  # noqa: E402


def state(scaler):
    saved = scaler.state_dict()
    return [scaler.scale, scaler.inv_scale, saved["growth_tracker"], saved["hysteresis_tracker"]]


def run(scaler, flags, record=state):
    states = [record(scaler)]
    for found_inf in flags:
        scaler.update(bool(found_inf))
        states.append(record(scaler))
    return states


def overwrite(scaler, **fields):
    scaler.load_state_dict(dict(scaler.state_dict(), **fields))


def patched(config, fix):
    """A DynamicGradScaler whose update() calls fix(scaler, found_inf, state_before) after its own."""
    scaler = DynamicGradScaler(**config)
    real = scaler.update

    def update(found_inf):
        before = scaler.state_dict()
        real(found_inf)
        fix(scaler, found_inf, before)

    scaler.update = update
    return scaler


def refilled_by_clean_step(config):
    """Hysteresis read as overflows in a row: a clean step refills the tracker."""
    def fix(scaler, found_inf, before):
        if not found_inf:
            overwrite(scaler, hysteresis_tracker=config["hysteresis"])
    return patched(config, fix)


def not_refilled_by_growth(config):
    def fix(scaler, found_inf, before):
        if scaler.scale > before["scale"]:
            overwrite(scaler, hysteresis_tracker=before["hysteresis_tracker"])
    return patched(config, fix)


def clean_count_kept_through_overflow(config):
    def fix(scaler, found_inf, before):
        if found_inf:
            overwrite(scaler, growth_tracker=before["growth_tracker"])
    return patched(config, fix)


CONTROLS = {
    "hysteresis refilled by a clean step": refilled_by_clean_step,
    "hysteresis not refilled by growth": not_refilled_by_growth,
    "clean-step count kept through an overflow": clean_count_kept_through_overflow,
    "grows one clean step late": lambda c: DynamicGradScaler(**dict(c, growth_interval=c["growth_interval"] + 1)),
    "grows one clean step early": lambda c: DynamicGradScaler(**dict(c, growth_interval=c["growth_interval"] - 1)),
    "no floor": lambda c: DynamicGradScaler(**dict(c, min_scale=c["min_scale"] / 2**20)),
}


def check(config, flags, resume_at):
    dynamic = run(DynamicGradScaler(**config), flags)
    first = DynamicGradScaler(**config)
    run(first, flags[:resume_at])
    second = DynamicGradScaler(**dict(config, initial_scale=2 * config["initial_scale"]))
    second.load_state_dict(json.loads(json.dumps(first.state_dict())))
    constant = ConstantGradScaler(config["initial_scale"])
    constant_states = run(constant, flags, record=lambda s: [s.scale, s.inv_scale])
    reloaded = ConstantGradScaler(config["initial_scale"])
    reloaded.load_state_dict(json.loads(json.dumps(constant.state_dict())))
    return dict(dynamic=dynamic, scale_types=sorted({type(s[0]).__name__ for s in dynamic}),
                resumed=run(second, flags[resume_at:]),
                constant=dict(states=constant_states, reloaded_scale=reloaded.scale),
                controls={name: run(make(config), flags) for name, make in CONTROLS.items()})


if __name__ == "__main__":
    scenarios = json.load(sys.stdin)
    json.dump({name: check(**s) for name, s in scenarios.items()}, sys.stdout)
