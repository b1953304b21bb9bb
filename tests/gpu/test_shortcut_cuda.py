"""The shortcut of a repeated call on CUDA (shortcut.py): replays equal eager, and each
change the key or the guards hold sends the call back to the full path.  The checks are
the CPU suite's (tests/test_shortcut.py), on real graphs; the TF32 flag and a capture
in progress on the caller's stream are CUDA's own."""

import pytest
import torch

import autograph

from ..test_shortcut import (
    CHANGES,
    Scaled,
    check_aliased_arguments,
    check_change,
    check_evicted_graph,
    check_held_output,
    check_repeated_calls,
    check_training_calls,
    counted,  # noqa: F401 - the fixture
    warmed,
)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_repeated_calls(counted):  # noqa: F811
    check_repeated_calls(counted, "cuda")


@pytest.mark.parametrize("change", [*CHANGES, "tf32"])
def test_a_change_leaves_the_shortcut(change, counted, monkeypatch):  # noqa: F811
    check_change(change, counted, monkeypatch, "cuda")


def test_aliased_arguments(counted):  # noqa: F811
    check_aliased_arguments(counted, "cuda")


def test_evicted_graph(counted):  # noqa: F811
    check_evicted_graph(counted, "cuda")


def test_held_output(counted):  # noqa: F811
    check_held_output(counted, "cuda")


def test_training_calls(counted):  # noqa: F811
    check_training_calls(counted, "cuda")


def test_a_call_inside_a_users_capture_runs_eagerly(counted):  # noqa: F811
    model = Scaled().cuda().eval()
    x = torch.randn(2, 4, device="cuda")
    with torch.no_grad():
        g = warmed(model, x)
        full = len(counted)
        g(x)
        assert len(counted) == full  # the shortcut replayed, before the capture
        outer = torch.cuda.CUDAGraph()
        static = x.clone()
        # no gc.collect() first: a graph freed by a collection during the capture
        # would invalidate it (training graphs were kept by a cycle until one ran)
        with torch.cuda.graph(outer):
            out = g(static)  # captured into the user's graph, not a replay of ours
        static.copy_(torch.randn(2, 4, device="cuda"))
        outer.replay()
        torch.testing.assert_close(out, model(static))
    assert len(counted) == full + 1
    assert autograph.stats(g)["eager_reasons"].get("capturing", 0) >= 1
