"""The shortcut of a repeated call (shortcut.py): after a replay, the next call of the
same tensors replays without keying it anew, and anything the key or the guards hold
that changes sends it back to the full path.  Each test first makes the shortcut
replay, then changes one thing and checks the result against eager."""

import copy
import os

import pytest
import torch
from torch import nn

import autograph
from autograph.dispatch import Engine

pytestmark = pytest.mark.usefixtures("standin")


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = 2.0

    def forward(self, x):
        y = self.lin(x) * self.scale
        return y + 1 if self.training else y - 1


@pytest.fixture
def counted(monkeypatch):
    """Counts calls that a shortcut replayed (Engine.dispatch is the full path)."""
    full = []
    dispatch = Engine.dispatch

    def counting(self, args, kwargs):
        full.append(1)
        return dispatch(self, args, kwargs)

    monkeypatch.setattr(Engine, "dispatch", counting)
    return full


def warmed(model, x, calls=5):
    g = autograph.graphed(model)
    for _ in range(calls):
        g(x)
    return g


def replays(g):
    return autograph.stats(g)["replays"]


def test_repeated_calls_take_the_shortcut_and_equal_eager(counted):
    check_repeated_calls(counted, "cpu")


def check_repeated_calls(counted, device):
    model = Scaled().to(device).eval()
    with torch.no_grad():
        g = warmed(model, torch.randn(2, 4, device=device))
        before, full = replays(g), len(counted)
        for _ in range(5):
            x = torch.randn(2, 4, device=device)  # new tensors: read from the buffers
            torch.testing.assert_close(g(x), model(x))
    assert replays(g) == before + 5
    assert len(counted) == full  # none of them went through the full path


CHANGES = ["train", "attribute", "data", "deterministic", "grad", "hook", "disabled",
           "environment", "shape"]


@pytest.mark.parametrize("change", CHANGES)
def test_a_change_leaves_the_shortcut(change, counted, monkeypatch):
    check_change(change, counted, monkeypatch, "cpu")


def check_change(change, counted, monkeypatch, device):
    model = Scaled().to(device).eval()
    x = torch.randn(2, 4, device=device)
    with torch.no_grad():
        g = warmed(model, x)
        full = len(counted)
        g(x)
        assert len(counted) == full  # the shortcut replayed, before the change
        undo = _apply(change, model, monkeypatch, device)
        try:
            y = x if change != "shape" else torch.randn(3, 4, device=device)
            got = g(y)
            with torch.no_grad():
                want = model(y)
            torch.testing.assert_close(got, want)
        finally:
            undo()
    assert len(counted) == full + 1  # the changed call took the full path


def _apply(change, model, monkeypatch, device):
    nothing = lambda: None  # noqa: E731
    if change == "train":
        model.train()
    elif change == "attribute":
        model.scale = 3.0
    elif change == "data":
        with torch.no_grad():
            model.lin.weight.data = torch.randn(4, 4, device=device)
    elif change == "deterministic":
        before = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(not before)
        return lambda: torch.use_deterministic_algorithms(before)
    elif change == "grad":
        torch.set_grad_enabled(True)
        return lambda: torch.set_grad_enabled(False)
    elif change == "hook":
        handle = model.lin.register_forward_hook(lambda m, i, o: o * 10)
        return handle.remove
    elif change == "disabled":
        block = autograph.disabled()
        block.__enter__()
        return lambda: block.__exit__(None, None, None)
    elif change == "environment":
        monkeypatch.setitem(os.environ, "AUTOGRAPH_DISABLE", "1")
    elif change == "tf32":  # a CUDA numerics flag
        before = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = not before
        return lambda: setattr(torch.backends.cuda.matmul, "allow_tf32", before)
    return nothing


def test_aliased_arguments_leave_the_shortcut(counted):
    check_aliased_arguments(counted, "cpu")


def check_aliased_arguments(counted, device):
    @autograph.graphed
    def f(a, b):
        # a Python decision on aliasing (attention tells self-attention apart so)
        return a * 10 if a.data_ptr() == b.data_ptr() else a + b

    with torch.no_grad():
        for _ in range(5):
            f(torch.ones(3, device=device), torch.ones(3, device=device))
        full = len(counted)
        f(torch.ones(3, device=device), torch.ones(3, device=device))
        assert len(counted) == full  # the shortcut replayed
        a = torch.ones(3, device=device)
        out = f(a, a.view(3))  # a view: the memo's tensor check tells only ``a, a``
    torch.testing.assert_close(out, torch.full((3,), 10.0, device=device))
    assert len(counted) == full + 1


