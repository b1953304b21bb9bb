"""Capture plans: round trip, fingerprints, and plans that must not be trusted."""

import contextlib
import json
import os

import pytest
import torch
from torch import nn

import autograph
from autograph import plan

pytestmark = pytest.mark.usefixtures("standin")


def run(fn, *args, times=3):
    with torch.no_grad():
        for _ in range(times):
            fn(*args)


def test_round_trip(tmp_path):
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
    g = autograph.graphed(model, warmup=0)
    run(g, torch.randn(2, 4))
    run(g, torch.randn(5, 4))

    @autograph.graphed(warmup=0, buckets=[2, 4])
    def scale(x, k=2.0):
        return x * k

    for n in (1, 1, 3, 3, 4):  # the first call learns which arguments carry the batch
        run(scale, torch.randn(n, 3), times=1)

    def step(cache, pos, v):
        cache.index_copy_(0, pos, v)
        return cache.sum(0)

    stepper = autograph.graphed(step, warmup=0)
    cache = torch.zeros(8, 2)
    run(stepper, cache, torch.tensor([1]), torch.randn(1, 2))

    path = tmp_path / "plan.json"
    autograph.save_plan(path)
    doc = plan.load(path)
    assert doc["environment"] == plan.environment()
    mine = doc["callables"][_name(g)]
    assert [k["leaves"][0]["tensor"]["shape"] for k in mine["keys"]] == [[2, 4], [5, 4]]
    assert mine["keys"][0]["leaves"][0]["tensor"]["dtype"] == "torch.float32"
    assert mine["keys"][0]["modes"][0] is False  # grad mode
    assert all(mine["keys"][0]["training"])  # the model and its submodules train
    assert mine["model"] == plan.model_fingerprint([model])
    bucketed = doc["callables"][_name(scale)]
    assert bucketed["bucket_hits"] == {"2": 1, "4": 3}
    assert [k["leaves"][0]["tensor"]["shape"][0] for k in bucketed["keys"]] == [2, 4]
    steps = doc["callables"][_name(stepper)]
    assert steps["inplace"] == [[0]]  # the cache is written in place
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".autograph-plan-")]


def _name(graphed):
    engines = graphed._self_dispatch.engines() if hasattr(graphed, "_self_dispatch") \
        else [graphed._self_engine]
    return engines[0].stats.name


@pytest.mark.parametrize(
    "field", ["gpu_name", "gpu_arch", "driver", "cuda_runtime", "torch", "autograph"]
)
def test_every_environment_field_is_checked(field):
    here = plan.environment()
    there = dict(here, **{field: "something else"})
    (difference,) = plan.differences(there, here)
    assert difference.startswith(f"{field}: 'something else' != ")


@pytest.mark.parametrize(
    "change, field",
    [
        (lambda m: m[0].weight.data.add_(1e-3), "content"),
        (lambda m: m.register_buffer("extra", torch.zeros(1)), "tensors"),
        (lambda m: setattr(m, "1", nn.Tanh()), "structure"),
        (lambda m: m.double(), "tensors"),
    ],
    ids=["weights", "new-buffer", "new-layer", "dtype"],
)
def test_model_fingerprint_sees_each_kind_of_change(change, field):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    before = plan.model_fingerprint([model])
    change(model)
    after = plan.model_fingerprint([model])
    assert any(d.startswith(field) for d in plan.differences(before, after))
    torch.manual_seed(0)
    assert plan.model_fingerprint([nn.Sequential(nn.Linear(4, 4), nn.ReLU())]) == before


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "cannot be read"),
        ('{"format": "autograph-plan", "version": 1, "environ', "corrupt or truncated"),
        ("[1, 2, 3]", "is not an autograph plan"),
        ('{"format": "something"}', "is not an autograph plan"),
        ('{"format": "autograph-plan", "version": 99}', "has version 99"),
        (f'{{"format": "autograph-plan", "version": {plan.VERSION}}}', "missing its sections"),
    ],
    ids=["missing", "truncated", "not-a-dict", "other-format", "other-version", "no-sections"],
)
def test_unreadable_plans_give_a_clear_error_and_harm_nothing(tmp_path, content, message):
    path = tmp_path / "plan.json"
    if content is not None:
        path.write_text(content)
    g = autograph.graphed(nn.Linear(3, 3), warmup=0)
    run(g, torch.randn(1, 3))
    with pytest.raises(plan.PlanError, match=message):
        plan.load(path)
    run(g, torch.randn(1, 3))
    assert autograph.stats(g)["replays"] == 5


