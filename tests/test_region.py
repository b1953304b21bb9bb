"""capture_region(): scoping rules, proved on the CPU stand-in."""

import gc
import threading
import time

import pytest
import torch
from torch import nn

import autograph
from autograph import region as region_mod

pytestmark = pytest.mark.usefixtures("standin")

ORIGINAL_CALL = nn.Module.__call__


def one(stats):
    """The counters of the only module a region saw."""
    (value,) = stats.values()
    return value


def mlp():
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def run(model, n=4, batch=2):
    """Call ``model`` n times; its outputs are checked against eager after the block."""
    pairs = []
    with torch.no_grad():
        for _ in range(n):
            x = torch.randn(batch, 4)
            pairs.append((x, model(x)))
    _pending.append((model, pairs))


_pending = []


@pytest.fixture(autouse=True)
def outputs_equal_eager():
    """Every output a test produced equals eager, computed outside any region."""
    _pending.clear()
    yield
    assert nn.Module.__call__ is ORIGINAL_CALL
    with torch.no_grad(), autograph.disabled():
        for model, pairs in _pending:
            for x, out in pairs:
                torch.testing.assert_close(out, model(x))


def test_top_level_calls_are_graphed_and_submodules_are_part_of_the_graph():
    model = mlp()
    with autograph.capture_region() as region:
        run(model, 5)
    s = region.stats()
    assert [n.split("#")[0] for n in s] == ["Sequential"]  # Linear/ReLU: inside its graph
    assert (one(s)["captures"], one(s)["replays"]) == (1, 2)
    assert nn.Module.__call__ is ORIGINAL_CALL


def test_graphs_belong_to_the_module_and_outlive_the_region():
    model = mlp()
    with autograph.capture_region():
        run(model, 3)
    with autograph.capture_region() as second:
        run(model, 3)
    s = one(second.stats())
    assert (s["captures"], s["replays"], s["eager"]) == (0, 3, 0)


def test_outside_the_region_modules_run_as_before():
    model = mlp()
    with autograph.capture_region() as region:
        run(model, 3)
    run(model, 3)  # outside: plain module calls
    assert one(region.stats())["calls"] == 3
    assert autograph.stats()[next(iter(region.stats()))]["calls"] == 3


def test_nested_regions_inner_options_win():
    a, b = mlp(), mlp()
    with autograph.capture_region(warmup=5):
        with autograph.capture_region(warmup=0) as inner:
            run(a, 2)
        assert nn.Module.__call__ is not ORIGINAL_CALL  # the outer region is still open
        run(b, 2)
    assert one(inner.stats())["captures"] == 1  # captured on the first call
    assert nn.Module.__call__ is ORIGINAL_CALL


def test_graphed_modules_keep_their_own_options():
    g = autograph.graphed(mlp(), warmup=0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 2)

        @autograph.graphed(warmup=0)
        def forward(self, x):
            return self.fc(x)

    net = Net()
    with autograph.capture_region(warmup=3) as region:
        run(g, 2)
        run(net, 2)
    assert region.stats() == {}
    assert autograph.stats(g)["captures"] == 1
    assert autograph.stats(net)["captures"] == 1


def test_kill_switch_wins(monkeypatch):
    model = mlp()
    with autograph.capture_region(warmup=0) as region, autograph.disabled():
        run(model, 2)
    monkeypatch.setenv("AUTOGRAPH_DISABLE", "1")
    with autograph.capture_region(warmup=0):
        run(model, 2)
    s = one(region.stats())
    assert s["captures"] == 0 and s["eager_reasons"] == {"disabled": 2}


def test_exception_in_the_block_restores_everything():
    model = mlp()
    with pytest.raises(ValueError, match="boom"):
        with autograph.capture_region():
            run(model, 1)
            raise ValueError("boom")
    assert nn.Module.__call__ is ORIGINAL_CALL
    assert not getattr(region_mod._local, "regions", [])


def test_other_threads_are_not_affected():
    model, other = mlp(), mlp()
    inside, done = threading.Event(), threading.Event()
    seen = {}

    def worker():
        inside.wait()
        run(other, 3)  # while the main thread is inside a region
        seen["engines"] = id(other) in region_mod._handles
        done.set()

    t = threading.Thread(target=worker)
    t.start()
    with autograph.capture_region() as region:
        inside.set()
        done.wait(10)
        run(model, 3)
    t.join()
    assert seen["engines"] is False
    assert one(region.stats())["calls"] == 3


