"""Real CUDA graphs: every point of the core, graphed output against eager on fresh
random inputs.  Skipped without CUDA."""

import logging
import threading
import time

import pytest
import torch
from torch import nn

import autograph
from autograph import capture
from autograph.cli.models import Decoder, mlp

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

FP16 = {"rtol": 2e-2, "atol": 2e-2}


def small_decoder(dtype=torch.float16):
    torch.manual_seed(0)
    return Decoder(layers=2, d=128, heads=4, vocab=1000, max_len=64).cuda().to(dtype).eval()


def test_mlp_replays_and_equals_eager():
    model = mlp(64, 3).cuda().eval()
    g = autograph.graphed(model)
    with torch.no_grad():
        for _ in range(20):
            x = torch.randn(4, 64, device="cuda")
            torch.testing.assert_close(g(x), model(x))
    s = autograph.stats(g)
    assert (s["captures"], s["replays"], s["eager"]) == (1, 17, 2)
    assert s["graph_memory_bytes"] > 0


def test_decode_loop_with_in_place_cache_equals_eager():
    model = small_decoder()
    g = autograph.graphed(model)
    cache, ref = model.new_cache(3), model.new_cache(3)
    with torch.no_grad():
        for pos in range(40):
            tokens = torch.randint(0, 1000, (3, 1), device="cuda")
            p = torch.tensor([pos], device="cuda")
            out = g(tokens, p, *cache)
            expect = model(tokens, p, *ref)
            torch.testing.assert_close(out, expect, **FP16)
            torch.testing.assert_close(cache[0], ref[0], **FP16)
            torch.testing.assert_close(cache[1], ref[1], **FP16)
    s = autograph.stats(g)
    assert s["captures"] == 1 and s["replays"] == 37
    (entry,) = g._self_engine.cache.entries.values()
    assert entry.graph.static.positions == [0, 1]  # tokens and pos copied; caches never


def test_outputs_are_safe_to_keep():
    model = mlp(32, 2).cuda().eval()
    g = autograph.graphed(model, warmup=0)
    with torch.no_grad():
        xs = [torch.randn(2, 32, device="cuda") for _ in range(5)]
        outs = [g(x) for x in xs]
        for x, out in zip(xs, outs):
            torch.testing.assert_close(out, model(x))


def test_one_graph_per_shape_and_shared_pool():
    model = nn.Sequential(nn.Linear(1024, 8192), nn.GELU(), nn.Linear(8192, 1024)).cuda()
    g = autograph.graphed(model, warmup=1)
    with torch.no_grad():  # eager results first: the warmups reuse their cached blocks
        xs = [torch.randn(b, 1024, device="cuda") for b in (512, 256, 128) * 4]
        expected = [model(x) for x in xs]
        # what the first capture and warmup of a process make, whichever test runs
        # first, is not this test's growth: the side stream's cuBLAS workspaces (in the
        # pool) and the side stream's cached blocks for the largest warmup
        primer = autograph.graphed(nn.Linear(8, 8).cuda(), warmup=1)
        for _ in range(3):
            primer(torch.randn(2, 8, device="cuda"))
        assert autograph.stats(primer)["replays"] >= 1
        device = torch.device("cuda", torch.cuda.current_device())
        with capture.backend_for(device).warmup(device):
            model(xs[0])
        torch.cuda.synchronize()
        reserved = torch.cuda.memory_reserved()
        for i, (x, want) in enumerate(zip(xs, expected)):
            torch.testing.assert_close(g(x), want, rtol=1e-3, atol=1e-3)
            if i == 5:  # each key warmed up, then captured; measured before the replays
                # capture their output variants (rotation.py), graphs of their own
                grew = torch.cuda.memory_reserved() - reserved
                assert autograph.stats(g)["captures"] == 3
    s = autograph.stats(g)
    assert s["captures"] == 3 and s["graphs"] == 3 and s["replays"] == 6
    # each graph's working set: two fp32 intermediates of batch x 8192 (58.7 MB in all);
    # sharing one pool, the three graphs take about the largest (33.5 MB), not the sum,
    # while stats() counts what each live graph needs of the pool (footprint.py)
    working_sets = [2 * b * 8192 * 4 for b in (512, 256, 128)]
    assert grew < 0.85 * sum(working_sets)
    assert max(working_sets) <= s["graph_memory_bytes"] <= 1.5 * sum(working_sets)


