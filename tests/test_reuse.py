"""outputs="reuse": the graph's own output tensors are handed out, and a held output
is never overwritten by a later replay (the call runs eagerly instead), proved on the
CPU stand-in (whose replay overwrites its outputs in place, as a real graph does)."""

import pytest
import torch
from torch import nn

import autograph
from autograph.dispatch import RESIZED
from autograph.replay import Captured

pytestmark = pytest.mark.usefixtures("standin")


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def test_dropped_output_is_reused_without_a_copy():
    model = mlp()
    g = autograph.graphed(model, warmup=0, outputs="reuse")
    ptrs = []
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(3, 8)
            out = g(x)
            torch.testing.assert_close(out, model(x))
            ptrs.append(out.data_ptr())
            del out
    assert len(set(ptrs)) == 1  # the graph's own memory, every call
    s = autograph.stats(g)
    assert s["captures"] == 1 and s["replays"] == 3 and s["outputs_protected"] == 0


def hold(out, keep):
    if keep == "view":
        return out[1:].t()
    if keep == "storage":  # the storage alone, as a tensor over it at the end
        return out.untyped_storage(), out.shape
    return {"tensor": out, "list": [out], "dict": {"y": out}}[keep]


def held_tensor(held):
    if isinstance(held, tuple):
        storage, shape = held
        return torch.empty(0, device=storage.device).set_(storage).view(shape)
    return held if isinstance(held, torch.Tensor) else \
        (held[0] if isinstance(held, list) else held["y"])


@pytest.mark.parametrize("keep", ["tensor", "view", "list", "dict", "storage"])
def test_held_output_is_never_overwritten(keep):
    model = mlp()
    g = autograph.graphed(model, warmup=0, outputs="reuse")
    with torch.no_grad():
        x1 = torch.randn(3, 8)
        out = g(x1)
        expect = out.clone()
        held = hold(out, keep)
        del out
        x2 = torch.randn(3, 8)
        out2 = g(x2)
        torch.testing.assert_close(out2, model(x2))
        kept = held_tensor(held)
        torch.testing.assert_close(kept, expect if keep != "view" else expect[1:].t())
    s = autograph.stats(g)
    assert s["outputs_protected"] == 1 and s["eager_reasons"]["outputs_held"] == 1
    assert s["calls"] == s["replays"] + s["captures"] + s["eager"]
    del held, kept, out2
    with torch.no_grad():
        x3 = torch.randn(3, 8)
        torch.testing.assert_close(g(x3), model(x3))
    assert autograph.stats(g)["replays"] == 1  # nothing held any more: replayed


def test_output_passed_back_in_stays_intact():
    @autograph.graphed(warmup=0, outputs="reuse")
    def step(x):
        return x * 2 + 1

    with torch.no_grad():
        x = torch.ones(4)
        outs = []
        for _ in range(5):
            x = step(x)
            outs.append(x)
    expect = torch.ones(4)
    for out in outs:
        expect = expect * 2 + 1
        assert torch.equal(out, expect)
    assert autograph.stats(step)["outputs_protected"] == 4


def test_several_outputs_and_one_held():
    @autograph.graphed(warmup=0, outputs="reuse")
    def f(x):
        return x * 2, {"sum": x.sum()}, x

    with torch.no_grad():
        a = torch.randn(4)
        _, d_a, same = f(a)
        assert same is a  # an argument is handed back as it is
        b = torch.randn(4)
        out_b, d_b, _ = f(b)
    assert torch.allclose(d_a["sum"], a.sum())
    assert torch.allclose(out_b, b * 2) and torch.allclose(d_b["sum"], b.sum())
    assert autograph.stats(f)["outputs_protected"] == 1


def test_without_the_check_a_held_output_would_be_overwritten(monkeypatch):
    """The checks above are only worth something if the stand-in overwrites outputs."""
    monkeypatch.setattr(Captured, "holders", lambda self: ())

    @autograph.graphed(warmup=0, outputs="reuse")
    def f(x):
        return x * 2

    with torch.no_grad():
        out1 = f(torch.ones(3))
        f(torch.zeros(3))
    assert torch.equal(out1, torch.zeros(3))


def test_default_clones():
    model = mlp()
    g = autograph.graphed(model, warmup=0)
    with torch.no_grad():
        x1, x2 = torch.randn(3, 8), torch.randn(3, 8)
        out1 = g(x1)
        out2 = g(x2)
    assert out1.data_ptr() != out2.data_ptr()
    torch.testing.assert_close(out1, model(x1))
    torch.testing.assert_close(out2, model(x2))
    s = autograph.stats(g)
    assert s["replays"] == 1 and s["outputs_protected"] == 0
    assert "outputs_held" not in s["eager_reasons"]


def test_region_and_validation():
    model = mlp()
    with torch.no_grad():
        for _ in range(4):
            with autograph.capture_region(warmup=0, outputs="reuse"):
                x = torch.randn(2, 8)
                out = model(x)
                torch.testing.assert_close(out, nn.Sequential.forward(model, x))
            del out
    assert autograph.stats(model)["outputs_protected"] == 0
    assert autograph.stats(model)["replays"] == 3
    with pytest.raises(ValueError, match="outputs"):
        autograph.graphed(outputs="share")
    with pytest.raises(ValueError, match="outputs"):
        autograph.capture_region(outputs=None)  # type: ignore[arg-type]


def test_each_reuse_graph_has_a_pool_of_its_own(standin):
    """Graphs sharing a pool may place an output in memory another graph writes; the
    outputs of reuse graphs are handed out, so none shares a pool (GPU test:
    tests/gpu/test_reuse_cuda.py::test_an_output_held_across_other_keys_keeps_its_values)."""
    g = autograph.graphed(mlp(), warmup=0, outputs="reuse")
    plain = autograph.graphed(mlp(), warmup=0)
    with torch.no_grad():
        for rows in (2, 3):
            g(torch.randn(rows, 8))
        plain(torch.randn(2, 8))
    reuse_pools, shared = standin.pools_used[:2], standin.pools_used[2]
    assert reuse_pools[0] is not reuse_pools[1]
    assert shared not in reuse_pools and shared is standin.pool(torch.device("cpu"))


RESIZES = ["storage to 0", "tensor larger"]


def check_a_resized_output_storage_is_never_written(resize, device):
    """``untyped_storage().resize_(0)`` frees the memory the graph writes, a larger
    ``resize_`` moves it: the graph is dropped, the next call runs eagerly, and the
    key is captured again (it replays afterwards, counted as a warmup, not as a held
    output)."""
    model = mlp().to(device)
    g = autograph.graphed(model, outputs="reuse")
    with torch.no_grad():
        for _ in range(3):
            g(torch.randn(3, 8, device=device))
        out = g(torch.randn(3, 8, device=device))
        before = autograph.stats(g)["replays"]
        assert before >= 1
        if resize == "storage to 0":
            out.untyped_storage().resize_(0)
        else:
            out.resize_(1000)
        del out
        for _ in range(6):
            x = torch.randn(3, 8, device=device)
            torch.testing.assert_close(g(x), model(x))
    s = autograph.stats(g)
    assert s["outputs_protected"] == 0, s
    assert s["captures"] == 2 and s["replays"] > before, s
    assert s["eager_details"]["warmup"].get(RESIZED) == 1, s


@pytest.mark.parametrize("resize", RESIZES)
def test_a_resized_output_storage_is_never_written(standin, resize):
    check_a_resized_output_storage_is_never_written(resize, "cpu")