def test_works_as_a_decorator():
    model = mlp()
    region = autograph.capture_region(warmup=1)

    @region
    def serve(x):
        """Serve one batch."""
        return model(x)

    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(2, 4)
            torch.testing.assert_close(serve(x), model(x))
    assert serve.__doc__ == "Serve one batch."
    s = one(region.stats())
    assert (s["calls"], s["captures"], s["replays"]) == (4, 1, 2)
    assert nn.Module.__call__ is ORIGINAL_CALL


def test_garbage_collected_modules_take_their_graphs():
    model = mlp()
    with torch.no_grad(), autograph.capture_region():
        for _ in range(3):
            model(torch.randn(2, 4))
    key = id(model)
    assert key in region_mod._handles
    del model
    gc.collect()
    assert key not in region_mod._handles


def test_cache_objects_run_eagerly_and_pytree_containers_count_as_tensors():
    class Cache:
        def __init__(self):
            self.steps = 0

    class WithCache(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x, cache):
            cache.steps += 1
            return self.fc(x) + cache.steps

    class WithDict(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, batch):
            return {"y": self.fc(batch["x"]) * batch["scale"]}

    m1, m2, cache = WithCache(), WithDict(), Cache()
    results = []
    with torch.no_grad(), autograph.capture_region() as region:
        for _ in range(4):
            x, s = torch.randn(2, 4), torch.randn(2, 1)
            results.append((x, s, m1(x, cache), m2({"x": x, "scale": s})["y"]))
    with torch.no_grad():
        for i, (x, s, y1, y2) in enumerate(results):
            torch.testing.assert_close(y1, m1.fc(x) + (i + 1))
            torch.testing.assert_close(y2, m2.fc(x) * s)
    stats = {name.split("#")[0].rsplit(".")[-1]: v for name, v in region.stats().items()}
    assert stats["WithCache"]["captures"] == 0
    assert stats["WithCache"]["eager"] == 4  # each call a new key (cache.steps), eager
    assert (stats["WithDict"]["captures"], stats["WithDict"]["replays"]) == (1, 1)


class Tower(nn.Module):
    """A model whose methods call its submodules directly (CLIP's ``get_*_features``)."""

    def __init__(self):
        super().__init__()
        self.text = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
        self.proj = nn.Linear(8, 4)

    def forward(self, x):
        return self.proj(self.text(x))

    def features(self, x):
        return nn.functional.normalize(self.proj(self.text(x)), dim=-1)


def check_methods_graph_their_submodule_calls(device="cpu"):
    """A wrapped module's own method that calls its submodules (not the module) has
    those calls graphed, each submodule on its engine (they ran eagerly, uncounted)."""
    torch.manual_seed(0)
    m = Tower().to(device).eval()
    g = autograph.graphed(m, buckets=[4, 8])  # per-argument options stay the forward's
    with torch.no_grad():
        for _ in range(6):
            x = torch.randn(3, 8, device=device)
            torch.testing.assert_close(g.features(x), m.features(x))
    s = autograph.stats(m.text)
    assert s["replays"] >= 3 and autograph.stats(m.proj)["replays"] >= 3, s
    assert autograph.stats(g)["calls"] == 0


def test_methods_graph_their_submodule_calls(standin):
    check_methods_graph_their_submodule_calls()


class Prepared(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 3)

    def forward(self, x):
        return self.lin(x)

    def prepare(self):  # ends with ``return self``, as ultralytics' ``fuse()`` does
        self.eval()
        return self

    def encode_iter(self, xs):
        for x in xs:
            got = yield self(x)
            if got is not None:
                yield got


def test_methods_returning_the_module_or_yielding_stay_graphed(standin):
    """A method returning the module returns the wrapper (it returned the bare module,
    whose calls were never graphed), and a generator method's calls of the module run
    through the wrapper's engine while it runs (they ran eagerly, uncounted)."""
    m = Prepared()
    g = autograph.graphed(m).prepare()
    assert g is not m and isinstance(g, Prepared) and autograph.stats(g)["calls"] == 0
    xs = [torch.randn(2, 8) for _ in range(6)]
    with torch.no_grad():
        for x in xs:
            torch.testing.assert_close(g(x), m.lin(x))
        outs = list(g.encode_iter(xs))
        steps = g.encode_iter(xs[:2])
        first = next(steps)
        assert steps.send("sent") == "sent"
        rest = list(steps)
    for x, y in zip(xs, outs):
        torch.testing.assert_close(y, m.lin(x))
    torch.testing.assert_close(first, m.lin(xs[0]))
    assert len(rest) == 1
    s = autograph.stats(g)
    assert s["calls"] == 6 + 6 + 2 and s["replays"] >= 10, s