def test_saving_over_a_plan_replaces_it_whole(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text("old")
    autograph.save_plan(path)
    assert json.loads(path.read_text())["format"] == "autograph-plan"


# -- warming a plan up under the modes it recorded ----------------------------------------
def _autocast_no_grad():
    stack = contextlib.ExitStack()
    stack.enter_context(torch.no_grad())
    stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
    return stack


# recorded under the first, warmed up under the second (the caller's own modes)
MODES = {
    "inference_mode": (torch.inference_mode, contextlib.nullcontext),
    "no_grad": (torch.no_grad, contextlib.nullcontext),
    "autocast": (_autocast_no_grad, contextlib.nullcontext),
    "grad": (contextlib.nullcontext, torch.inference_mode),
}


def _recorded(tmp_path, model, modes, x, edit=None):
    """A plan of ``model`` graphed and called under ``modes``, its graphs then dropped
    as if the process had restarted; ``edit`` changes each of its keys."""
    g = autograph.graphed(model)
    with modes():
        for _ in range(3):
            g(x)
    path = tmp_path / "plan.json"
    autograph.save_plan(path)
    if edit is not None:
        doc = json.loads(path.read_text())
        for key in doc["callables"][_name(g)]["keys"]:
            edit(key)
        path.write_text(json.dumps(doc))
    autograph.reset(g)
    return g, path


@pytest.mark.parametrize("recorded, caller", MODES.values(), ids=list(MODES))
def test_plan_keys_are_warmed_up_under_their_recorded_modes(tmp_path, recorded, caller):
    """The first call under the recorded modes replays the graph the plan warmed up,
    whatever the modes ``warmup()`` was called in."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU())
    x = torch.randn(2, 8)
    g, path = _recorded(tmp_path, model, recorded, x)
    grad = torch.is_grad_enabled()
    with caller():
        report = autograph.warmup(g, plan=path)
    assert [r["captured"] for r in report] == [True], report
    assert torch.is_grad_enabled() == grad and not torch.is_autocast_enabled("cpu")
    before = autograph.stats(g)
    with recorded():
        out = g(x)
    after = autograph.stats(g)
    assert (after["replays"], after["captures"]) == (before["replays"] + 1, before["captures"])
    with recorded():
        torch.testing.assert_close(out, model(x))


def test_a_plan_recorded_in_eval_mode_is_not_captured_in_train_mode(tmp_path):
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU()).eval()
    g, path = _recorded(tmp_path, model, torch.no_grad, torch.randn(2, 8))
    model.train()
    with torch.no_grad():
        (entry,) = autograph.warmup(g, plan=path)
    assert not entry["captured"]
    assert entry["reason"] == "recorded in eval mode, the modules are in train mode"
    assert model.training and autograph.stats(g)["graphs"] == 0  # left as the user set it


@pytest.fixture
def deterministic():
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.fixture
def float64():
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize("flag, reason", [
    ("deterministic", "recorded with deterministic algorithms False, now True"),
    ("float64", "recorded with default dtype 'torch.float32', now 'torch.float64'"),
])
def test_a_plan_recorded_with_other_numerics_flags_is_not_captured(tmp_path, request, flag,
                                                                   reason):
    """Numerics flags are the user's: warmup neither changes them nor captures a key
    that the process would never call."""
    g, path = _recorded(tmp_path, nn.Linear(8, 4), torch.no_grad, torch.randn(2, 8))
    request.getfixturevalue(flag)
    with torch.no_grad():
        (entry,) = autograph.warmup(g, plan=path)
    assert not entry["captured"] and entry["reason"] == reason
    assert autograph.stats(g)["graphs"] == 0
    assert torch.are_deterministic_algorithms_enabled() == (flag == "deterministic")


def test_a_plan_flag_is_named_in_the_reason(tmp_path):
    """A numerics flag changed in the plan is named, with both values."""
    seen = {}

    def other_precision(key):
        seen["now"] = now = key["modes"][3]  # CPU matmul: 'none' ('ieee' once legacy-set)
        seen["then"] = key["modes"][3] = "tf32" if now == "bf16" else "bf16"

    g, path = _recorded(tmp_path, nn.Linear(8, 4), torch.no_grad, torch.randn(2, 8),
                        other_precision)
    (entry,) = autograph.warmup(g, plan=path)
    assert entry["reason"] == (f"recorded with CPU matmul precision {seen['then']!r}, "
                               f"now {seen['now']!r}")


def test_a_capture_under_another_key_than_the_plans_is_not_reported_captured(tmp_path):
    """Grad mode with inference mode cannot be entered: the key captured has other
    modes than the plan's, and the report says so."""
    def impossible(key):
        key["modes"][0] = True

    g, path = _recorded(tmp_path, nn.Linear(8, 4), torch.inference_mode, torch.randn(2, 8),
                        impossible)
    (entry,) = autograph.warmup(g, plan=path)
    assert not entry["captured"]
    assert entry["reason"] == "the key captured differs from the plan's in modes"


def test_plan_keys_without_modes_are_warmed_up_under_the_callers(tmp_path):
    """Keys of older plans, without modes or training flags, are captured as before."""
    def old(key):
        del key["modes"], key["training"]

    x = torch.randn(2, 8)
    g, path = _recorded(tmp_path, nn.Linear(8, 4), torch.no_grad, x, old)
    with torch.no_grad():
        (entry,) = autograph.warmup(g, plan=path)
        assert entry["captured"]
        replays = autograph.stats(g)["replays"]
        g(x)
    assert autograph.stats(g)["replays"] == replays + 1


def test_a_plan_is_used_by_a_wrapper_not_called_yet(tmp_path):
    """The next start: a new wrapper of the same model, warmed up from the plan before
    its first call (its modules' training flags were read as none, so every key was
    refused), then replaying its first call."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU()).eval()
    x = torch.randn(2, 8)
    g = autograph.graphed(model)
    run(g, x)
    path = tmp_path / "plan.json"
    autograph.save_plan(path)
    fresh = autograph.graphed(nn.Sequential(nn.Linear(8, 4), nn.ReLU()).eval())
    fresh.load_state_dict(model.state_dict())
    doc = json.loads(path.read_text())  # the name the new wrapper gets in this process
    doc["callables"][_name(fresh)] = doc["callables"].pop(_name(g))
    path.write_text(json.dumps(doc))
    with torch.no_grad():
        (entry,) = autograph.warmup(fresh, plan=path)
        assert entry["captured"], entry
        torch.testing.assert_close(fresh(x), model(x))
    assert autograph.stats(fresh)["replays"] == 1, autograph.stats(fresh)


def test_a_plan_keeps_a_negative_nan_argument(tmp_path):
    """A float argument is saved by its bits (``walk.float_bits``): a -NaN's key reads
    back as -NaN, and the plan's graph is the one the call replays."""
    @autograph.graphed(warmup=0)
    def signed(x, s):
        return torch.copysign(x, torch.tensor(s))

    x, s = torch.rand(3) + 1, -float("nan")
    run(signed, x, s)
    path = tmp_path / "plan.json"
    autograph.save_plan(path)
    autograph.reset(signed)
    with torch.no_grad():
        (entry,) = autograph.warmup(signed, plan=path)
        assert entry["captured"], entry
        before = autograph.stats(signed)
        torch.testing.assert_close(signed(x, s), -x)
    after = autograph.stats(signed)
    assert (after["replays"], after["captures"]) == (before["replays"] + 1, before["captures"])
