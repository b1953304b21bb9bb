"""Routes: a bucketed call whose key replayed before takes the short path (keyed once,
no engine dispatch), and leaves it whenever what the route assumed stops holding.  On
the CPU stand-in, whose replays re-run the recorded operators on the captured buffers:
a route replaying the wrong graph or a stale buffer shows as wrong values."""

import pytest
import torch
from torch import nn

import autograph
from autograph.dispatch import Engine
from autograph.lookup import handle_of

from . import serving

pytestmark = pytest.mark.usefixtures("standin")


@pytest.fixture
def dispatches(monkeypatch):
    """Counts the engine's full dispatches (a routed call makes none)."""
    count = [0]
    real = Engine.dispatch

    def counted(self, args, kwargs):
        count[0] += 1
        return real(self, args, kwargs)

    monkeypatch.setattr(Engine, "dispatch", counted)
    return count


def _routes(f):
    return handle_of(f).call.routes.table


def test_routed_calls_equal_eager_and_skip_the_engine_dispatch(dispatches):
    @autograph.graphed(buckets=[4, 8], warmup=1)
    def f(x, scale):
        return x * scale + 1

    with torch.no_grad():
        for n in (7, 8, 3, 4) * 3:  # learn, warm up, capture, then routes
            f(torch.randn(n, 5), 2.0)
        assert len(_routes(f)) == 4  # one per caller key: 7, 8, 3 and 4 rows
        dispatches[0] = 0
        kept = []
        for n in (7, 8, 3, 4, 7):
            x = torch.randn(n, 5)
            out = f(x, 2.0)
            torch.testing.assert_close(out, x * 2 + 1)
            assert out.shape == (n, 5) and out.is_contiguous()
            kept.append((out, out.clone()))
        assert dispatches[0] == 0
        for _ in range(2):  # another scalar: another key (learned, checked, dispatched)
            x = torch.randn(7, 5)
            torch.testing.assert_close(f(x, 3.0), x * 3 + 1)
        assert dispatches[0] == 1
    for out, copy in kept:  # later calls never changed a result already returned
        assert torch.equal(out, copy)
    s = autograph.stats(f)
    assert s["graphs"] == 2  # the 3.0 key warmed up only
    # routed calls are counted per bucket as the bucketer's own path counts them
    assert s["buckets"][8] == {"hits": 9, "real_rows": 67, "padded_rows": 5, "eager": 2}
    assert s["buckets"][4] == {"hits": 8, "real_rows": 28, "padded_rows": 4, "eager": 1}


def test_exact_size_call_returning_a_view_of_its_argument_gets_the_callers_tensor():
    @autograph.graphed(buckets=[8], warmup=0)
    def f(x):
        return x[:, :2], x * 2

    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(8, 5)
            view, doubled = f(x)
            assert view.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
            torch.testing.assert_close(view, x[:, :2])
            torch.testing.assert_close(doubled, x * 2)
    assert _routes(f)


def test_route_follows_a_parameter_change():
    model = nn.Linear(5, 3).eval()
    g = autograph.graphed(model, buckets=[8], warmup=0)
    with torch.no_grad():
        for _ in range(3):
            g(torch.randn(7, 5))
        assert _routes(g)
        model.weight.data = torch.randn(3, 5)  # a new address: the guards drop everything
        x = torch.randn(7, 5)
        torch.testing.assert_close(g(x), model(x))
        model.weight.mul_(2)  # in place: the graph reads it at its address
        x = torch.randn(7, 5)
        torch.testing.assert_close(g(x), model(x))


def test_route_checks_the_address_of_arguments_written_in_place(dispatches):
    @autograph.graphed(buckets=[8], warmup=0, pad_values={"slots": 8},
                       pad_writes={"cache": (0, 8)})
    def step(x, slots, cache):
        cache[slots] = x
        return x * 2

    caches = [torch.zeros(9, 4), torch.zeros(9, 4)]
    with torch.no_grad():
        for i in range(8):  # alternate caches: each call must write its own
            cache = caches[i % 2]
            x, slots = torch.randn(7, 4), torch.randperm(8)[:7]
            torch.testing.assert_close(step(x, slots, cache), x * 2)
            torch.testing.assert_close(cache[slots], x)
            if i == 5:
                # a route per cache address, both kept: no dispatch from here on
                assert [len(found) for found in _routes(step).values()] == [2]
                dispatches[0] = 0
        assert dispatches[0] == 0
    assert autograph.stats(step)["padding"] is None