def test_parameter_replacement_and_data_swap():
    model = mlp(32, 2).cuda().eval()
    g = autograph.graphed(model)

    def check():
        with torch.no_grad():
            for _ in range(4):
                x = torch.randn(2, 32, device="cuda")
                torch.testing.assert_close(g(x), model(x))

    check()
    model[0].weight = nn.Parameter(torch.randn(32, 32, device="cuda"))
    check()
    model[2].weight.data = torch.randn(32, 32, device="cuda")
    check()
    with torch.no_grad():  # in-place: same graph, new values
        model[0].bias.mul_(3)
    check()
    s = autograph.stats(g)
    assert s["invalidations"] == 2 and s["captures"] == 3


def test_dtype_change_and_device_move():
    model = small_decoder(torch.float32)
    g = autograph.graphed(model)

    def run(dtype, n=4):
        cache, ref = model.new_cache(2), model.new_cache(2)
        with torch.no_grad():
            for pos in range(n):
                t = torch.randint(0, 1000, (2, 1), device="cuda")
                p = torch.tensor([pos], device="cuda")
                out = g(t, p, *cache)
                assert out.dtype == dtype
                torch.testing.assert_close(out, model(t, p, *ref), **FP16)

    run(torch.float32)
    g.half()
    run(torch.float16)
    g.cpu()
    g.cuda()
    run(torch.float16)
    assert autograph.stats(g)["invalidations"] >= 2


def test_module_attribute_change_is_seen():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 16)
            self.scale = 1.0

        def forward(self, x):
            return self.fc(x) * self.scale

    m = Scaled().cuda()
    g = autograph.graphed(m)
    x = torch.randn(2, 16, device="cuda")
    with torch.no_grad():
        for _ in range(4):
            g(x)
        m.scale = 4.0
        for _ in range(4):
            torch.testing.assert_close(g(x), m(x))


def test_capture_errors_fall_back_cleanly(caplog):
    caplog.set_level(logging.WARNING, logger="autograph")

    @autograph.graphed(warmup=1)
    def item(x):
        return x * x.sum().item()

    @autograph.graphed(warmup=1)
    def sync(x):
        torch.cuda.synchronize()
        return x + 1

    @autograph.graphed(warmup=1)
    def nonzero(x):
        return x[x > 0].sum()

    @autograph.graphed(warmup=1)
    def from_cpu(x):
        return x + torch.ones(x.shape).to(x.device)

    with torch.no_grad():
        for fn, ref in ((item, lambda x: x * x.sum().item()), (sync, lambda x: x + 1),
                        (nonzero, lambda x: x[x > 0].sum()),
                        (from_cpu, lambda x: x + 1)):
            for _ in range(4):
                x = torch.randn(8, device="cuda")
                torch.testing.assert_close(fn(x), ref(x))
            s = autograph.stats(fn)
            assert s["captures"] == 0, fn
            assert "capture_failed" in s["eager_reasons"], s
            assert not torch.cuda.is_current_stream_capturing()
    assert sum("capture failed" in r.getMessage() for r in caplog.records) == 4
    # random numbers still work (a failed capture can leave the generator capturing)
    torch.manual_seed(1)
    a = torch.randn(4, device="cuda")
    torch.manual_seed(1)
    assert torch.equal(a, torch.randn(4, device="cuda"))
    # the device is healthy and a fresh capture works
    ok = autograph.graphed(lambda x: x * 2, warmup=0)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(4, device="cuda")
            torch.testing.assert_close(ok(x), x * 2)
    assert autograph.stats(ok)["captures"] == 1


def test_hidden_write_is_handed_to_the_caller():
    """A write no operator declares (a raw kernel) lands in the caller's tensor anyway."""

    @autograph.graphed(warmup=0)
    def f(x, y):
        with torch._C._DisableTorchDispatch():
            x.add_(1)
        return x * y

    x, ref = torch.zeros(4, device="cuda"), torch.zeros(4, device="cuda")
    with torch.no_grad():
        for _ in range(5):
            y = torch.randn(4, device="cuda")
            out = f(x, y)
            ref.add_(1)
            torch.testing.assert_close(out, ref * y)
            torch.testing.assert_close(x, ref)
    assert autograph.stats(f)["replays"] >= 2


def test_kill_switch(monkeypatch):
    model = mlp(16, 2).cuda()
    g = autograph.graphed(model)
    x = torch.randn(1, 16, device="cuda")
    with torch.no_grad():
        with autograph.disabled():
            for _ in range(4):
                torch.testing.assert_close(g(x), model(x))
        monkeypatch.setenv("AUTOGRAPH_DISABLE", "1")
        for _ in range(4):
            torch.testing.assert_close(g(x), model(x))
    s = autograph.stats(g)
    assert s["captures"] == 0 and s["eager_reasons"] == {"disabled": 8}


