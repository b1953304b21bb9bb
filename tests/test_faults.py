"""Faults and hazards on the CPU stand-in: failures at every stage, bounded memory,
no references kept to deleted modules, and awkward arguments."""

import gc
import weakref

import pytest
import torch
from torch import nn

import autograph

from .standin import RecordedGraph

pytestmark = pytest.mark.usefixtures("standin")


def invariant(fn):
    s = autograph.stats(fn)
    assert s["calls"] == s["replays"] + s["captures"] + s["eager"], s
    return s


def test_a_failed_replay_runs_eagerly_and_drops_the_graph(monkeypatch):
    broken = {"now": False}
    replay = RecordedGraph.replay

    def flaky(self):
        if broken["now"]:
            raise RuntimeError("CUDA error: launch failure (injected)")
        replay(self)

    monkeypatch.setattr(RecordedGraph, "replay", flaky)
    m = nn.Linear(4, 4)
    g = autograph.graphed(m)
    x = torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(4):
            g(x)
        broken["now"] = True
        torch.testing.assert_close(g(x), m(x))
        torch.testing.assert_close(g(x), m(x))
    s = invariant(g)
    assert s["graphs"] == 0 and s["graph_memory_bytes"] == 0
    assert any(d.startswith("RuntimeError") for d in s["eager_details"]["replay_failed"])


@pytest.mark.parametrize("stage", ["warmup", "capture", "eager"])
def test_calls_that_raise_are_counted_and_leave_no_trace(standin, stage):
    """The user's exception propagates unchanged at any stage; stats stay consistent;
    the next good call is graphed."""
    class Oops(Exception):
        pass

    state = {"fail": False}

    @autograph.graphed(warmup=1)
    def f(x):
        if state["fail"]:
            raise Oops(stage)
        return x * 3

    with torch.no_grad():
        if stage != "warmup":
            f(torch.ones(2))  # the warmup
        if stage == "eager":
            f(torch.ones(2))  # captured: later calls replay, a new key warms up
        state["fail"] = True
        with pytest.raises(Oops, match=stage):
            f(torch.ones(3) if stage == "eager" else torch.ones(2))
        assert not standin.is_capturing(torch.device("cpu"))
        state["fail"] = False
        for _ in range(3):
            torch.testing.assert_close(f(torch.ones(2)), torch.full((2,), 3.0))
    s = invariant(f)
    assert s["replays"] >= 1


def test_out_of_memory_during_capture_runs_eagerly(standin):
    m = nn.Linear(4, 4)
    g = autograph.graphed(m, warmup=0)
    standin.fail_next = torch.OutOfMemoryError("CUDA out of memory (injected)")
    x = torch.randn(2, 4)
    with torch.no_grad():
        torch.testing.assert_close(g(x), m(x))
        y = torch.randn(3, 4)
        for _ in range(2):
            torch.testing.assert_close(g(y), m(y))  # another key still captures
    s = invariant(g)
    assert s["captures"] == 1
    assert any("OutOfMemoryError" in d for d in s["eager_details"]["capture_failed"])


def test_ever_new_shapes_stay_within_the_graph_and_memory_budget():
    m = nn.Linear(8, 8)
    g = autograph.graphed(m, warmup=0, max_graphs=6, max_graph_memory=4000)
    worst_graphs = worst_bytes = 0
    with torch.no_grad():
        for i in range(1500):
            x = torch.randn(1 + i % 50, 8) if i % 3 else torch.randn(1 + i, 8)  # new & repeated
            torch.testing.assert_close(g(x), m(x))
            s = autograph.stats(g)
            worst_graphs = max(worst_graphs, s["graphs"])
            worst_bytes = max(worst_bytes, s["graph_memory_bytes"])
    s = invariant(g)
    assert worst_graphs <= 6 and worst_bytes <= 4000 and s["evictions"] > 0
    assert len(g._self_engine.cache.entries) <= 8 * 6 + 64 + 1


