"""Graph memory per graph with real CUDA graphs: a graph captured after a larger one
reuses the pool's freed memory (the pool does not grow) and is still counted at what
it needs (footprint.py); max_graph_memory bounds it.  Skipped without CUDA."""

import pytest
import torch

import autograph
from autograph.lookup import _engines_of

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

MB = 2**20


def wide(x):
    h = x.repeat(1, 256)  # 256x the input: the graph's intermediates
    return (h * 2).sum(1)


def test_graph_reusing_pool_memory_is_counted():
    f = autograph.graphed(wide, warmup=1)
    with torch.no_grad():
        f(torch.randn(4096, 64, device="cuda"))  # 256 MiB of intermediates
        f(torch.randn(4096, 64, device="cuda"))
        first = autograph.stats(f)["graph_memory_bytes"]
        reserved = torch.cuda.memory_reserved()
        x = torch.randn(2048, 64, device="cuda")
        for _ in range(2):
            torch.testing.assert_close(f(x), wide(x))
        grew = torch.cuda.memory_reserved() - reserved
        second = autograph.stats(f)["graph_memory_bytes"] - first
    assert grew < 64 * MB  # it reused the first graph's freed memory
    # each intermediate of the second graph is 128 MiB; peak, not the sum of all
    assert 128 * MB <= second <= 3 * 128 * MB + 4 * MB
    assert 256 * MB <= first <= 3 * 256 * MB + 8 * MB
    (engine,) = _engines_of(f)
    assert all(e.graph.footprint > 0 for e in engine.cache.entries.values() if e.graph)


def test_budget_bounds_graphs_that_reuse_the_pool():
    budget = 700 * MB
    f = autograph.graphed(wide, warmup=1, max_graph_memory=budget)
    with torch.no_grad():
        for n in (2048, 2047, 2046, 2045, 2044):  # each graph needs 256+ MiB
            x = torch.randn(n, 64, device="cuda")
            for _ in range(2):
                torch.testing.assert_close(f(x), wide(x))
            assert autograph.stats(f)["graph_memory_bytes"] <= budget
    s = autograph.stats(f)
    assert s["evictions"] >= 2 and 1 <= s["graphs"] <= 2
