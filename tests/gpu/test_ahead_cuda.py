"""warmup() and plans with real CUDA graphs.  Skipped without CUDA."""

import pytest
import torch
from torch import nn

import autograph

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8)).cuda().eval()


def test_warmup_every_bucket_then_traffic_captures_nothing():
    m = model()
    g = autograph.graphed(m, buckets=[1, 2, 4, 8, 16])
    with torch.no_grad():
        report = autograph.warmup(g, torch.randn(3, 32, device="cuda"))
        assert [r["what"] for r in report][0] == "batch 16" and all(r["captured"] for r in report)
        captures = autograph.stats(g)["captures"]
        for n in range(1, 17):
            x = torch.randn(n, 32, device="cuda")
            torch.testing.assert_close(g(x), m(x), rtol=1e-4, atol=1e-4)
    assert autograph.stats(g)["captures"] == captures


def test_plan_round_trip_on_the_gpu(tmp_path):
    m = model()
    g = autograph.graphed(m)
    with torch.no_grad():
        for n in (4, 4, 4, 9, 9, 9):
            g(torch.randn(n, 32, device="cuda"))
    path = tmp_path / "plan.json"
    autograph.save_plan(path)
    autograph.reset(g)
    with torch.no_grad():
        report = autograph.warmup(g, plan=path)
        assert len(report) == 2 and all(r["captured"] for r in report)
        captures = autograph.stats(g)["captures"]
        for n in (4, 9):
            x = torch.randn(n, 32, device="cuda")
            torch.testing.assert_close(g(x), m(x), rtol=1e-4, atol=1e-4)
    assert autograph.stats(g)["captures"] == captures
