"""Two GPUs in one process: graphs on a device other than the current one, one graphed
callable fed from both devices, a module moved between them, a region and side streams
on the second device.  Every output against eager.  Skipped without two GPUs."""

import pytest
import torch

import autograph
from autograph.cli.models import Decoder, mlp

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")

FP16 = {"rtol": 2e-2, "atol": 2e-2}


@pytest.fixture(autouse=True)
def current_is_zero():
    before = torch.cuda.current_device()
    torch.cuda.set_device(0)
    yield
    assert torch.cuda.current_device() == 0, "a call changed the current device"
    torch.cuda.set_device(before)


def small_decoder(device):
    torch.manual_seed(0)
    return Decoder(layers=2, d=128, heads=4, vocab=1000, max_len=64).to(device).half().eval()


def test_a_module_on_the_second_device_while_the_current_is_the_first():
    model = mlp(64, 3).to("cuda:1").eval()
    g = autograph.graphed(model)
    with torch.no_grad():
        for _ in range(10):
            x = torch.randn(4, 64, device="cuda:1")
            out = g(x)
            assert out.device == torch.device("cuda", 1)
            torch.testing.assert_close(out, model(x))
    s = autograph.stats(g)
    assert (s["captures"], s["replays"]) == (1, 7), s
    (entry,) = g._self_engine.cache.entries.values()
    assert entry.graph.device == torch.device("cuda", 1)


def test_a_decode_loop_on_the_second_device_writes_the_callers_cache():
    model = small_decoder("cuda:1")
    g = autograph.graphed(model)
    cache, ref = model.new_cache(2), model.new_cache(2)
    with torch.no_grad():
        for pos in range(16):
            tokens = torch.randint(0, 1000, (2, 1), device="cuda:1")
            p = torch.tensor([pos], device="cuda:1")
            torch.testing.assert_close(g(tokens, p, *cache), model(tokens, p, *ref), **FP16)
    torch.testing.assert_close(cache[0], ref[0], **FP16)
    torch.testing.assert_close(cache[1], ref[1], **FP16)
    assert autograph.stats(g)["replays"] == 13


def test_one_graphed_function_fed_from_both_devices():
    @autograph.graphed
    def f(x, w):
        return torch.tanh(x @ w) + x.sum()

    ws = {d: torch.randn(32, 32, device=d) for d in ("cuda:0", "cuda:1")}
    with torch.no_grad():
        for step in range(12):
            d = ("cuda:0", "cuda:1")[step % 2]
            x = torch.randn(8, 32, device=d)
            out = f(x, ws[d])
            assert out.device == x.device
            torch.testing.assert_close(out, torch.tanh(x @ ws[d]) + x.sum())
    s = autograph.stats(f)
    assert s["captures"] == 2 and s["replays"] == 6, s
    devices = {e.graph.device for e in f._self_dispatch.handle.engine.cache.entries.values()}
    assert devices == {torch.device("cuda", 0), torch.device("cuda", 1)}


def test_a_module_moved_between_devices_is_captured_again_on_the_new_one():
    model = mlp(64, 2).to("cuda:0").eval()
    g = autograph.graphed(model)
    with torch.no_grad():
        for device in ("cuda:0", "cuda:1", "cuda:0"):
            model.to(device)
            for _ in range(6):
                x = torch.randn(4, 64, device=device)
                torch.testing.assert_close(g(x), model(x))
    s = autograph.stats(g)
    assert s["captures"] == 3 and s["invalidations"] == 2 and s["replays"] == 9, s


def test_a_region_under_the_second_device():
    model = small_decoder("cuda:1")
    cache, ref = model.new_cache(2), model.new_cache(2)
    region = autograph.capture_region()
    with torch.inference_mode(), torch.cuda.device(1):
        for pos in range(10):
            t = torch.randint(0, 1000, (2, 1), device="cuda:1")
            p = torch.tensor([pos], device="cuda:1")
            with region:
                out = model(t, p, *cache)
            torch.testing.assert_close(out, model.forward(t, p, *ref), **FP16)
    torch.testing.assert_close(cache[0], ref[0], **FP16)
    (s,) = region.stats().values()
    assert (s["captures"], s["replays"]) == (1, 7), s


def test_side_streams_on_the_second_device():
    model = mlp(64, 3).to("cuda:1").eval()
    g = autograph.graphed(model)
    streams = [torch.cuda.Stream(device=1) for _ in range(2)]
    outs, expect = [], []
    with torch.no_grad():
        for step in range(12):
            x = torch.randn(4, 64, device="cuda:1")
            side = streams[step % 2]
            side.wait_stream(torch.cuda.current_stream(1))
            with torch.cuda.stream(side):
                out = g(x)
                x.record_stream(side)
            torch.cuda.current_stream(1).wait_stream(side)
            outs.append(out)
            expect.append(model(x))
    torch.cuda.synchronize(1)
    for out, ref in zip(outs, expect):
        torch.testing.assert_close(out, ref)
    assert autograph.stats(g)["replays"] == 9
