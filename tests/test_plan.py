"""Capture plans: round trip, fingerprints, and plans that must not be trusted."""

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
