"""autograph.warmup(): capture before traffic, from examples, buckets and plans."""

import json
import logging

import pytest
import torch
from torch import nn

import autograph

pytestmark = pytest.mark.usefixtures("standin")


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def test_example_call_is_captured_before_traffic():
    model = mlp()
    g = autograph.graphed(model)
    with torch.no_grad():
        (entry,) = autograph.warmup(g, torch.randn(3, 4))
        assert entry["captured"] and entry["capture_seconds"] > 0
        assert entry["graph_memory_bytes"] > 0
        x = torch.randn(3, 4)
        torch.testing.assert_close(g(x), model(x))
    s = autograph.stats(g)
    assert (s["captures"], s["replays"]) == (1, 1)


def test_every_bucket_largest_first():
    @autograph.graphed(buckets=[1, 2, 4, 8], batch_dims={"table": None})
    def f(x, table):
        return x @ table

    table = torch.randn(4, 3)
    with torch.no_grad():
        report = autograph.warmup(f, torch.randn(3, 4), table)
        assert [r["what"] for r in report] == ["batch 8", "batch 4", "batch 2", "batch 1"]
        assert all(r["captured"] for r in report)
        captures = autograph.stats(f)["captures"]
        for n in range(1, 9):
            x = torch.randn(n, 4)
            torch.testing.assert_close(f(x, table), x @ table)
    assert autograph.stats(f)["captures"] == captures == 4


def test_disagreeing_batch_arguments_are_a_clear_error():
    @autograph.graphed(buckets=[2, 4])
    def f(x, table):
        return x @ table

    with torch.no_grad(), pytest.raises(ValueError, match="batch_dims=None"):
        autograph.warmup(f, torch.randn(3, 4), torch.randn(4, 3))


def test_batch_sizes_need_buckets():
    """Without buckets nothing says which arguments carry the batch: a clear error,
    before any call (not a report of sizes "not captured")."""
    g = autograph.graphed(mlp())
    with pytest.raises(ValueError, match=r"batch_sizes=\[3\] needs .*buckets=.*Sequential.* "
                                         r"has none.*one example call of each batch size"):
        autograph.warmup(g, torch.randn(2, 4), batch_sizes=[3])
    assert autograph.stats(g)["calls"] == 0
    with pytest.raises(ValueError, match="ints >= 1"):
        autograph.warmup(autograph.graphed(mlp(), buckets=[2]), torch.randn(2, 4),
                         batch_sizes=[0])


def test_a_batch_size_between_buckets_reports_the_bucket_that_serves_it():
    @autograph.graphed(buckets=[2, 4, 8])
    def f(x):
        return x * 2

    with torch.no_grad():
        (entry,) = autograph.warmup(f, torch.randn(2, 4), batch_sizes=[3])
        assert entry["what"] == "batch 3" and entry["bucket"] == 4 and entry["captured"]
        calls = autograph.stats(f)["calls"]
        # bucket 4 is captured already: one call (a replay) says so, for 3 and for 4
        report = autograph.warmup(f, torch.randn(2, 4), batch_sizes=[3, 4, 16])
    assert autograph.stats(f)["calls"] - calls == 3  # one each; 16 eagerly: a miss
    assert [(r["what"], r["bucket"], r["captured"], r.get("reason")) for r in report] == [
        ("batch 16", None, False, "bucket_miss"),
        ("batch 4", 4, False, "already captured"),
        ("batch 3", 4, False, "already captured"),
    ]
    assert autograph.stats(f)["captures"] == 1


def test_an_example_captured_before_is_reported_as_such():
    g = autograph.graphed(mlp())
    with torch.no_grad():
        assert autograph.warmup(g, torch.randn(3, 4))[0]["captured"]
        (entry,) = autograph.warmup(g, torch.randn(3, 4))
    assert not entry["captured"] and entry["reason"] == "already captured"
    assert "bucket" not in entry
    s = autograph.stats(g)
    assert (s["calls"], s["captures"], s["replays"]) == (4, 1, 1)  # the second: one replay


def test_a_call_that_cannot_be_graphed_is_reported():
    @autograph.graphed
    def f(x):
        return x * x.sum().item()

    with torch.no_grad():
        (entry,) = autograph.warmup(f, torch.randn(3))
    assert not entry["captured"] and entry["reason"] == "capture_failed"


