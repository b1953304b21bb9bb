"""Padded calls copy the real rows once: the bucketer's persistent padded buffers are
captured at their own address (cache.pinned), so a replay copies nothing more.  On the
stand-in a forgotten copy shows as stale rows."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import autograph
from autograph.lookup import _engines_of, handle_of

aten = torch.ops.aten


class Copies(TorchDispatchMode):
    """Counts copies whose source lives in one of ``storages``."""

    def __init__(self, storages):
        super().__init__()
        self.storages, self.count = storages, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten.copy_.default, aten._foreach_copy_.default):
            srcs = args[1] if isinstance(args[1], (list, tuple)) else [args[1]]
            self.count += sum(s.untyped_storage().data_ptr() in self.storages for s in srcs)
        return func(*args, **kwargs)


def _engine(f):
    (engine,) = _engines_of(f)
    return engine


def test_padded_replay_copies_the_real_rows_once(standin):
    @autograph.graphed(buckets=[8], warmup=1)
    def f(x):
        return x * 2 + 1

    with torch.no_grad():
        for _ in range(4):  # fresh values every call: a forgotten copy reads stale rows
            x = torch.randn(7, 16)
            torch.testing.assert_close(f(x), x * 2 + 1)
        (entry,) = [e for e in _engine(f).cache.entries.values() if e.graph is not None]
        assert entry.graph.static.positions == []  # no static input: the buffer in place
        assert entry.graph.inplace == (0,)
        x = torch.randn(7, 16)
        storages = {x.untyped_storage().data_ptr()}
        storages |= {t.untyped_storage().data_ptr() for t in _slot_tensors(f)}
        with Copies(storages) as copies:
            out = f(x)
        torch.testing.assert_close(out, x * 2 + 1)
        assert copies.count == 1  # the real rows into the buffer, and nothing else
    s = autograph.stats(f)
    assert s["graphs"] == 1 and s["replays"] >= 2


def _slot_tensors(f):
    bucketer = handle_of(f).call
    return [t for b in bucketer.slots._buffers.values() for t in b.tensors]


def test_exact_and_padded_calls_share_one_graph_and_callers_stay_untouched(standin):
    @autograph.graphed(buckets=[4, 8], warmup=1)
    def f(x, y):
        return x * y, x + 1

    with torch.no_grad():
        outs = []
        for rows in (8, 7, 8, 5, 7, 8, 6, 8):
            x, y = torch.randn(rows, 6), torch.randn(rows, 6)
            keep = (x.clone(), y.clone())
            got = f(x, y)
            torch.testing.assert_close(got, (x * y, x + 1))
            assert torch.equal(x, keep[0]) and torch.equal(y, keep[1])
            outs.append((got, x * y))
        for got, want in outs:  # a later call never changed an earlier result
            torch.testing.assert_close(got[0], want)
    s = autograph.stats(f)
    assert s["buckets"][8]["hits"] == 7 and s["padding"] is None
    assert s["graphs"] == 1 and s["replays"] >= 4  # one graph: exact and padded calls


def test_written_padded_argument_is_handed_back(standin):
    @autograph.graphed(buckets=[8], warmup=1, batch_dims={"x": 0})
    def f(x):
        x.mul_(3)
        return x.sum(1)

    with torch.no_grad():
        for rows in (7, 7, 7, 8, 7, 6):
            x = torch.randn(rows, 4)
            before = x.clone()
            torch.testing.assert_close(f(x), (before * 3).sum(1))
            torch.testing.assert_close(x, before * 3)  # the write, handed back
    s = autograph.stats(f)
    assert s["replays"] >= 3 and s["padding"] is None


def test_padded_bucket_benchmark_runs_and_reports(standin):
    """The benchmark's padded-bucket rows on the CPU stand-in (timings mean nothing
    here; the rows, their checks against eager and the one graph do)."""
    from autograph.cli.bench_padded import bench_padded, format_padded

    rows = bench_padded(calls=20, rounds=1, device="cpu", width=16)
    assert [r.method for r in rows] == ["eager", "autograph exact (8 rows)",
                                        "autograph padded (7 rows)"]
    assert "graphs 1, padding on" in rows[2].note
    table = format_padded(rows)
    assert "-exact us" in table and "+0.0" in table


def test_bench_lists_the_reuse_method():
    from autograph.cli.peers import _BUILDERS, METHODS

    assert "autograph outputs=reuse" in METHODS and "autograph outputs=reuse" in _BUILDERS
