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


def test_calls_of_another_kind_try_again_after_giving_up(standin):
    """A callable that gave up after new keys in a row (a default-cache ``generate``)
    ran every later call eagerly, also calls of another kind of arguments (the same
    model's static-cache ``generate``): those try graphs again."""
    def f(x, n):
        return x * n

    g = autograph.graphed(f)
    with torch.no_grad():
        for n in range(70):  # a new key every call
            g(torch.ones(2), n)
        assert autograph.stats(g)["eager_reasons"].get("given_up")
        for _ in range(6):
            x, n = torch.randn(2), torch.tensor(3.0)
            torch.testing.assert_close(g(x, n), x * n)
        g(torch.ones(2), 71)  # the kind that gave up: eager again
    assert autograph.stats(g)["replays"] >= 2, autograph.stats(g)


def test_keys_that_repeat_after_many_new_ones_do_not_give_up(standin):
    """A sampler whose step is keyed by a Python int (50 to 100 timesteps per sample):
    the keys repeat a sample later.  Captures reset the count of new keys (with the
    default ``max_graphs`` the evicted keys came back as new and it gave up one step
    before replaying), and ``max_graphs`` above 64 raises the bound (100 steps gave up
    inside the first sample)."""
    for steps, options in ((50, {}), (100, {"max_graphs": 128})):
        @autograph.graphed(**options)
        def step(x, t):
            return x * (1.0 - t / 1000)

        x = torch.randn(3)
        with torch.no_grad():
            for _ in range(5):
                for t in range(steps):
                    torch.testing.assert_close(step(x, t), x * (1.0 - t / 1000))
        s = autograph.stats(step)
        assert "given_up" not in s["eager_reasons"] and s["replays"] >= steps, s
