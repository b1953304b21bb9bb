"""Keys, warmup, static buffers, in-place arguments, outputs, LRU: the orchestration,
proved on the CPU stand-in (whose replay reads only the buffers it captured)."""

import pytest
import torch
from torch import nn

import autograph
from autograph.buffers import StaticInputs

pytestmark = pytest.mark.usefixtures("standin")


def stats_of(fn):
    return autograph.stats(fn)


def test_warmup_then_capture_then_replay():
    @autograph.graphed(warmup=2)
    def f(x):
        return x * 3 + 1

    seen = []
    with torch.no_grad():
        for _ in range(5):
            x = torch.randn(4)
            assert torch.allclose(f(x), x * 3 + 1)
            s = stats_of(f)
            seen.append((s["eager"], s["captures"], s["replays"]))
    assert seen == [(1, 0, 0), (2, 0, 0), (2, 1, 0), (2, 1, 1), (2, 1, 2)]


def test_warmup_zero_captures_first_call():
    @autograph.graphed(warmup=0)
    def f(x):
        return x.exp()

    with torch.no_grad():
        x = torch.randn(3)
        assert torch.allclose(f(x), x.exp())
    assert stats_of(f)["captures"] == 1 and stats_of(f)["eager"] == 0


def test_standin_catches_a_forgotten_copy(monkeypatch):
    """The stand-in is only worth its name if a missing copy-in gives wrong results."""
    monkeypatch.setattr(StaticInputs, "copy_in", lambda self, leaves: None)

    @autograph.graphed(warmup=0)
    def f(x, y):
        return x + y

    with torch.no_grad():
        f(torch.zeros(3), torch.ones(3))
        out = f(torch.ones(3), torch.ones(3))
    assert torch.equal(out, torch.ones(3))  # stale: the graph read the old buffers


def test_fresh_random_inputs_equal_eager():
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4))
    g = autograph.graphed(model)
    with torch.no_grad():
        for _ in range(10):
            x = torch.randn(5, 8)
            torch.testing.assert_close(g(x), model(x))
    assert autograph.stats(g)["replays"] == 7


def test_outputs_are_safe_to_keep():
    @autograph.graphed(warmup=0)
    def f(x):
        return x * 2, {"sum": x.sum()}

    with torch.no_grad():
        a = torch.randn(4)
        out_a, d_a = f(a)
        b = torch.randn(4)
        out_b, d_b = f(b)
    assert torch.allclose(out_a, a * 2) and torch.allclose(d_a["sum"], a.sum())
    assert torch.allclose(out_b, b * 2) and torch.allclose(d_b["sum"], b.sum())
    assert out_a.data_ptr() != out_b.data_ptr()


def test_one_graph_per_shape_dtype_and_value():
    @autograph.graphed(warmup=0)
    def f(x, k):
        return x * k

    with torch.no_grad():
        calls = [
            (torch.randn(2), 2), (torch.randn(3), 2), (torch.randn(2).double(), 2),
            (torch.randn(2), 3), (torch.randn(2), 2.0), (torch.randn(2), -0.0),
            (torch.randn(2), 0.0), (torch.randn(2).t(), True),
        ]
        for x, k in calls:
            out = f(x, k)
            torch.testing.assert_close(out, x * k)
            assert out.dtype == (x * k).dtype
    assert stats_of(f)["captures"] == len(calls)


def test_a_negative_nan_is_keyed_apart(standin):
    """``float.hex()`` spells every NaN ``'nan'``: a graph captured with NaN replayed
    for -NaN, and ``copysign`` gave +1 where eager gives -1.  Also inside a complex."""
    @autograph.graphed(warmup=0)
    def f(x, s, c):
        return torch.copysign(x, torch.tensor(s)) + torch.copysign(x, torch.tensor(c.imag))

    nan = float("nan")
    with torch.no_grad():
        for s, c in [(nan, complex(0, nan)), (nan, complex(0, nan)), (-nan, complex(0, nan)),
                     (-nan, complex(0, -nan)), (nan, complex(0, nan))]:
            x = torch.rand(3) + 1
            out = f(x, s, c)
            want = torch.copysign(x, torch.tensor(s)) + torch.copysign(x, torch.tensor(c.imag))
            torch.testing.assert_close(out, want)
    assert stats_of(f)["captures"] == 3 and stats_of(f)["replays"] == 2


def test_strides_are_part_of_the_key():
    @autograph.graphed(warmup=0)
    def f(x):
        return x + 0

    with torch.no_grad():
        x = torch.randn(3, 4)
        f(x)
        f(x.t().contiguous().t())
        torch.testing.assert_close(f(x.t()), x.t())
    assert stats_of(f)["captures"] == 3


