"""Recapture without warmup and padded calls with one copy, with real CUDA graphs.
Skipped without CUDA."""

import pytest
import torch
from torch import nn

import autograph
from autograph.cli.models import Decoder
from autograph.lookup import _engines_of

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _counts(g):
    s = autograph.stats(g)
    return s["captures"], s["eager_reasons"].get("warmup", 0), s["invalidations"]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(1000, 256)
        self.lin = nn.Linear(256, 256)

    def forward(self, ids):
        return self.lin(self.emb(ids)).float()


def test_half_and_replaced_parameters_recapture_without_warmup():
    torch.manual_seed(0)
    m = Net().cuda().eval()
    g = autograph.graphed(m, warmup=2)

    def run(tol):
        for _ in range(4):
            ids = torch.randint(0, 1000, (4, 8), device="cuda")
            torch.testing.assert_close(g(ids), m(ids), rtol=tol, atol=tol)

    with torch.no_grad():
        run(1e-4)
        assert _counts(g) == (1, 2, 0)
        m.half()
        run(2e-2)
        assert _counts(g) == (2, 2, 1)  # captured again, no warmup
        m.load_state_dict({k: torch.randn_like(v) for k, v in m.state_dict().items()},
                          assign=True)
        run(2e-2)
        assert _counts(g) == (3, 2, 2)
        m.extra = 1  # an attribute: warms up again
        run(2e-2)
    assert _counts(g) == (4, 4, 3)


def test_decoder_recaptures_without_warmup_after_parameters_move():
    torch.manual_seed(0)
    model = Decoder(layers=2, d=128, heads=4, vocab=1000, max_len=64).cuda().eval()
    step = autograph.graphed(model, warmup=2)
    k, v = model.new_cache(2)
    k2, v2 = k.clone(), v.clone()
    tokens = torch.zeros(2, 1, dtype=torch.long, device="cuda")
    with torch.no_grad():
        for i in range(8):
            if i == 4:
                for p in model.parameters():
                    p.data = p.data.clone()
            pos = torch.tensor([i], device="cuda")
            torch.testing.assert_close(step(tokens, pos, k, v), model(tokens, pos, k2, v2),
                                       rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(k, k2, rtol=1e-4, atol=1e-4)
    assert _counts(step) == (2, 2, 1)


def test_padded_graph_reads_the_bucket_buffers_in_place():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 32)).cuda().eval()
    g = autograph.graphed(model, buckets=[8], warmup=1)
    with torch.no_grad():
        for n in (7, 7, 7, 8, 8, 5, 7, 8):
            x = torch.randn(n, 64, device="cuda")
            keep = x.clone()
            torch.testing.assert_close(g(x), model(x), rtol=1e-4, atol=1e-4)
            assert torch.equal(x, keep)
    (engine,) = _engines_of(g)
    graphs = [e.graph for e in engine.cache.entries.values() if e.graph is not None]
    assert len(graphs) == 1 and graphs[0].static.positions == [] and graphs[0].inplace == (0,)