def test_an_evicted_graph_leaves_the_shortcut(counted):
    check_evicted_graph(counted, "cpu")


def check_evicted_graph(counted, device):
    model = Scaled().to(device).eval()
    g = autograph.graphed(model, max_graphs=1)
    x, y = torch.randn(2, 4, device=device), torch.randn(3, 4, device=device)
    with torch.no_grad():
        for _ in range(5):
            g(x)
        full = len(counted)
        g(x)
        assert len(counted) == full  # the shortcut replayed
        for _ in range(3):
            g(y)  # captured: x's graph is evicted
        assert autograph.stats(g)["evictions"] == 1
        full = len(counted)
        torch.testing.assert_close(g(x), model(x))
    assert len(counted) == full + 1


def test_reset_leaves_the_shortcut(counted):
    model = Scaled().eval()
    x = torch.randn(2, 4)
    with torch.no_grad():
        g = warmed(model, x)
        g.reset()
        full = len(counted)
        torch.testing.assert_close(g(x), model(x))  # a warmup again, not a stale replay
        assert len(counted) == full + 1
        assert autograph.stats(g)["graphs"] == 0


def test_an_output_still_held_with_reuse_is_protected(counted):
    check_held_output(counted, "cpu")


def check_held_output(counted, device):
    model = Scaled().to(device).eval()
    g = autograph.graphed(model, outputs="reuse")
    x = torch.randn(2, 4, device=device)
    with torch.no_grad():
        for _ in range(5):
            g(x)
        kept = g(x)
        kept_value = kept.clone()
        view = kept[0]
        view_value = view.clone()
        g(torch.randn(2, 4, device=device))  # must not overwrite ``kept`` or its view
        torch.testing.assert_close(kept, kept_value)
        del kept
        g(torch.randn(2, 4, device=device))  # nor the view held alone
    torch.testing.assert_close(view, view_value)
    assert autograph.stats(g)["outputs_protected"] >= 2


def test_training_calls_take_the_shortcut_with_exact_gradients(counted):
    check_training_calls(counted, "cpu")


def check_training_calls(counted, device):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).to(device)
    reference = copy.deepcopy(model)
    g = autograph.graphed(model)
    full = 0
    for step in range(14):
        x = torch.randn(3, 4, device=device)
        if step == 11:
            full = len(counted)
        if step == 5:
            for m in (model, reference):  # frozen: its gradient is None, as in eager
                m[0].weight.requires_grad_(False)
        for m, call in ((model, g), (reference, reference)):
            m.zero_grad(set_to_none=True)
            call(x).square().sum().backward()
        for p, q in zip(model.parameters(), reference.parameters()):
            assert (p.grad is None) == (q.grad is None)
            if p.grad is not None:
                torch.testing.assert_close(p.grad, q.grad)
    assert autograph.stats(g)["backward_replays"] >= 5
    assert len(counted) == full  # the last replays, after the recapture, took the shortcut


def test_an_inference_tensor_in_grad_mode_raises_as_eager(counted):
    model = nn.Linear(4, 4)
    g = warmed(model, torch.randn(2, 4))
    with torch.inference_mode():
        x = torch.randn(2, 4)
    with pytest.raises(RuntimeError):
        model(x).sum().backward()
    with pytest.raises(RuntimeError):
        g(x).sum().backward()


def test_unfrozen_parameters_without_training_graphs_run_eagerly(counted):
    model = nn.Linear(4, 4).requires_grad_(False)
    g = autograph.graphed(model, backward=False)
    x = torch.randn(2, 4)
    for _ in range(5):
        g(x)  # grad mode, nothing requires grad: plain graphs replay
    assert autograph.stats(g)["replays"] >= 2
    model.requires_grad_(True)  # now autograd records: eager, as backward=False says
    g(x).sum().backward()
    torch.testing.assert_close(model.weight.grad, x.sum(0).expand(4, 4))
    assert autograph.stats(g)["eager_reasons"].get("autograd", 0) == 1