def test_pytree_arguments_and_kwargs():
    @autograph.graphed(warmup=1)
    def f(xs, scale=1.0, *, extra):
        return [x * scale for x in xs] + [extra["b"] - 1]

    with torch.no_grad():
        for _ in range(4):
            xs = [torch.randn(2), torch.randn(3)]
            b = torch.randn(2)
            out = f(xs, scale=0.5, extra={"b": b})
            torch.testing.assert_close(out, [xs[0] * 0.5, xs[1] * 0.5, b - 1])
    s = stats_of(f)
    assert (s["captures"], s["replays"]) == (1, 2)


def test_object_changed_by_every_call_runs_eagerly():
    """An object argument whose scalar the call advances has a new key every call, and
    each key runs eagerly (a graph would replay none of the Python), saying why."""

    class Cache:
        def __init__(self):
            self.step = 0

    @autograph.graphed(warmup=0)
    def f(x, cache):
        cache.step += 1
        return x + cache.step

    c = Cache()
    with torch.no_grad():
        for i in range(3):
            assert torch.equal(f(torch.zeros(1), c), torch.tensor([i + 1.0]))
    s = stats_of(f)
    assert s["captures"] == 0 and s["eager"] == 3
    from autograph.lookup import _engines_of

    (engine,) = _engines_of(f)
    details = {e.detail for e in engine.cache.entries.values()}
    assert details == {"the call changes Cache.step (a graph replays only device work)"}


def test_a_growing_transformers_cache_says_how_to_graph(standin):
    """A per-layer graph handed the model's ``DynamicCache`` (``use_cache`` left on in
    a training loop) appends to it every call and runs eagerly: the reason says what
    to pass instead."""
    cache_utils = pytest.importorskip("transformers.cache_utils")

    @autograph.graphed
    def layer(x, cache):
        k, _ = cache.update(x, x, 0)
        return k.sum(-2)

    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(1, 2, 1, 4)
            torch.testing.assert_close(layer(x, cache_utils.DynamicCache()), x.sum(-2))
    details = stats_of(layer)["eager_details"]["assigns_attribute"]
    assert all("use_cache=False" in d for d in details) and details, details


def test_in_place_argument_is_captured_at_its_address():
    def step(cache, pos, value):
        cache.index_copy_(0, pos, value)
        return cache.sum(0)

    g = autograph.graphed(step)
    cache, ref = torch.zeros(16, 4), torch.zeros(16, 4)
    with torch.no_grad():
        for i in range(10):
            pos, value = torch.tensor([i]), torch.randn(1, 4)
            out = g(cache, pos, value)
            expect = step(ref, pos, value)
            torch.testing.assert_close(out, expect)
            torch.testing.assert_close(cache, ref)
    s = stats_of(g)
    assert (s["captures"], s["replays"]) == (1, 7)
    (entry,) = g._self_dispatch.handle.engine.cache.entries.values()
    assert entry.graph.static.positions == [1, 2]  # the cache itself is never copied


def test_a_second_cache_gets_its_own_graph_and_neither_is_clobbered():
    @autograph.graphed(warmup=1)
    def step(cache, value):
        cache.add_(value)
        return cache * 1

    a, b = torch.zeros(3), torch.full((3,), 10.0)
    with torch.no_grad():
        for _ in range(3):
            step(a, torch.ones(3))
            step(b, torch.ones(3))
    assert torch.equal(a, torch.full((3,), 3.0))
    assert torch.equal(b, torch.full((3,), 13.0))
    assert stats_of(step)["captures"] == 2


def test_returning_an_argument_returns_the_callers_tensor():
    @autograph.graphed(warmup=0)
    def f(x, cache):
        cache.add_(1)
        return x, x[1:], cache, x * 2

    with torch.no_grad():
        for _ in range(3):
            x, cache = torch.randn(4), torch.zeros(2)
            a, b, c, d = f(x, cache)
            assert a is x and c is cache
            assert b.data_ptr() == x[1:].data_ptr() and torch.equal(b, x[1:])
            torch.testing.assert_close(d, x * 2)


def test_returning_a_parameter_returns_the_parameter():
    lin = nn.Linear(2, 2)

    @autograph.graphed(warmup=0)
    def f(x):
        return lin(x), lin.weight

    with torch.no_grad():
        for _ in range(3):
            y, w = f(torch.randn(1, 2))
            assert w is lin.weight


