"""The public surface: decorator forms, the module proxy, options, stats, reset."""

import copy
import inspect
import pickle

import pytest
import torch
from torch import nn

import autograph

pytestmark = pytest.mark.usefixtures("standin")


def test_public_names():
    assert set(autograph.__all__) == {
        "EagerReason", "__version__", "capture_region", "disabled", "graphed",
        "register_prometheus",
        "report", "reset", "save_plan", "stats", "warmup",
    }
    for name in autograph.__all__:
        assert name == "__version__" or getattr(autograph, name).__doc__, name


def test_bare_decorator_keeps_name_doc_signature():
    @autograph.graphed
    def scale(x: torch.Tensor, k: float = 2.0) -> torch.Tensor:
        """Scale x."""
        return x * k

    assert scale.__name__ == "scale"
    assert scale.__doc__ == "Scale x."
    assert str(inspect.signature(scale)) == "(x: torch.Tensor, k: float = 2.0) -> torch.Tensor"
    assert inspect.isfunction(scale) or callable(scale)
    x = torch.randn(4)
    assert torch.equal(scale(x), x * 2)


def test_decorator_with_options():
    @autograph.graphed(warmup=0, max_graphs=3)
    def f(x):
        return x + 1

    with torch.no_grad():
        f(torch.ones(2))
    assert autograph.stats(f)["captures"] == 1


@pytest.mark.parametrize(
    "kwargs", [{"warmup": -1}, {"warmup": 1.5}, {"max_graphs": 0}, {"max_graphs": True}]
)
def test_bad_options_raise(kwargs):
    with pytest.raises(ValueError, match="autograph"):
        autograph.graphed(**kwargs)


def test_bad_targets_raise():
    with pytest.raises(TypeError, match="expects a function"):
        autograph.graphed(42)
    g = autograph.graphed(lambda x: x)
    with pytest.raises(TypeError, match="already graphed"):
        autograph.graphed(g)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    @autograph.graphed
    def forward(self, x):
        """Net forward."""
        return self.fc(x).relu()


def test_forward_in_class_body_graphs_per_instance():
    a, b = Net(), Net()
    x = torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(4):
            ya, yb = a(x), b(x)
        assert torch.allclose(ya, a.fc(x).relu())
        assert torch.allclose(yb, b.fc(x).relu())
    assert not torch.allclose(ya, yb)
    names = [n for n in autograph.stats() if n.startswith("Net.forward")]
    assert len(names) == 2
    for n in names:
        s = autograph.stats()[n]
        assert (s["captures"], s["replays"]) == (1, 1)
    assert Net.forward.__doc__ == "Net forward."


def test_instance_graphs_die_with_the_instance():
    import gc

    net = Net()
    with torch.no_grad():
        for _ in range(3):
            net(torch.randn(1, 4))
    before = len([n for n in autograph.stats() if n.startswith("Net.forward")])
    del net
    gc.collect()
    after = len([n for n in autograph.stats() if n.startswith("Net.forward")])
    assert after == before - 1


def test_module_proxy_is_transparent():
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    g = autograph.graphed(m)
    assert isinstance(g, nn.Sequential) and isinstance(g, nn.Module)
    assert g[0] is m[0]
    assert list(g.state_dict()) == list(m.state_dict())
    assert [p is q for p, q in zip(g.parameters(), m.parameters())] == [True] * 4
    assert g.eval() is g and not m.training
    assert g.train() is g and m.training
    assert g.to(torch.float64) is g and m[0].weight.dtype == torch.float64
    assert g.float() is g
    assert g.requires_grad_(False) is g
    g.extra = 5
    assert m.extra == 5
    assert "Linear" in repr(g)
    x = torch.randn(3, 4)
    with torch.no_grad():
        for _ in range(4):
            assert torch.allclose(g(x), m(x))
    assert autograph.stats(g)["replays"] >= 1


def test_module_proxy_copies_and_pickles():
    g = autograph.graphed(nn.Linear(3, 3), warmup=1)
    c = copy.deepcopy(g)
    assert c is not g and c.weight is not g.weight and torch.equal(c.weight, g.weight)
    p = pickle.loads(pickle.dumps(g))
    assert torch.equal(p.weight, g.weight)
    x = torch.randn(2, 3)
    with torch.no_grad():
        for _ in range(3):
            assert torch.allclose(p(x), g(x))



def test_pickles_made_before_the_wrappers_split_find_their_rebuilders():
    from autograph import functions, proxy

    # a pickle names its rebuilder by module and name; older ones name autograph.wrappers
    assert pickle.loads(b"cautograph.wrappers\n_rewrap\n.") is proxy._rewrap
    assert pickle.loads(b"cautograph.wrappers\n_rewrap_function\n.") is \
        functions._rewrap_function

def test_stats_invariant_and_reset():
    @autograph.graphed
    def f(x):
        return x.sin()

    with torch.no_grad():
        for n in (2, 2, 2, 3, 2, 3, 3, 3):
            f(torch.randn(n))
    s = autograph.stats(f)
    assert s["calls"] == s["replays"] + s["captures"] + s["eager"] == 8
    assert s["graphs"] == 2 and s["captures"] == 2
    assert s["eager_reasons"] == {"warmup": 4}
    assert s["graph_memory_bytes"] > 0 and s["capture_seconds"] > 0
    f.reset()
    s = autograph.stats(f)
    assert s["graphs"] == 0 and s["graph_memory_bytes"] == 0
    with torch.no_grad():
        f(torch.randn(2))
    assert autograph.stats(f)["eager"] == 5


def test_reset_by_object():
    net = Net()
    with torch.no_grad():
        for _ in range(3):
            net(torch.randn(1, 4))
    autograph.reset(net)
    g = autograph.graphed(nn.Linear(2, 2))
    autograph.reset(g)
    autograph.reset()
    with pytest.raises(TypeError, match="not graphed"):
        autograph.reset(nn.Linear(2, 2))


def test_stats_of_an_instance_with_a_graphed_forward_not_called_yet(standin):
    """An instance (a deepcopy of a called one too) whose class's forward is graphed
    has zero counters before its first call, not a "not graphed" error."""
    import copy

    class Decorated(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.f = torch.nn.Linear(5, 3)

        @autograph.graphed
        def forward(self, x):
            return self.f(x)

    fresh = Decorated()
    assert autograph.stats(fresh)["calls"] == 0
    called = Decorated()
    called(torch.randn(2, 5))
    twin = copy.deepcopy(called)
    assert autograph.stats(twin)["calls"] == 0 and autograph.stats(called)["calls"] == 1
    twin(torch.randn(2, 5))
    assert autograph.stats(twin)["calls"] == 1
