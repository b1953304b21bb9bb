"""Buckets and the memory budget with real CUDA graphs.  Skipped without CUDA."""

import pytest
import torch
from torch import nn

import autograph
from autograph.cli.models import Decoder

from ..serving import BUCKETS as SERVE_BUCKETS
from ..serving import DUMMY, SlotDecoder, assert_same_outside_dummy, serve, warm

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

BUCKETS = [1, 2, 4, 8, 16]


def test_padded_replay_equals_eager_on_real_rows_for_every_batch_size():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.LayerNorm(256),
                          nn.Linear(256, 32)).cuda().eval()
    g = autograph.graphed(model, buckets=BUCKETS, warmup=1)
    with torch.no_grad():
        for _ in range(3):
            for n in range(1, 21):
                x = torch.randn(n, 64, device="cuda")
                out = g(x)
                assert out.shape == (n, 32)
                torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-4)
    s = autograph.stats(g)
    assert s["graphs"] == len(BUCKETS) and s["captures"] == len(BUCKETS)
    assert s["bucket_misses"] == 3 * 4  # 17..20, three rounds
    # 48 calls within the buckets: the first one learns the arguments, then each bucket
    # warms up once and captures once; everything else replays
    assert s["padding"] is None and s["replays"] == 48 - 1 - 2 * len(BUCKETS)


def test_buckets_on_a_decode_step_with_an_untouched_cache():
    torch.manual_seed(0)
    model = Decoder(layers=2, d=128, heads=4, vocab=1000, max_len=32).cuda().half().eval()
    # one cache per batch size, as a server keeps per-slot caches; the step's tokens
    # are padded, its caches (written in place) are not
    g = autograph.graphed(model, buckets=[2, 4], warmup=1)
    for n in (1, 3, 2, 4):
        cache, ref = model.new_cache(n), model.new_cache(n)
        with torch.inference_mode():
            for pos in range(4):
                t = torch.randint(0, 1000, (n, 1), device="cuda")
                p = torch.tensor([pos], device="cuda")
                torch.testing.assert_close(g(t, p, *cache), model(t, p, *ref),
                                           rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(cache[0], ref[0], rtol=2e-2, atol=2e-2)
    s = autograph.stats(g)
    # padding a batch of sequences whose cache has no room for the padded rows changes
    # what the step computes: autograph notices and keeps one graph per batch size
    assert s["padding"] is None or s["padding"].startswith("padding off")


def test_memory_budget_holds():
    model = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)).cuda()
    budget = 40 * 2**20
    g = autograph.graphed(model, warmup=0, max_graph_memory=budget)
    with torch.no_grad():
        for n in (64, 128, 256, 512, 1024, 2048, 64, 128):
            x = torch.randn(n, 1024, device="cuda")
            torch.testing.assert_close(g(x), model(x), rtol=1e-3, atol=1e-3)
            assert autograph.stats(g)["graph_memory_bytes"] <= budget
    s = autograph.stats(g)
    assert s["evictions"] >= 1 or any("max_graph_memory" in r for r in s["eager_reasons"])


# -- serving: a slot-based KV cache (issue 16) ---------------------------------------------
def slot_step(**options):
    torch.manual_seed(0)
    model = SlotDecoder(vocab=1000, d=128).cuda().eval()
    return model, autograph.graphed(model, buckets=SERVE_BUCKETS, warmup=1, **options)


SERVING = {"pad_values": {"slot_ids": DUMMY},
           "pad_writes": {"k_cache": (0, DUMMY), "v_cache": (0, DUMMY)}}


def test_slot_cache_serving_loop_one_graph_per_bucket():
    """Continuous batching over a slot cache, called positionally: padded rows write the
    dummy slot only, so padding stays on, one graph per bucket, replays equal eager."""
    model, step = slot_step(**SERVING)
    cache, ref = serve(step, model, model, "cuda", steps=120, atol=1e-4)
    assert_same_outside_dummy(cache, ref)
    s = autograph.stats(step)
    assert s["padding"] is None
    assert s["graphs"] == s["captures"] == len(SERVE_BUCKETS)
    assert s["bucket_misses"] == 0 and s["replays"] >= 120 - 1 - 2 * len(SERVE_BUCKETS)
    assert sum(b["padded_rows"] for b in s["buckets"].values()) > 0


def test_slot_cache_serving_after_warmup_captures_nothing():
    model, step = slot_step(**SERVING)
    cache = warm(step, model, "cuda")
    captured = autograph.stats(step)["captures"]
    assert captured == len(SERVE_BUCKETS)
    cache, ref = serve(step, model, model, "cuda", steps=120, atol=1e-4, cache=cache)
    assert_same_outside_dummy(cache, ref)
    s = autograph.stats(step)
    assert s["captures"] == captured and s["padding"] is None
    assert s["eager"] <= 1 + 2 * len(SERVE_BUCKETS)  # learning, warmup runs; no capture


def test_slot_cache_serving_without_pad_writes_keeps_eager_results():
    model, step = slot_step(pad_values={"slot_ids": DUMMY})
    cache, ref = serve(step, model, model, "cuda", steps=40, atol=1e-4)
    assert_same_outside_dummy(cache, ref)
    assert "k_cache" in autograph.stats(step)["padding"]


def test_routed_calls_on_cuda_equal_eager_and_keep_earlier_results():
    """Once routed (keyed once, the buffers filled, the entry replayed directly), padded
    and exact-size calls equal eager, on the default stream and a side stream, and a
    result already returned is not changed by later calls."""
    from autograph.lookup import handle_of

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32)).cuda().eval()
    g = autograph.graphed(model, buckets=[4, 8], warmup=1)
    side = torch.cuda.Stream()
    with torch.no_grad():
        for n in (7, 8, 3, 4) * 3:
            g(torch.randn(n, 64, device="cuda"))
        assert len(handle_of(g).call.routes.table) == 4
        kept = []
        for i in range(40):
            n = (7, 8, 3, 4, 5)[i % 5]
            x = torch.randn(n, 64, device="cuda")
            if i % 3 == 2:
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    out = g(x)
                torch.cuda.current_stream().wait_stream(side)
            else:
                out = g(x)
            assert out.shape == (n, 32)
            torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-4)
            kept.append((out, model(x)))
        for out, want in kept:
            torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    s = autograph.stats(g)
    assert s["graphs"] == 2 and s["padding"] is None