def test_buffer_updated_in_forward_is_updated_on_replay():
    class Counter(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("n", torch.zeros(()))

        def forward(self, x):
            self.n.add_(1)
            return x + self.n

    m = Counter()
    g = autograph.graphed(m)
    with torch.no_grad():
        for i in range(6):
            torch.testing.assert_close(g(torch.zeros(2)), torch.full((2,), i + 1.0))
    assert m.n.item() == 6


def test_lru_past_max_graphs():
    @autograph.graphed(warmup=0, max_graphs=2)
    def f(x):
        return x + 1

    with torch.no_grad():
        f(torch.randn(1))
        f(torch.randn(2))
        f(torch.randn(1))  # 1 is now the most recent
        f(torch.randn(3))  # evicts 2
        f(torch.randn(1))
    s = stats_of(f)
    assert s["graphs"] == 2 and s["evictions"] == 1 and s["captures"] == 3
    with torch.no_grad():
        torch.testing.assert_close(f(torch.ones(2)), torch.full((2,), 2.0))
    assert stats_of(f)["captures"] == 4


def test_ever_new_keys_do_not_grow_without_bound():
    @autograph.graphed(warmup=3, max_graphs=2)
    def f(x, k):
        return x * k

    with torch.no_grad():
        for k in range(500):
            f(torch.ones(1), k)
    assert len(f._self_dispatch.handle.engine.cache.entries) <= 8 * 2 + 64


def test_modes_are_part_of_the_key():
    @autograph.graphed(warmup=0)
    def f(x):
        return x @ x.T

    x = torch.randn(4, 4)
    with torch.no_grad():
        a = f(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            b = f(x)
    with torch.inference_mode():
        c = f(x)
    assert a.dtype == torch.float32 and b.dtype == torch.bfloat16 and c.dtype == torch.float32
    assert stats_of(f)["captures"] == 3


def test_training_flag_is_part_of_the_key():
    m = nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.5))
    g = autograph.graphed(m, warmup=0)
    x = torch.randn(4, 3)
    with torch.no_grad():
        g.eval()
        torch.testing.assert_close(g(x), m(x))
        g.train()
        y = g(x)
    assert (y == 0).any()  # dropout active in training mode
    assert autograph.stats(g)["captures"] == 2


def test_capture_sees_in_place_on_view_of_argument():
    @autograph.graphed(warmup=1)
    def f(buf, v):
        buf[0].copy_(v)
        return buf[0] * 1

    buf = torch.zeros(2, 3)
    with torch.no_grad():
        for _ in range(4):
            v = torch.randn(3)
            torch.testing.assert_close(f(buf, v), v)
            torch.testing.assert_close(buf[0], v)


def test_nan_inputs_are_not_mistaken_for_writes():
    @autograph.graphed(warmup=0)
    def f(x):
        return torch.nan_to_num(x) + 1

    with torch.no_grad():
        for _ in range(3):
            x = torch.tensor([1.0, float("nan")])
            torch.testing.assert_close(f(x), torch.tensor([2.0, 1.0]))
    assert stats_of(f)["replays"] == 2


def test_output_objects_are_made_again_per_call():
    class Box:  # not a registered pytree node: made again around clones per call
        def __init__(self, t):
            self.t = t

    @autograph.graphed(warmup=0)
    def f(x):
        return Box(x * 2)

    with torch.no_grad():
        boxes = [f(torch.full((2,), float(i))) for i in range(3)]
    for i, box in enumerate(boxes):  # none overwritten by a later replay
        assert type(box) is Box
        torch.testing.assert_close(box.t, torch.full((2,), 2.0 * i))
    s = stats_of(f)
    assert s["captures"] == 1 and s["replays"] == 2


def test_outputs_that_cannot_be_made_again_run_eagerly():
    import threading

    class Locked:  # holds what a call's output object cannot be made again with
        def __init__(self, t):
            self.t, self.lock = t, threading.Lock()

    @autograph.graphed(warmup=0)
    def f(x):
        return Locked(x * 2)

    with torch.no_grad():
        boxes = [f(torch.full((2,), float(i))) for i in range(3)]
    for i, box in enumerate(boxes):
        torch.testing.assert_close(box.t, torch.full((2,), 2.0 * i))
    s = stats_of(f)
    assert s["captures"] == 0 and s["eager"] == 3
    details = s["eager_details"]["unsupported_output"]
    assert any("output of type" in d and "Locked" in d for d in details)