def test_padding_switched_off_in_a_context_drops_its_routes():
    @autograph.graphed(buckets=[4, 8], warmup=0)
    def f(x):
        if x.shape[0] <= 4:  # rows interact at the small bucket only
            return x - x.mean(0)
        return x * 2

    with torch.no_grad():
        for _ in range(3):
            f(torch.randn(7, 5))
        assert _routes(f)
        x = torch.randn(3, 5)
        torch.testing.assert_close(f(x), x - x.mean(0))
        assert not _routes(f)
        hits = autograph.stats(f)["buckets"][8]["hits"]
        for _ in range(2):
            x = torch.randn(7, 5)
            torch.testing.assert_close(f(x), x * 2)  # one graph per size now
        assert autograph.stats(f)["buckets"][8]["hits"] == hits
    assert autograph.stats(f)["padding"].startswith("padding off")


def test_evicted_or_reset_graph_leaves_its_route():
    @autograph.graphed(buckets=[4, 8], warmup=0, max_graphs=1)
    def f(x):
        return x + 1

    def call(n):
        x = torch.randn(n, 5)
        torch.testing.assert_close(f(x), x + 1)

    with torch.no_grad():
        for _ in range(4):
            call(7)
        assert _routes(f)
        captures = autograph.stats(f)["captures"]
        call(3)  # bucket 4's graph evicts bucket 8's
        assert autograph.stats(f)["evictions"] == 1
        assert not _routes(f)  # no route keeps a freed graph (its memory) alive
        call(7)  # not a replay of the evicted graph: captured again
        assert autograph.stats(f)["captures"] == captures + 2
        for _ in range(2):
            call(7)
        autograph.reset(f)
        assert not _routes(f)
        call(7)  # the route's graph is gone: the bucketer's path, which captures again
        assert autograph.stats(f)["captures"] == captures + 3


def test_grad_mode_and_nested_containers_take_the_bucketers_own_path(dispatches):
    @autograph.graphed(buckets=[8], warmup=0)
    def f(xs):
        return xs[0] * 2

    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(7, 5)
            torch.testing.assert_close(f([x]), x * 2)
    assert not _routes(f)  # a list argument: no route
    model = nn.Linear(5, 3)
    g = autograph.graphed(model, buckets=[8], warmup=0)
    with torch.no_grad():
        for _ in range(3):
            g(torch.randn(7, 5))
    routes = dict(_routes(g))
    assert routes and all(not key.modes[0] for key in routes)  # keyed without grad
    for _ in range(3):  # grad mode on: other keys, never the buffers (autograd keeps them)
        x = torch.randn(7, 5)
        out = g(x)
        torch.testing.assert_close(out, model(x))
        assert out.requires_grad
    assert dict(_routes(g)) == routes


def test_serving_loop_with_routes_matches_eager():
    torch.manual_seed(0)
    model = serving.SlotDecoder().eval()
    step = autograph.graphed(model, buckets=serving.BUCKETS, warmup=0,
                             pad_values={"slot_ids": serving.DUMMY},
                             pad_writes={"k_cache": (0, serving.DUMMY),
                                         "v_cache": (0, serving.DUMMY)})
    want_cache = serving.new_cache(model, "cpu")
    got_cache = serving.new_cache(model, "cpu")
    with torch.no_grad():
        for live in serving.schedule(40, seed=3):
            slots = torch.tensor([s for s, _ in live])
            pos = torch.tensor([p for _, p in live])
            tokens = torch.randint(0, 50, (len(live),))
            want = model(tokens, slots, pos, *want_cache)
            got = step(tokens, slots, pos, *got_cache)
            torch.testing.assert_close(got, want)
            for a, b in zip(got_cache, want_cache):
                torch.testing.assert_close(a[:serving.SLOTS], b[:serving.SLOTS])
    assert _routes(step)
    assert autograph.stats(step)["padding"] is None
