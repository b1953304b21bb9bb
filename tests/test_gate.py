"""min_speedup: a graph that does not beat eager is dropped and its key runs eagerly."""

import time

import pytest
import torch
from torch import nn

import autograph
from autograph.gate import TRIALS

NOT_WORTH = autograph.EagerReason.NOT_WORTH.value

pytestmark = pytest.mark.usefixtures("standin")


def make(sleep):
    m = nn.Linear(8, 8)

    def f(x):
        time.sleep(sleep)  # Python time: spent eagerly, never replayed
        return m(x).relu()

    return f


def run(g, f, shape, n):
    with torch.no_grad():
        for _ in range(n):
            x = torch.randn(*shape)
            torch.testing.assert_close(g(x), f(x))


def test_graph_that_pays_is_kept(standin):
    f = make(0.003)
    g = autograph.graphed(f, min_speedup=2.0)
    run(g, f, (2, 8), 3 + TRIALS + 3)
    s = autograph.stats(g)
    assert s["graphs"] == 1 and s["replays"] == TRIALS + 3 and s["eager"] == 2
    assert NOT_WORTH not in s["eager_reasons"]


def test_graph_that_does_not_pay_runs_eagerly(standin, caplog):
    standin.replay_delay = 0.01
    f = make(0.0)
    g = autograph.graphed(f, min_speedup=1.0)
    run(g, f, (2, 8), 3 + TRIALS + 4)
    s = autograph.stats(g)
    assert s["graphs"] == 0 and s["graph_memory_bytes"] == 0
    assert s["replays"] == TRIALS and s["captures"] == 1
    assert s["eager_reasons"][NOT_WORTH] == 4
    assert "min_speedup" in caplog.text


def test_gate_is_per_key(standin):
    f = make(0.003)
    g = autograph.graphed(f, min_speedup=2.0)
    run(g, f, (2, 8), 3 + TRIALS)  # kept
    standin.replay_delay = 0.02  # the next key's graph is slower than its eager runs
    run(g, f, (3, 8), 3 + TRIALS + 2)
    run(g, f, (2, 8), 2)
    s = autograph.stats(g)
    assert s["graphs"] == 1 and s["eager_reasons"][NOT_WORTH] == 2


def test_without_min_speedup_nothing_is_timed(standin):
    standin.replay_delay = 0.005
    f = make(0.0)
    g = autograph.graphed(f)
    run(g, f, (2, 8), 3 + TRIALS + 2)
    assert autograph.stats(g)["replays"] == TRIALS + 2


@pytest.mark.parametrize("bad", [0, -1.0, "2", True, float("nan")])
def test_bad_min_speedup_is_refused(bad):
    with pytest.raises(ValueError, match="min_speedup"):
        autograph.graphed(min_speedup=bad)


def test_min_speedup_needs_warmup():
    with pytest.raises(ValueError, match="warmup"):
        autograph.graphed(min_speedup=1.5, warmup=0)
    with pytest.raises(ValueError, match="min_speedup"):
        autograph.capture_region(min_speedup=0)


def test_a_held_output_gives_no_time_sample(standin):
    """With ``outputs="reuse"`` the usual ``y = g(x)`` loop holds the last output: that
    call runs eagerly (no replay), and timing it made a slow graph look fast."""
    standin.replay_delay = 0.01
    f = make(0.0)
    g = autograph.graphed(f, min_speedup=1.5, outputs="reuse")
    with torch.no_grad():
        y = None
        for _ in range(12):
            x = torch.randn(3, 8)
            y = g(x)
            torch.testing.assert_close(y, f(x))
    s = autograph.stats(g)
    assert s["graphs"] == 0 and s["eager_reasons"].get(NOT_WORTH), s