def test_a_region_refuses_to_decorate_generators_and_async_functions():
    """Their bodies run after the call returns, outside the region: the region graphed
    nothing and said nothing; refused as ``graphed`` refuses them."""
    def steps(model, x):
        yield model(x)

    async def step(model, x):
        return model(x)

    async def stream(model, x):
        yield model(x)

    for fn, kind in ((steps, "a generator function"), (step, "an async function"),
                     (stream, "an async generator function")):
        with pytest.raises(TypeError, match=f"cannot decorate {kind} "):
            autograph.capture_region()(fn)


def test_a_region_refuses_a_callable_object_whose_call_is_async():
    class Handler:
        async def __call__(self, x):
            return x

    with pytest.raises(TypeError, match="cannot decorate an async function"):
        autograph.capture_region()(Handler())
    autograph.capture_region()(nn.Linear(2, 2))  # a module's __call__ is not


def check_one_region_entered_from_two_threads_keeps_each_threads_scope(device="cpu"):
    """One region object (a decorated method of a threaded server) entered by another
    thread while this one is inside it: each thread leaves its own entry (its exit
    undid the other thread's, dropping this one's region early and leaving it open
    after the function returned, where later module calls were still graphed)."""
    model = nn.Linear(4, 4).to(device)
    region = autograph.capture_region()
    inside, entered, done = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    @region
    def inner():
        inside.set()
        entered.wait(10)

    @region
    def outer():
        inner()
        seen["after inner"] = bool(region_mod._regions.get())

    def first():
        outer()
        seen["after outer"] = bool(region_mod._regions.get())
        with torch.no_grad():
            for _ in range(5):
                model(torch.randn(2, 4, device=device))
        done.set()

    def second():
        inside.wait(10)
        with region:
            entered.set()
            done.wait(10)

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {"after inner": True, "after outer": False}, seen
    assert not region.stats(), region.stats()  # no module call was made inside it


def test_one_region_entered_from_two_threads_keeps_each_threads_scope(standin):
    check_one_region_entered_from_two_threads_keeps_each_threads_scope()


def check_interleaved_regions_leave_only_their_own_entry(device="cpu"):
    """Two generators each streaming calls inside a region of their own, iterated in
    turn in one thread: each leaves only its own entry (the first's exit dropped the
    second's region, and the second's put the first's back, open for good)."""
    model = nn.Linear(8, 8).to(device)

    def stream(n):
        with autograph.capture_region():
            for _ in range(n):
                yield model(torch.randn(2, 8, device=device))

    before = region_mod._regions.get()  # (a generator of an earlier test, not closed)
    with torch.no_grad():
        a, b = stream(2), stream(3)
        next(a)
        next(b)
        next(a)
        list(a)
        assert len(region_mod._regions.get()) == len(before) + 1  # b's, still open
        list(b)
    assert region_mod._regions.get() == before


def test_interleaved_regions_leave_only_their_own_entry(standin):
    check_interleaved_regions_leave_only_their_own_entry()


def test_threads_calling_a_module_first_in_their_regions_share_one_engine(standin, monkeypatch):
    """Threads that call a module for the first time at once, each in its region, get
    one engine (each made its own, and the first calls were counted under another name
    in the region's stats)."""
    made = region_mod.make_module_engine

    def slowly(*args, **kwargs):
        time.sleep(0.05)  # widen the window the threads race in
        return made(*args, **kwargs)

    monkeypatch.setattr(region_mod, "make_module_engine", slowly)
    model = nn.Linear(4, 4)
    start, regions = threading.Barrier(4), []

    def worker():
        start.wait()
        with torch.no_grad(), autograph.capture_region() as region:
            regions.append(region)
            for _ in range(3):
                model(torch.randn(2, 4))

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert [len(r.stats()) for r in regions] == [1, 1, 1, 1], [r.stats() for r in regions]


def test_keyword_and_positional_spellings_share_a_key_in_a_region():
    """``m(x, mask, 2.0)`` and ``m(x, mask=mask, scale=2.0)`` are one key, in a region
    as for ``graphed(m)``: the region's patch of ``nn.Module.__call__`` passes the
    spelling on as torch's own does (they were two keys, two captures)."""
    from .test_usage import TwoInputs

    m, x, mask = TwoInputs(), torch.randn(3, 4), torch.rand(3, 4)
    region = autograph.capture_region()
    with torch.no_grad():
        for i in range(8):
            with region:
                out = m(x, mask=mask, scale=2.0) if i % 2 else m(x, mask, 2.0)
            torch.testing.assert_close(out, m.lin(x) * 2.0 * mask)
    s = one(region.stats())
    assert s["captures"] == 1 and s["replays"] == 5, s