def test_not_graphed_raises():
    with pytest.raises(TypeError, match="not graphed"):
        autograph.warmup(nn.Linear(2, 2), torch.randn(1, 2))


def serve(g, shapes):
    with torch.no_grad():
        for n in shapes:
            g(torch.randn(n, 4))


def test_plan_round_trip_captures_the_recorded_keys(tmp_path):
    model = mlp()
    g = autograph.graphed(model)
    serve(g, [2, 2, 2, 5, 5, 5, 2])
    path = tmp_path / "plan.json"
    autograph.save_plan(path)
    autograph.reset(g)  # as if the process had restarted
    with torch.no_grad():
        report = autograph.warmup(g, plan=path)
    assert [r["captured"] for r in report] == [True, True]
    captures = autograph.stats(g)["captures"]
    serve(g, [2, 5])
    assert autograph.stats(g)["captures"] == captures  # no capture in traffic


def test_plan_for_another_model_captures_nothing(tmp_path, caplog):
    model = mlp()
    g = autograph.graphed(model)
    serve(g, [2, 2, 2])
    path = tmp_path / "plan.json"
    autograph.save_plan(path)
    autograph.reset(g)
    with torch.no_grad():
        model[0].weight.add_(0.01)
    caplog.set_level(logging.WARNING, logger="autograph")
    with torch.no_grad():
        assert autograph.warmup(g, plan=path) == []
    assert autograph.stats(g)["graphs"] == 0
    assert any("content" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("field", ["gpu_name", "driver", "torch"])
def test_plan_from_another_environment_captures_nothing(tmp_path, caplog, field):
    g = autograph.graphed(mlp())
    serve(g, [3, 3, 3])
    path = tmp_path / "plan.json"
    autograph.save_plan(path)
    doc = json.loads(path.read_text())
    doc["environment"][field] = "elsewhere"
    path.write_text(json.dumps(doc))
    autograph.reset(g)
    caplog.set_level(logging.WARNING, logger="autograph")
    with torch.no_grad():
        assert autograph.warmup(g, plan=path) == []
    assert any(field in r.getMessage() for r in caplog.records)


def test_plan_keys_with_in_place_arguments_use_the_example(tmp_path):
    @autograph.graphed
    def step(cache, pos, v):
        cache.index_copy_(0, pos, v)
        return cache.sum(0)

    cache = torch.zeros(8, 2)
    with torch.no_grad():
        for i in range(4):
            step(cache, torch.tensor([i]), torch.randn(1, 2))
    path = tmp_path / "plan.json"
    autograph.save_plan(path)
    step.reset()
    with torch.no_grad():
        report = autograph.warmup(step, cache, torch.tensor([0]), torch.randn(1, 2), plan=path)
    assert report[0]["captured"]


def test_corrupt_plans_raise_value_errors(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text("{not json")
    g = autograph.graphed(mlp())
    with pytest.raises(ValueError, match="corrupt or truncated"):
        autograph.warmup(g, plan=path)


def test_resized_examples_keep_their_memory_format():
    """``warmup(batch_sizes=...)`` resizes the example in its own layout: channels-last
    traffic afterwards replays the graphs warmed up, capturing nothing new."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                      nn.Flatten()).eval()
    m = m.to(memory_format=torch.channels_last)
    g = autograph.graphed(m, buckets=[2, 4, 8])
    example = torch.randn(3, 3, 8, 8).to(memory_format=torch.channels_last)
    with torch.no_grad():
        autograph.warmup(g, example)  # every bucket, from a 3-row example
        before = autograph.stats(g)
        assert before["captures"] == 3
        for n in (1, 3, 5, 8, 2, 4):
            x = torch.randn(n, 3, 8, 8).to(memory_format=torch.channels_last)
            torch.testing.assert_close(g(x), m(x))
    after = autograph.stats(g)
    assert after["captures"] == 3, after
    assert after["replays"] - before["replays"] >= 5, after  # all but a learning call


def test_an_example_without_rows_is_a_clear_error():
    g = autograph.graphed(nn.Linear(4, 4), buckets=[2, 4])
    with pytest.raises(ValueError, match="at least one row"):
        autograph.warmup(g, torch.randn(0, 4), batch_sizes=[2, 4])
