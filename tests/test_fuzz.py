"""Differential fuzzing against eager on the CPU stand-in (a short budget for CI; the GPU
run in tests/gpu makes thousands of calls).  A failure names its seed."""

import pytest

from . import fuzz

pytestmark = pytest.mark.usefixtures("standin")


@pytest.mark.parametrize("seed", range(24))
def test_graphed_equals_eager_on_random_models_and_calls(seed):
    counts = fuzz.run(seed, "cpu", calls=40)
    assert counts["calls"] > 0
