"""outputs="reuse" with real CUDA graphs: no copy for dropped outputs, and a held
output (the tensor, a view, or either kept in a list or dict) never overwritten.
Skipped without CUDA."""

import pytest
import torch
from torch import nn

import autograph

from ..test_reuse import RESIZES, check_a_resized_output_storage_is_never_written, held_tensor, hold

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

TOL = {"rtol": 1e-4, "atol": 1e-4}


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8)).cuda().eval()


def test_dropped_output_is_the_graphs_own_memory():
    m = model()
    g = autograph.graphed(m, outputs="reuse")
    ptrs = []
    with torch.no_grad():
        for _ in range(6):
            x = torch.randn(4, 32, device="cuda")
            out = g(x)
            torch.testing.assert_close(out, m(x), **TOL)
            ptrs.append(out.data_ptr())
            del out
    assert len(set(ptrs[2:])) == 1  # every call after the warmup: no copy
    s = autograph.stats(g)
    assert s["replays"] == 3 and s["outputs_protected"] == 0


@pytest.mark.parametrize("keep", ["tensor", "view", "list", "dict", "storage"])
def test_held_output_is_never_overwritten(keep):
    m = model()
    g = autograph.graphed(m, warmup=1, outputs="reuse")
    with torch.no_grad():
        g(torch.randn(4, 32, device="cuda"))  # warmup
        out = g(torch.randn(4, 32, device="cuda"))  # captured
        expect = out.clone()
        held = hold(out, keep)
        del out
        for _ in range(3):
            x = torch.randn(4, 32, device="cuda")
            torch.testing.assert_close(g(x), m(x), **TOL)
        torch.cuda.synchronize()
        kept = held_tensor(held)
        assert torch.equal(kept, expect[1:].t() if keep == "view" else expect)
    s = autograph.stats(g)
    assert s["outputs_protected"] == 3 and s["replays"] == 0
    assert s["calls"] == s["replays"] + s["captures"] + s["eager"]
    del held, kept
    with torch.no_grad():
        x = torch.randn(4, 32, device="cuda")
        torch.testing.assert_close(g(x), m(x), **TOL)
    assert autograph.stats(g)["replays"] == 1


def test_output_fed_back_stays_intact():
    @autograph.graphed(warmup=0, outputs="reuse")
    def step(x):
        return x * 2 + 1

    with torch.no_grad():
        x = torch.ones(16, device="cuda")
        outs = []
        for _ in range(6):
            x = step(x)
            outs.append(x)
    expect = torch.ones(16, device="cuda")
    for out in outs:
        expect = expect * 2 + 1
        assert torch.equal(out, expect)


def test_default_mode_unchanged():
    m = model()
    g = autograph.graphed(m, warmup=0)
    with torch.no_grad():
        x1, x2 = torch.randn(4, 32, device="cuda"), torch.randn(4, 32, device="cuda")
        out1, out2 = g(x1), g(x2)
        assert out1.data_ptr() != out2.data_ptr()
        torch.testing.assert_close(out1, m(x1), **TOL)
        torch.testing.assert_close(out2, m(x2), **TOL)
    s = autograph.stats(g)
    assert s["replays"] == 1 and s["outputs_protected"] == 0


def deep_mlp():
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [nn.Linear(256, 256), nn.ReLU()]
    return nn.Sequential(*layers).cuda().eval()


@pytest.mark.parametrize("outputs", ["clone", "reuse"])
@pytest.mark.parametrize("order", [(1, 2), (2, 1), (1, 4, 2)])
def test_an_output_held_across_other_keys_keeps_its_values(outputs, order):
    """A graph captured after another may place its output in memory the other frees
    (graphs share a pool): that graph's replays must not write an output still held."""
    model = deep_mlp()
    g = autograph.graphed(model, warmup=1, outputs=outputs)
    with torch.no_grad():
        for rows in order:
            for _ in range(3):
                g(torch.randn(rows, 256, device="cuda"))
        for rows in order:
            x = torch.randn(rows, 256, device="cuda")
            held, want = g(x), model(x)
            for other in order:
                if other != rows:
                    for _ in range(3):
                        g(torch.randn(other, 256, device="cuda"))
            torch.cuda.synchronize()
            torch.testing.assert_close(held, want)
            del held
    s = autograph.stats(g)
    assert s["replays"] >= 4 * len(order) and s["outputs_protected"] == 0


@pytest.mark.parametrize("resize", RESIZES)
def test_a_resized_output_storage_is_never_written(resize):
    check_a_resized_output_storage_is_never_written(resize, "cuda")