def test_threads_get_correct_separate_outputs():
    model = mlp(64, 3).cuda().eval()
    g = autograph.graphed(model, warmup=1)
    results, errors = [], []

    def worker(tid):
        # inputs from a CPU generator: torch flags the CUDA generator as capturing for
        # the whole process while any thread captures (see README)
        gen = torch.Generator().manual_seed(tid)
        stream = torch.cuda.Stream() if tid % 2 else torch.cuda.current_stream()
        try:
            with torch.no_grad(), torch.cuda.stream(stream):
                for step in range(30):
                    x = torch.randn(1 + (tid + step) % 4, 64, generator=gen).cuda()
                    results.append((x, g(x), stream))
            stream.synchronize()
        except Exception as exc:  # pragma: no cover
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.cuda.synchronize()
    assert not errors
    with torch.no_grad():
        for x, out, _ in results:
            torch.testing.assert_close(out, model(x))
    assert autograph.stats(g)["replays"] > 100


def test_call_on_a_side_stream_is_ordered():
    model = mlp(256, 4).cuda().eval()
    g = autograph.graphed(model)
    s = torch.cuda.Stream()
    with torch.no_grad():
        for _ in range(6):
            with torch.cuda.stream(s):
                x = torch.randn(64, 256, device="cuda")
                out = g(x)
                expect = model(x)
            s.synchronize()
            torch.testing.assert_close(out, expect)


def test_inside_a_users_own_capture_runs_eagerly_into_it():
    model = mlp(16, 2).cuda().eval()
    g = autograph.graphed(model)
    static_x = torch.randn(2, 16, device="cuda")
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            model(static_x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = g(static_x)
        static_x.copy_(torch.randn(2, 16, device="cuda"))
        graph.replay()
        torch.testing.assert_close(static_out, model(static_x))
    assert "capturing" in autograph.stats(g)["eager_reasons"]


def test_cpu_and_mixed_device_inputs_run_eagerly():
    @autograph.graphed(warmup=0)
    def f(x, y):
        return x + y.to(x.device)

    with torch.no_grad():
        a, b = torch.randn(3), torch.randn(3, device="cuda")
        torch.testing.assert_close(f(a, a), a + a)
        torch.testing.assert_close(f(b, a), b + a.cuda())
    reasons = autograph.stats(f)["eager_reasons"]
    assert "several_devices" in reasons
    assert "device" in reasons


def test_autocast_and_inference_mode():
    model = mlp(64, 2).cuda().eval()
    g = autograph.graphed(model)
    for _ in range(4):
        x = torch.randn(8, 64, device="cuda")
        with torch.inference_mode(), torch.autocast("cuda", dtype=torch.float16):
            out = g(x)
            expect = model(x)
        assert out.dtype == torch.float16
        torch.testing.assert_close(out, expect, **FP16)
    assert autograph.stats(g)["replays"] == 1


def test_autocast_blocks_alternating_with_eager_calls_first_keep_their_graphs():
    """Eager calls in an autocast block cache the weights' casts, which the block's end
    frees: a warmup that read them would guard them and drop every graph."""
    model = mlp(64, 2).cuda()
    g = autograph.graphed(model)
    with torch.no_grad():
        for i in range(12):
            x = torch.randn(4, 64, device="cuda")
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bool(i % 2)):
                want = model(x)
                got = g(x)
            assert got.dtype == want.dtype
            torch.testing.assert_close(got, want, **FP16)
    s = autograph.stats(g)
    assert s["invalidations"] == 0 and s["replays"] >= 6, s


def test_another_thread_draws_random_numbers_while_graphs_are_captured():
    """A capture of a call that draws no random numbers leaves the CUDA generator to
    other threads but for the start of the capture: a thread drawing every 0.5 ms saw
    about one failed draw per capture before (71 over 60 captures on the H200), and
    3 or fewer over 30 captures with this.  Each key here also captures an output
    variant at its first replay (rotation.py): 60 captures in all, with 2, 6, 7 and 11
    failed draws in four H200 runs (the start of each capture, about 50 µs, is still a
    window: a count of chance hits, Poisson-like).  The bound, a third of the captures,
    tells that apart from more than one failed draw per capture without the change, and
    does not fail at random.  Their numbers still follow the seed."""
    model = mlp(64, 3).cuda().eval()
    g = autograph.graphed(model, warmup=1)
    stop, failed, drawn = threading.Event(), [0], [0]

    def drawer():
        while not stop.is_set():
            try:
                torch.randn(256, device="cuda")
                drawn[0] += 1
            except RuntimeError:
                failed[0] += 1
            time.sleep(0.0005)

    gen = torch.Generator().manual_seed(0)
    thread = threading.Thread(target=drawer)
    thread.start()
    try:
        with torch.no_grad():
            for n in range(1, 31):  # a new shape each: a capture each
                x = torch.randn(n, 64, generator=gen).cuda()
                for _ in range(3):
                    torch.testing.assert_close(g(x), model(x))
    finally:
        stop.set()
        thread.join()
    s = autograph.stats(g)
    assert s["captures"] == 30 and s["replays"] >= 30, s
    assert drawn[0] > 30 and failed[0] <= 20, (drawn[0], failed[0])
    torch.cuda.manual_seed(3)
    a = torch.randn(8, device="cuda")
    torch.cuda.manual_seed(3)
    assert torch.equal(a, torch.randn(8, device="cuda"))