def test_one_tensor_passed_twice_and_written_through_one_of_them():
    @autograph.graphed(warmup=1)
    def f(a, b):
        a.add_(1)
        return b * 2

    x = torch.zeros(3)
    with torch.no_grad():
        for i in range(4):
            out = f(x, x)
            torch.testing.assert_close(x, torch.full((3,), i + 1.0))
            torch.testing.assert_close(out, torch.full((3,), 2.0 * (i + 1)))
    assert stats_of(f)["replays"] >= 1


def test_views_of_a_written_argument_and_non_contiguous_writes():
    @autograph.graphed(warmup=1)
    def f(cache, v):
        cache.add_(v)
        return cache[0], cache.t()

    base = torch.zeros(3, 2)
    cache, ref = base.t(), base.clone().t()  # a non-contiguous cache
    with torch.no_grad():
        for _ in range(5):
            v = torch.randn(2, 3)
            first, transposed = f(cache, v)
            ref.add_(v)
            torch.testing.assert_close(cache, ref)
            torch.testing.assert_close(first, ref[0])
            torch.testing.assert_close(transposed, ref.t())
            assert first.data_ptr() == cache.data_ptr()  # a view of the caller's tensor
    assert stats_of(f)["replays"] == 3


def test_zero_size_arguments():
    @autograph.graphed(warmup=1)
    def f(x, y):
        return x.sum(0) + y

    with torch.no_grad():
        for _ in range(4):
            x, y = torch.randn(0, 3), torch.randn(3)
            torch.testing.assert_close(f(x, y), y)
    assert stats_of(f)["replays"] == 2


@pytest.mark.parametrize("extra", [(), (3,), (2.5, None, "a", True)])
def test_plain_and_keyword_calls_replay_their_own_graphs(extra):
    """Positional calls (no pytree) and keyword calls (another structure) each get
    their graph, keyed by the one key function, and replay it."""
    m = nn.Linear(4, 4)

    def f(x, *rest, scale=1.0):
        return m(x) * scale

    g = autograph.graphed(f)
    x = torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(4):
            torch.testing.assert_close(g(x, *extra), f(x))
            torch.testing.assert_close(g(x, *extra, scale=2.0), f(x, scale=2.0))
    s = autograph.stats(g)
    assert (s["captures"], s["replays"]) == (2, 2)


def test_write_recorder_stays_out_of_dynamo_only_once_dynamo_is_imported(monkeypatch):
    """Wrapping the recorder for Dynamo imports Dynamo on first use (seconds of a first
    call); without Dynamo imported, nothing can compile the recorder's frames."""
    import sys

    from autograph import mutation

    monkeypatch.setitem(sys.modules, "torch._dynamo", sys.modules.get("torch._dynamo", object()))
    assert type(mutation.WriteRecorder({})) is mutation._DynamoSafeRecorder
    monkeypatch.delitem(sys.modules, "torch._dynamo")
    recorder = mutation.WriteRecorder({})
    assert type(recorder) is mutation._Recorder
    x = torch.zeros(3)
    with mutation.WriteRecorder(mutation.watch_map([x], (0,))) as rec:
        x.add_(1)
    assert rec.written == {0}


def test_autocast_weight_casts_cached_by_eager_calls_are_no_hidden_reads(standin):
    """An eager call in an autocast block caches the weights' casts; a warmup in the same
    block must not read them (the block's end frees them: a guard on them would drop
    every graph), as the capture does not."""
    m = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4))
    g = autograph.graphed(m)
    with torch.no_grad():
        for i in range(10):
            x = torch.randn(2, 8)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bool(i % 2)):
                want = m(x)
                got = g(x)
            assert got.dtype == want.dtype
            torch.testing.assert_close(got, want)
    s = autograph.stats(g)
    assert s["invalidations"] == 0 and s["replays"] >= 4, s


@pytest.mark.parametrize("through", ["detach", "view_as", "itself"])
def test_an_output_that_is_the_whole_argument_is_what_eager_returns(through):
    """``x.detach()`` is a tensor of its own in eager mode: resizing or reshaping it in
    place leaves ``x`` as it was (replays returned ``x`` itself); ``return x`` is ``x``."""
    make = {"detach": lambda x: x.detach(), "view_as": lambda x: x.view_as(x),
            "itself": lambda x: x}[through]
    g = autograph.graphed(make, warmup=1)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(3, 8)
            y = g(x)
            assert (y is x) == (through == "itself")
            assert y.data_ptr() == x.data_ptr()  # the same memory, as eager's
            if through != "itself":
                y.unsqueeze_(0)
                assert x.shape == (3, 8)
    assert autograph.stats(g)["replays"] == 2
