"""Graph memory per graph: counted even where the pool reuses memory freed by earlier
graphs (footprint.py), and bounded by max_graph_memory."""

import gc
import weakref

import torch
from torch import nn

import autograph
from autograph.footprint import Footprint


def _wide(x):
    return (x.repeat(1, 64) * 2).sum(1)  # an intermediate 64x the input


def test_a_graph_reusing_pool_memory_is_counted(standin):
    standin.share_pool = True
    f = autograph.graphed(_wide, warmup=0)
    with torch.no_grad():
        big, small = torch.randn(64, 16), torch.randn(32, 16)
        f(big)
        first = autograph.stats(f)["graph_memory_bytes"]
        reserved = standin.reserved
        torch.testing.assert_close(f(small), _wide(small))
        assert standin.reserved == reserved  # the pool did not grow for the second graph
        second = autograph.stats(f)["graph_memory_bytes"] - first
    # yet the second graph needs its intermediate (32 x 1024 floats) and its input
    assert second >= 32 * 1024 * 4 + small.numel() * 4
    assert first >= 64 * 1024 * 4


def test_the_footprint_counts_peak_not_sum():
    def chain(x):
        for _ in range(8):
            x = x * 2  # each intermediate dies when the next is made
        return x

    x = torch.randn(256, 64)
    one = x.numel() * 4
    mode = Footprint({x.untyped_storage().data_ptr()}, x.device)
    with torch.no_grad(), mode:
        out = chain(x)
    assert mode.close() == 2 * one and out.shape == x.shape  # two alive at most, 8 made
    views = Footprint(set(), x.device)
    with torch.no_grad(), views:
        y = torch.ones(4, 4)
        z = y[1:].t()  # a view: the same storage, counted once
        del y
    assert views.live == views.peak == 64 and z.shape == (4, 3)
    del z
    assert views.live == 0
    views.close()


def test_a_budget_bounds_graphs_that_reuse_the_pool(standin):
    standin.share_pool = True
    budget = 3 * 32 * 1024 * 4
    f = autograph.graphed(_wide, warmup=0, max_graph_memory=budget)
    with torch.no_grad():
        for n in (32, 31, 30, 29, 28, 27):  # each graph needs about 128 KB
            x = torch.randn(n, 16)
            torch.testing.assert_close(f(x), _wide(x))
            assert autograph.stats(f)["graph_memory_bytes"] <= budget
    s = autograph.stats(f)
    assert s["evictions"] >= 3 and 1 <= s["graphs"] <= 3


def test_freed_graphs_are_not_kept_by_shortcuts(standin):
    """A graph evicted (``max_graphs``) or dropped by ``reset()`` is freed: the key
    memo's shortcut to it held its runner, and with it the graph's buffers, until the
    same tensors keyed again."""

    lin = nn.Linear(16, 16)
    m = autograph.graphed(lin, max_graphs=1)
    held = []
    with torch.no_grad():
        for batch in (2, 3, 4, 5):
            for _ in range(5):
                m(torch.randn(batch, 16))
            held += [weakref.ref(e.graph.static.buffers[0])
                     for e in m._self_engine.cache.entries.values() if e.graph is not None]
    gc.collect()
    assert autograph.stats(m)["evictions"] >= 3
    assert sum(r() is not None for r in held) == 1
    autograph.reset(m)
    gc.collect()
    assert all(r() is None for r in held)