def test_deleted_modules_and_their_graphs_are_released():
    m = nn.Linear(4, 4)
    ref = weakref.ref(m)
    g = autograph.graphed(m)
    with torch.no_grad():
        for _ in range(4):
            g(torch.randn(2, 4))
    name = g._self_engine.stats.name
    engine = weakref.ref(g._self_engine)
    del m, g
    gc.collect()
    assert ref() is None and engine() is None
    assert name not in autograph.stats()


def test_decorated_method_keeps_no_instance_alive():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        @autograph.graphed
        def forward(self, x):
            return self.fc(x)

    refs = []
    with torch.no_grad():
        for _ in range(20):
            m = M()
            for _ in range(3):
                m(torch.randn(1, 4))
            refs.append(weakref.ref(m))
            del m
    gc.collect()
    assert all(r() is None for r in refs)
    import inspect

    assert len(inspect.getattr_static(M, "forward")._self_dispatch.engines()) == 0


@pytest.mark.parametrize(
    "value, reason",
    [(object(), "argument of type object "),
     ({1, 2}, "argument of type set "),
     (torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "nested tensor argument")],
    ids=["object", "set", "nested"],
)
def test_unkeyable_arguments_run_eagerly_with_a_reason(value, reason):
    @autograph.graphed
    def f(x, extra):
        return x + 1

    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(f(torch.ones(2), value), torch.full((2,), 2.0))
    s = invariant(f)
    details = s["eager_details"]["unkeyable_argument"]
    (counted,) = [n for r, n in details.items() if r.startswith(reason)]
    assert counted == 3, s["eager_reasons"]


def test_containers_overlapping_and_non_contiguous_arguments_equal_eager():
    @autograph.graphed
    def f(x, parts, scale):
        return x * parts["w"] + parts["b"].sum(0) * scale[0]

    with torch.no_grad():
        for i in range(8):
            x = torch.randn(1, 3).expand(4, 3)  # overlapping (stride 0)
            parts = {"w": torch.randn(3, 4).t()[:, :3], "b": torch.randn(3, 3).t()}
            scale = [float(i % 2)]  # a mutable list: keyed by its values
            expect = x * parts["w"] + parts["b"].sum(0) * scale[0]
            torch.testing.assert_close(f(x, parts, scale), expect)
    s = invariant(f)
    assert s["replays"] >= 1


def test_zero_size_and_one_tensor_twice():
    @autograph.graphed
    def f(a, b):
        return a + b.sum()

    with torch.no_grad():
        for _ in range(4):
            z = torch.randn(0, 3)
            torch.testing.assert_close(f(z, z), z + z.sum())
            t = torch.randn(3)
            torch.testing.assert_close(f(t, t), t + t.sum())
    invariant(f)


def check_quantized_arguments_run_eagerly(device="cpu"):
    """A quantized tensor (``torch.quantize_per_tensor``) is strided, but no static
    buffer of its kind can be made: as an argument, or inside an argument object, it
    raised from every capture attempt where eager mode returns a result."""
    from dataclasses import dataclass

    @dataclass
    class Batch:
        q: torch.Tensor

    w = torch.randn(4, 8, device=device)
    f = autograph.graphed(lambda qx, w: nn.functional.linear(qx.dequantize(), w))
    h = autograph.graphed(lambda b, w: nn.functional.linear(b.q.dequantize(), w))
    with torch.no_grad():
        for _ in range(5):
            try:
                qx = torch.quantize_per_tensor(torch.randn(3, 8, device=device), 0.05, 0,
                                               torch.qint8)
                want = nn.functional.linear(qx.dequantize(), w)
            except (RuntimeError, NotImplementedError):
                pytest.skip(f"no quantized tensors on {device}")
            torch.testing.assert_close(f(qx, w), want)
            torch.testing.assert_close(h(Batch(qx), w), want)
    for g in (f, h):
        s = autograph.stats(g)
        assert s["eager_reasons"] == {"unkeyable_argument": 5}, s
        assert "quantized" in next(iter(s["eager_details"]["unkeyable_argument"])), s


def test_quantized_arguments_run_eagerly():
    check_quantized_arguments_run_eagerly()
