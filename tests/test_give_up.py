"""A callable where graphs cannot pay stops trying, cheaply, until reset()."""

import torch

import autograph
from autograph.dispatch import GIVE_UP_FRESH_KEYS
from autograph.recording import GIVE_UP_FAILURES


def test_keys_that_never_repeat_stop_warming_up(standin):
    @autograph.graphed
    def f(x):
        return x * 2

    with torch.no_grad():
        for n in range(1, GIVE_UP_FRESH_KEYS + 20):
            x = torch.randn(n)
            torch.testing.assert_close(f(x), x * 2)
    s = autograph.stats(f)
    assert s["captures"] == 0
    assert s["eager_reasons"]["given_up"] == 20 - 1
    assert s["eager_reasons"]["warmup"] == GIVE_UP_FRESH_KEYS
    f.reset()  # a way to retry
    with torch.no_grad():
        for _ in range(4):
            f(torch.randn(3))
    assert autograph.stats(f)["replays"] == 1


def test_captures_that_keep_failing_stop_trying(standin):
    @autograph.graphed(warmup=0)
    def f(x):
        if x.sum().item() > 1e9:  # a host sync: every capture fails
            return x
        return x + 1

    with torch.no_grad():
        for n in range(1, GIVE_UP_FAILURES + 6):
            x = torch.randn(n)
            torch.testing.assert_close(f(x), x + 1)
    s = autograph.stats(f)
    assert s["eager_reasons"]["capture_failed"] == GIVE_UP_FAILURES
    assert s["eager_reasons"]["given_up"] == 5
    assert s["calls"] == s["eager"]