def test_autograd_runs_eagerly_with_eager_gradients():
    model = mlp(16, 2).cuda()
    g = autograph.graphed(model)
    x = torch.randn(4, 16, device="cuda")
    g(x).sum().backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).sum().backward()
    for a, b in zip(got, model.parameters()):
        torch.testing.assert_close(a, b.grad)
    assert autograph.stats(g)["captures"] == 0


def test_forward_decorated_in_class_per_instance():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        @autograph.graphed
        def forward(self, x):
            return self.fc(x).tanh()

    a, b = Net().cuda(), Net().cuda()
    with torch.no_grad():
        for _ in range(5):
            x = torch.randn(2, 8, device="cuda")
            torch.testing.assert_close(a(x), a.fc(x).tanh())
            torch.testing.assert_close(b(x), b.fc(x).tanh())
    assert autograph.stats(a)["replays"] == 2 and autograph.stats(b)["replays"] == 2


def test_lru_bound():
    g = autograph.graphed(lambda x: x.sin(), warmup=0, max_graphs=3)
    with torch.no_grad():
        for n in range(1, 8):
            x = torch.randn(n, device="cuda")
            torch.testing.assert_close(g(x), x.sin())
    s = autograph.stats(g)
    assert s["graphs"] == 3 and s["evictions"] == 4


def test_failed_capture_leaves_random_numbers_untouched():
    @autograph.graphed(warmup=0)
    def bad(x):
        return x * x.sum().item()

    torch.manual_seed(3)
    expect = torch.randn(8, device="cuda")
    torch.manual_seed(3)
    with torch.no_grad():
        bad(torch.ones(2, device="cuda"))  # a capture that fails
    assert torch.equal(torch.randn(8, device="cuda"), expect)
    drop = autograph.graphed(nn.Dropout(0.5).train(), warmup=1)
    with torch.no_grad():
        outs = [drop(torch.ones(1000, device="cuda")) for _ in range(4)]
    assert autograph.stats(drop)["replays"] == 2
    assert not torch.equal(outs[2], outs[3])  # fresh random numbers on every replay


def test_pool_outlives_graphs_that_die():
    import gc

    for _ in range(3):
        model = mlp(32, 2).cuda().eval()
        g = autograph.graphed(model, warmup=0)
        with torch.no_grad():
            for _ in range(2):
                x = torch.randn(2, 32, device="cuda")
                torch.testing.assert_close(g(x), model(x))
        assert autograph.stats(g)["replays"] == 1
        del g, model
        gc.collect()


def test_out_of_memory_during_capture_falls_back():
    @autograph.graphed(warmup=0)
    def f(x):
        if torch.cuda.is_current_stream_capturing():
            torch.empty(1 << 48, device="cuda")  # far more than any GPU has
        return x + 1

    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(4, device="cuda")
            torch.testing.assert_close(f(x), x + 1)
    reasons = autograph.stats(f)["eager_reasons"]
    details = autograph.stats(f)["eager_details"].get("capture_failed", {})
    assert any("OutOfMemoryError" in d for d in details), reasons
    ok = autograph.graphed(lambda x: x - 1, warmup=0)
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(4, device="cuda")
            torch.testing.assert_close(ok(x), x - 1)
    assert autograph.stats(ok)["replays"] == 1


def test_autocast_block_around_warmup_and_capture_does_not_leave_stale_casts():
    """Under one autocast block, warmup casts the weights into the autocast cache; a
    graph that read those cached casts would read freed memory once the block ends."""
    model = mlp(64, 3).cuda().eval()
    g = autograph.graphed(model)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
        for _ in range(4):
            g(torch.randn(8, 64, device="cuda"))
    torch.cuda.empty_cache()
    junk = [torch.randn(64, 64, device="cuda", dtype=torch.float16) for _ in range(64)]
    with torch.no_grad():
        model[0].weight.mul_(2)  # an in-place update must be seen, too
        for _ in range(3):
            with torch.autocast("cuda", dtype=torch.float16):
                x = torch.randn(8, 64, device="cuda")
                out, expect = g(x), model(x)
            torch.testing.assert_close(out, expect, **FP16)
    assert autograph.stats(g)["replays"] >= 3
    del junk
