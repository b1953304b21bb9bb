"""Every way a call falls back to eager: correct result, counted reason, clean state."""

import logging
import threading

import pytest
import torch
from torch import nn

import autograph
from autograph.lookup import handle_of

from .standin import Tally


def test_host_sync_in_forward_falls_back_once(standin, caplog):
    @autograph.graphed(warmup=1)
    def f(x):
        return x * x.sum().item()

    caplog.set_level(logging.WARNING, logger="autograph")
    with torch.no_grad():
        for _ in range(6):
            x = torch.randn(3)
            torch.testing.assert_close(f(x), x * x.sum().item())
    s = autograph.stats(f)
    assert s["captures"] == 0 and s["eager"] == 6
    (reason,) = [r for r in s["eager_reasons"] if r != "warmup"]
    assert reason == "capture_failed"
    assert any(d.startswith("CaptureError") for d in s["eager_details"][reason])
    assert s["eager_reasons"][reason] == 5
    assert standin.captures == 0
    warnings = [r for r in caplog.records if "capture failed" in r.getMessage()]
    assert len(warnings) == 1  # logged once, not per call
    assert not standin.is_capturing(torch.device("cpu"))


def test_capture_error_leaves_other_keys_working(standin):
    @autograph.graphed(warmup=0)
    def f(x):
        if x.shape[0] == 2:
            return x.nonzero()
        return x + 1

    with torch.no_grad():
        f(torch.ones(2))
        for _ in range(3):
            torch.testing.assert_close(f(torch.ones(3)), torch.full((3,), 2.0))
    s = autograph.stats(f)
    assert s["captures"] == 1 and s["replays"] == 2


@pytest.mark.parametrize("error", [MemoryError("out of memory"), RuntimeError("boom")])
def test_failure_inside_the_backend_capture_falls_back(standin, error):
    @autograph.graphed(warmup=0)
    def f(x):
        return x * 2

    standin.fail_next = error
    with torch.no_grad():
        torch.testing.assert_close(f(torch.ones(2)), torch.full((2,), 2.0))
    s = autograph.stats(f)
    assert s["captures"] == 0
    assert any(type(error).__name__ in d for d in s["eager_details"]["capture_failed"])


def test_user_exception_in_warmup_propagates_unchanged(standin):
    class Oops(Exception):
        pass

    @autograph.graphed(warmup=2)
    def f(x, fail):
        if fail:
            raise Oops("user error")
        return x + 1

    with torch.no_grad():
        with pytest.raises(Oops, match="user error"):
            f(torch.ones(1), True)
        for _ in range(4):
            torch.testing.assert_close(f(torch.ones(1), False), torch.full((1,), 2.0))
    assert autograph.stats(f)["replays"] == 1


def test_user_exception_at_capture_propagates_once_and_leaves_no_entry(standin):
    calls = Tally()

    @autograph.graphed(warmup=1)
    def f(x):
        if calls.tick() == 2:  # the capture
            raise ValueError("bad input")
        return x + 1

    with torch.no_grad():
        f(torch.ones(1))
        with pytest.raises(ValueError, match="bad input"):
            f(torch.ones(1))
        assert calls.n == 2  # the body ran once for the call that raised: no retry
        assert not standin.is_capturing(torch.device("cpu"))
        for _ in range(4):  # a warmup first (the capture raised), a capture, replays
            torch.testing.assert_close(f(torch.ones(1)), torch.full((1,), 2.0))
    s = autograph.stats(f)
    assert s["captures"] == 1 and s["replays"] == 2 and s["eager_reasons"]["warmup"] == 2


def test_without_a_graph_backend_everything_runs_eagerly():
    m = nn.Linear(3, 3)
    g = autograph.graphed(m)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(1, 3)
            torch.testing.assert_close(g(x), m(x))
    s = autograph.stats(g)
    assert s["eager"] == 3 and s["captures"] == 0
    assert "device" in s["eager_reasons"] and "inputs on cpu" in s["eager_details"]["device"]


