"""Differential fuzzing against eager on the CPU stand-in (a short budget for CI; the GPU
run in tests/gpu makes 20,000 calls).  A failure names its seed.

Calls come in bursts of one call pattern (aliased and overlapping arguments, strided
views in, views and out-arguments out, rotating caches, flags, calls that raise), so
most calls are replays: a replay share is asserted, and every call equals eager."""

import pytest

from . import fuzz

pytestmark = pytest.mark.usefixtures("standin")

MIN_REPLAY_SHARE = 0.3


def check(counts):
    assert counts["calls"] > 0
    assert counts["replays"] >= MIN_REPLAY_SHARE * counts["calls"], counts


@pytest.mark.parametrize("seed", range(24))
def test_graphed_equals_eager_on_random_models_and_call_patterns(seed):
    check(fuzz.run(seed, "cpu", calls=100, patterns=fuzz.ALL_PATTERNS))


@pytest.mark.parametrize("seed", range(8))
def test_graphed_equals_eager_on_random_models_and_plain_calls(seed):
    """Only model and mode changes between plain ``model(x, state)`` calls."""
    check(fuzz.run(seed, "cpu", calls=100, patterns=None))
