"""Captures leave the device's random number generator to other threads when the call
draws no random numbers (``Backend.capture(rng_free=True)``), and capture again with the
generator when the call draws some after all."""

import torch
from torch import nn

import autograph


def test_a_call_that_draws_nothing_is_captured_without_the_generator(standin):
    m = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))
    g = autograph.graphed(m, warmup=1)
    x = torch.randn(8, 4)
    with torch.no_grad():
        g.eval()
        for _ in range(3):
            torch.testing.assert_close(g(x), m(x))
        g.train()  # dropout draws: captured with the generator
        outs = [g(x) for _ in range(4)]
    # the eval graph, its output variant (rotation.py), the training graph (none: it draws)
    assert standin.rng_free == [True, True, False]
    assert autograph.stats(g)["replays"] >= 3
    assert not all(torch.equal(outs[1], o) for o in outs[2:])  # fresh masks per replay


def test_a_call_drawing_only_at_capture_is_captured_again_with_the_generator(standin):
    p = [0.0]  # read by the forward: no guard sees a list's contents change

    @autograph.graphed(warmup=1)
    def f(x):
        return nn.functional.dropout(x, p[0], training=True)

    x = torch.ones(64)
    with torch.no_grad():
        torch.testing.assert_close(f(x), x)  # warmup: p=0 draws nothing
        p[0] = 0.5
        outs = [f(x) for _ in range(4)]
    assert standin.rng_free == [True, False]
    s = autograph.stats(f)
    assert s["captures"] == 1 and s["replays"] == 3, s
    assert all((o == 0).any() for o in outs)  # the graph drops, as eager would now
    assert not all(torch.equal(outs[1], o) for o in outs[2:])


def test_torch_refusing_a_random_operator_in_such_a_capture_captures_again(standin):
    @autograph.graphed(warmup=1)
    def f(x):
        return x * 2

    x = torch.randn(4)
    with torch.no_grad():
        f(x)
        standin.fail_next = RuntimeError(
            "Attempt to increase offset for a CUDA generator not in capture mode.")
        for _ in range(3):
            torch.testing.assert_close(f(x), x * 2)
    # refused, then again with the generator; no output variant: the graph counts as
    # drawing (a variant's check would replay it once more, drawing again)
    assert standin.rng_free == [True, False]
    s = autograph.stats(f)
    assert s["captures"] == 1 and s["replays"] == 2 and "capture_failed" not in s["eager_reasons"]


def test_training_graphs_draw_nothing_and_are_captured_without_the_generator(standin):
    m = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    g = autograph.graphed(m, warmup=1)
    for _ in range(3):
        g(torch.randn(2, 4)).sum().backward()
    assert standin.rng_free[0] is True
    assert autograph.stats(g)["replays"] >= 1