def test_inputs_on_several_devices_run_eagerly(standin):
    @autograph.graphed(warmup=0)
    def f(x, y):
        return x.shape[0] + y.shape[0]

    assert f(torch.ones(2), torch.ones(3, device="meta")) == 5
    assert "several_devices" in autograph.stats(f)["eager_reasons"]


def test_no_tensor_arguments_run_eagerly(standin):
    @autograph.graphed
    def f(n):
        return torch.arange(n)

    assert torch.equal(f(3), torch.arange(3))
    assert "no_tensors" in autograph.stats(f)["eager_reasons"]


def test_nested_graphed_call_becomes_part_of_the_outer_graph(standin):
    @autograph.graphed(warmup=0)
    def inner(x):
        return x * 2

    @autograph.graphed(warmup=1)
    def outer(x):
        return inner(x) + 1

    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(3)
            torch.testing.assert_close(outer(x), x * 2 + 1)
    s_in, s_out = autograph.stats(inner), autograph.stats(outer)
    assert s_out["captures"] == 1 and s_out["replays"] == 2
    # it only ran inside the outer warmup, capture and its output variant's capture
    assert s_in["captures"] == 0
    assert s_in["calls"] == 3


def test_kill_switch_environment(standin, monkeypatch):
    monkeypatch.setenv("AUTOGRAPH_DISABLE", "1")

    @autograph.graphed(warmup=0)
    def f(x):
        return x + 1

    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(f(torch.ones(1)), torch.full((1,), 2.0))
    assert standin.captures == 0
    assert autograph.stats(f)["eager_reasons"] == {"disabled": 3}
    monkeypatch.setenv("AUTOGRAPH_DISABLE", "0")
    with torch.no_grad():
        f(torch.ones(1))
    assert standin.captures == 1


def test_disabled_context_is_thread_local(standin):
    @autograph.graphed(warmup=0)
    def f(x):
        return x + 1

    other = {}

    def in_thread():
        with torch.no_grad():
            f(torch.ones(4))
        other["captures"] = standin.captures

    with autograph.disabled(), torch.no_grad():
        f(torch.ones(2))
        assert standin.captures == 0
        t = threading.Thread(target=in_thread)
        t.start()
        t.join()
    assert other["captures"] == 1
    with torch.no_grad():
        f(torch.ones(2))
    assert standin.captures == 2


def test_tensor_subclass_and_sparse_arguments_run_eagerly(standin):
    @autograph.graphed(warmup=0)
    def f(x):
        return x * 2

    class Sub(torch.Tensor):
        pass

    with torch.no_grad():
        sub = torch.ones(2).as_subclass(Sub)
        assert torch.equal(f(sub), torch.full((2,), 2.0))
        sp = torch.eye(2).to_sparse()
        assert torch.equal(f(sp).to_dense(), torch.eye(2) * 2)
    details = autograph.stats(f)["eager_details"]["unkeyable_argument"]
    assert "tensor subclass Sub argument" in details
    assert "torch.sparse_coo tensor argument" in details


def test_calls_that_run_eagerly_anyway_are_not_padded():
    """Without a backend for the device (here: no stand-in), padding would only cost."""
    m = nn.Linear(4, 4)
    g = autograph.graphed(m, buckets=[4, 8])
    with torch.no_grad():
        for n in (3, 3, 5):
            torch.testing.assert_close(g(torch.ones(n, 4)), m(torch.ones(n, 4)))
    s = autograph.stats(g)
    assert s["buckets"] == {} and s["replays"] == 0


def test_a_key_whose_capture_raised_warms_up_before_capturing_again(standin):
    """A training batch norm over one value per channel writes its count and then
    raises. The call whose capture raised misses that write (a capture runs no kernel);
    later calls of the key run eagerly, writing as eager does, instead of capturing
    (and missing it) every time."""
    model, reference = nn.BatchNorm1d(3).train(), nn.BatchNorm1d(3).train()
    g = autograph.graphed(model, warmup=0)
    for _ in range(4):
        x = torch.randn(1, 3)
        with pytest.raises(ValueError):
            g(x)
        with pytest.raises(ValueError):
            reference(x)
    assert int(model.num_batches_tracked) == int(reference.num_batches_tracked) - 1
    x = torch.randn(4, 3)
    torch.testing.assert_close(g(x), reference(x))  # a warmup: eager, as the reference
    assert int(model.num_batches_tracked) == int(reference.num_batches_tracked) - 1


@pytest.mark.parametrize("buckets", [None, [2, 4]])
def test_calls_inside_torch_func_transforms_run_eagerly(standin, buckets):
    """``torch.vmap``, ``torch.func.grad``, ``jacrev`` and ``functionalize`` pass
    wrapper tensors without storage: the calls run eagerly, with their reason, and
    the same callable graphs plain calls before and after."""
    lin = nn.Linear(4, 4)
    g = autograph.graphed(lin, buckets=buckets)

    def f(x):
        return torch.tanh(g(x)).sum()

    xs = torch.randn(3, 2, 4)
    with torch.no_grad():
        for _ in range(6):  # graphs for plain calls first
            torch.testing.assert_close(g(xs[0]), lin(xs[0]))
    replays = autograph.stats(g)["replays"]
    assert replays >= 1
    torch.testing.assert_close(torch.vmap(g)(xs), lin(xs))
    x = xs[0]
    want = torch.func.grad(lambda t: torch.tanh(lin(t)).sum())(x)
    torch.testing.assert_close(torch.func.grad(f)(x), want)
    torch.testing.assert_close(torch.func.jacrev(g)(x), torch.func.jacrev(lin)(x))
    torch.testing.assert_close(torch.func.functionalize(g)(x), lin(x))
    s = autograph.stats(g)
    assert "torch.func transform" in str(s["eager_details"]), s
    with torch.no_grad():
        torch.testing.assert_close(g(xs[0]), lin(xs[0]))
    assert autograph.stats(g)["replays"] > replays


def _type_error(fn, *args, **kwargs):
    with pytest.raises(TypeError) as info:
        fn(*args, **kwargs)
    return info.value


@pytest.mark.parametrize("options", [{}, {"warmup": 0}, {"buckets": [2, 4]}])
def test_a_call_whose_arguments_do_not_fit_raises_as_eager_and_counts_no_warmup(
        standin, options):
    """Missing or extra arguments: eager's TypeError, counted as ``bad_arguments``, with
    no warmup counted and no entry left; calls that fit warm up and capture as ever."""
    def mul(x, y):
        return x * y

    g = autograph.graphed(mul, **options)
    lin = nn.Linear(2, 2)
    wrapped = autograph.graphed(lin, **options)
    x = torch.ones(3, 2)
    with torch.no_grad():
        for args, kwargs in [((x,), {}), ((x, x, x), {}), ((x,), {"z": x})] * 2:
            got = _type_error(g, *args, **kwargs)
            assert str(got) == str(_type_error(mul, *args, **kwargs))
        assert str(_type_error(wrapped, x, x)) == str(_type_error(lin, x, x))
        for f in (g, wrapped):
            s = autograph.stats(f)
            assert s["calls"] == s["eager"] == s["eager_reasons"]["bad_arguments"], s
            assert handle_of(f).engine.cache.entries == {}
        for _ in range(6):
            torch.testing.assert_close(g(x, x), x * x)
    s = autograph.stats(g)
    assert s["captures"] == 1 and s["replays"] >= 2, s
    assert s["eager_reasons"].get("warmup", 0) == options.get("warmup", 2), s


def test_a_forward_replaced_on_the_instance_still_graphs(standin):
    """Calls that do not fit the class's forward but run (a forward assigned to the
    instance takes them) stop being judged by that signature after the first."""
    m = nn.Linear(2, 2)
    m.forward = lambda x, scale: x * scale
    g = autograph.graphed(m)
    x = torch.ones(3, 2)
    with torch.no_grad():
        for _ in range(6):
            torch.testing.assert_close(g(x, 2.0), x * 2)
    s = autograph.stats(g)
    assert s["eager_reasons"] == {"bad_arguments": 1, "warmup": 2} and s["replays"] == 2, s
