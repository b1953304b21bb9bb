"""Issue 12: the ways real code uses a graphed callable that a graph can get wrong,
proved on the CPU stand-in (whose replay re-runs only the recorded operators on the
captured tensors, so a stale value or a forgotten alias gives a wrong result).

Every test compares the graphed result with eager on fresh random inputs, checks the
caller's tensors and module state, and, where a graph is possible, that replays
happened; where the call must run eagerly, that it did.  Reason strings are not pinned.
"""

from __future__ import annotations

import argparse
import collections
import copy
import dataclasses
import enum
import functools
import inspect
import logging
import random
import threading
import types
import typing

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.utils import _pytree as pytree

import autograph

from .standin import Tally

pytestmark = pytest.mark.usefixtures("standin")

ORIGINAL_CALL = nn.Module.__call__
CALLS = 8  # default warmup 2: the 3rd call of a key captures, the 4th+ replay


def counts(fn):
    s = autograph.stats(fn)
    assert s["calls"] == s["replays"] + s["captures"] + s["eager"], s
    return s


def replayed(fn):
    s = counts(fn)
    assert s["replays"] > 0, s
    return s


def one(stats):
    (value,) = stats.values()
    return value


# 1. Arguments that alias each other ---------------------------------------------------


def test_mha_self_attention_with_a_fully_padded_row_equals_eager():
    """nn.MultiheadAttention takes another path when query, key and value are one
    tensor; a fully padded row gives NaN in eager, and the graph must agree."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 2, batch_first=True).eval()
    g = autograph.graphed(mha)
    mask = torch.zeros(3, 5, dtype=torch.bool)
    mask[1] = True  # a fully padded row
    mask[0, 3:] = True
    with torch.no_grad():
        for _ in range(CALLS):
            x = torch.randn(3, 5, 16)
            out, _ = g(x, x, x, key_padding_mask=mask, need_weights=False)
            expect, _ = mha(x, x, x, key_padding_mask=mask, need_weights=False)
            torch.testing.assert_close(out, expect, equal_nan=True)
    replayed(g)


def test_mha_self_attention_and_separate_key_value_do_not_share_a_graph():
    """The same shapes with q is k is v and with three distinct tensors: each call
    equals eager whatever the order."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 2, batch_first=True).eval()
    g = autograph.graphed(mha)
    mask = torch.zeros(2, 4, dtype=torch.bool)
    mask[1] = True
    with torch.no_grad():
        for i in range(3 * CALLS):
            x = torch.randn(2, 4, 16)
            if (i // 4) % 2:  # blocks of self-attention, then of distinct tensors
                args = (x, x, x)
            else:
                args = (x, torch.randn(2, 4, 16), torch.randn(2, 4, 16))
            out, _ = g(*args, key_padding_mask=mask, need_weights=False)
            expect, _ = mha(*args, key_padding_mask=mask, need_weights=False)
            torch.testing.assert_close(out, expect, equal_nan=True)
    replayed(g)


def read_write(x, out):
    out.mul_(0.5)
    out.add_(x * 2)  # reads x after out was written: differs when x aliases out
    return out


def test_written_argument_passed_also_as_the_read_argument_after_a_capture():
    g = autograph.graphed(read_write)
    out, ref = torch.randn(6), None
    ref = out.clone()
    with torch.no_grad():
        for _ in range(CALLS):  # captured with distinct tensors
            x = torch.randn(6)
            res = g(x, out)
            read_write(x, ref)
            assert res is out
            torch.testing.assert_close(out, ref)
        for _ in range(4):  # now the same tensor twice
            res = g(out, out)
            read_write(ref, ref)
            assert res is out
            torch.testing.assert_close(out, ref)
    replayed(g)


def test_aliased_read_and_written_arguments_from_the_first_call():
    g = autograph.graphed(read_write)
    out = torch.randn(6)
    ref = out.clone()
    with torch.no_grad():
        for _ in range(CALLS):
            res = g(out, out)
            read_write(ref, ref)
            assert res is out
            torch.testing.assert_close(out, ref)
    counts(g)


def test_overlapping_ranges_of_one_storage():
    """f(buf[:4], buf[2:6]) after captures of f(x, buf[2:6]): the read argument overlaps
    the written one, so it is handled as written or the call runs eagerly."""
    g = autograph.graphed(read_write)
    buf = torch.randn(8)
    ref = buf.clone()
    with torch.no_grad():
        for _ in range(CALLS):
            x = torch.randn(4)
            g(x, buf[2:6])
            read_write(x, ref[2:6])
            torch.testing.assert_close(buf, ref)
        for _ in range(CALLS):
            g(buf[:4], buf[2:6])
            read_write(ref[:4], ref[2:6])
            torch.testing.assert_close(buf, ref)
    replayed(g)


def test_overlapping_ranges_from_the_first_call():
    g = autograph.graphed(read_write)
    buf = torch.randn(8)
    ref = buf.clone()
    with torch.no_grad():
        for _ in range(CALLS):
            g(buf[:4], buf[2:6])
            read_write(ref[:4], ref[2:6])
            torch.testing.assert_close(buf, ref)
    counts(g)


def test_overlapping_memory_through_other_storage_objects_from_the_first_call():
    """f(a, b) with ``a`` and ``b`` numpy-backed slices of one buffer overlapping in
    memory (two storage objects): the read argument saw a stale copy, and the capture
    call wrote that copy back over the caller's memory, undoing the write through
    ``a``.  Both are captured at their addresses now."""
    import numpy as np

    g = autograph.graphed(read_write)
    buf, ref = np.zeros(10, dtype=np.float32), np.zeros(10, dtype=np.float32)
    x, y = torch.from_numpy(buf[3:9]), torch.from_numpy(buf[:6])
    rx, ry = torch.from_numpy(ref[3:9]), torch.from_numpy(ref[:6])
    rng = np.random.default_rng(0)
    with torch.no_grad():
        for _ in range(CALLS):
            buf[:] = ref[:] = rng.standard_normal(10).astype(np.float32)
            out = g(x, y)
            torch.testing.assert_close(out, read_write(rx, ry))
            np.testing.assert_allclose(buf, ref, rtol=1e-6)
    replayed(g)


def test_the_aliasing_pattern_is_part_of_the_key():
    """A Python decision on ``a is b`` is baked into a graph: (x, x) and (x, y) of the
    same shapes must not share one, in either order; read-only aliases may replay."""

    def f(a, b):
        return a * 2 if a is b else a - b

    g = autograph.graphed(f)
    with torch.no_grad():
        for i in range(4 * CALLS):
            x = torch.randn(5)
            y = x if (i // CALLS) % 2 == 0 else torch.randn(5)
            torch.testing.assert_close(g(x, y), f(x, y))
    replayed(g)


def test_same_storage_views_are_part_of_the_key():
    """Two read-only views of one storage against two separate tensors: a function that
    writes into a fresh result through one and reads the other stays exact."""

    def f(a, b):
        return a + b.flip(0)

    g = autograph.graphed(f)
    with torch.no_grad():
        for i in range(3 * CALLS):
            base = torch.randn(10)
            a, b = (base[:5], base[5:]) if i % 2 else (torch.randn(5), torch.randn(5))
            torch.testing.assert_close(g(a, b), f(a, b))
    replayed(g)


# 2. Outputs that are views of arguments ------------------------------------------------

VIEWS = {
    "slice": lambda x: x[1:],
    "transpose": lambda x: x.t(),
    "column": lambda x: x[:, 1],
    "unsqueeze": lambda x: x.unsqueeze(0),
    "diagonal": lambda x: x.diagonal(),
    "narrow-of-transpose": lambda x: x.t()[1:],
}


@pytest.mark.parametrize("view", list(VIEWS))
def test_an_output_view_of_a_strided_argument_is_that_view_of_the_callers_tensor(view):
    fn = VIEWS[view]

    def f(x):
        return fn(x), x * 2

    g = autograph.graphed(f)
    with torch.no_grad():
        for _ in range(CALLS):
            base = torch.randn(4, 8)
            x = base[:, ::2]  # a strided argument
            out, doubled = g(x)
            expect = fn(x)
            torch.testing.assert_close(out, expect)
            torch.testing.assert_close(doubled, x * 2)
            assert out.shape == expect.shape and out.stride() == expect.stride()
            assert out.data_ptr() == expect.data_ptr()
            assert out._base is base
            assert out.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
            out.fill_(7)  # a write through the output reaches the argument
            assert torch.equal(fn(x), torch.full_like(expect, 7))
            assert (base == 7).sum() == expect.numel()
    replayed(g)


def test_an_output_view_of_a_written_strided_argument():
    def f(cache, v):
        cache[:, 0].add_(v)
        return cache[1:], cache.sum()

    g = autograph.graphed(f)
    base = torch.randn(5, 6)
    cache, ref = base[:, ::2], base.clone()[:, ::2]
    with torch.no_grad():
        for _ in range(CALLS):
            v = torch.randn(5)
            out, total = g(cache, v)
            expect, expect_total = f(ref, v)
            torch.testing.assert_close(cache, ref)
            torch.testing.assert_close(out, expect)
            torch.testing.assert_close(total, expect_total)
            assert out.data_ptr() == cache[1:].data_ptr() and out._base is base
    counts(g)


def shared_outputs(x):
    y = x * 2
    return y, y, y[1:], y.t(), x + 1


def test_outputs_sharing_a_storage_share_it_after_a_replay_too():
    """The same tensor twice, a slice and a transpose of it: one copy, those views of
    it (the same object where eager returns the same object), so that a write through
    one shows in the others as in eager mode."""
    g = autograph.graphed(shared_outputs)
    with torch.no_grad():
        for _ in range(CALLS):
            x = torch.randn(3, 3)
            got, expect = g(x), shared_outputs(x)
            torch.testing.assert_close(got, expect)
            a, b, c, d, e = got
            assert a is b and c.data_ptr() == a[1:].data_ptr() and d.data_ptr() == a.data_ptr()
            assert e.data_ptr() != a.data_ptr()
            a.fill_(5)
            assert (c == 5).all() and (d == 5).all() and not (e == 5).all()
    replayed(g)


def test_outputs_sharing_a_storage_under_autograd_are_right():
    """A training graph hands its outputs out through an autograd Function, one clone
    each (views made inside a Function could not be written in place)."""
    class Shared(nn.Linear):
        def forward(self, x):
            return shared_outputs(super().forward(x))

    m = Shared(3, 3)
    g = autograph.graphed(m)
    for _ in range(CALLS):
        x = torch.randn(3, 3)
        got, expect = g(x), m(x)
        torch.testing.assert_close(got, expect)
        sum(t.sum() for t in got).backward()
    s = replayed(g)
    assert s["backward_replays"] + s["backward_eager"] > 0, s


def _as_int(x):
    return x.view(torch.int32)


def _bytes_of_slice(x):
    return x[1:].view(torch.uint8)


def _shared_dtypes(x):
    y = x * 2
    return y[1:], y.view(torch.uint8)[3:9], y.view(torch.int32)


def check_overlapping_outputs_keep_their_layout(device="cpu"):
    """An output whose elements overlap (``expand``, ``unfold``) comes back with eager's
    sizes and strides (a dense clone would be another layout, writable where eager's
    raises), in both output modes."""
    def f(x):
        y = x * 2
        return y.expand(3, 4) if x.shape[0] == 1 else y.unfold(0, 2, 1)

    for outputs in ("clone", "reuse"):
        g = autograph.graphed(f, outputs=outputs)
        for shape in ((1, 4), (6,)):
            with torch.no_grad():
                for _ in range(5):
                    x = torch.randn(*shape, device=device)
                    got, want = g(x), f(x)
                    assert got.shape == want.shape and got.stride() == want.stride()
                    torch.testing.assert_close(got, want)
                    del got
        s = autograph.stats(g)
        assert s["replays"] >= 4, s


def test_overlapping_outputs_keep_their_layout(standin):
    check_overlapping_outputs_keep_their_layout()


def check_arguments_resized_by_the_call(device="cpu"):
    """An argument the call resizes or re-points (``out=`` an empty tensor, ``resize_``)
    runs eagerly (``assigns_attribute``): a graph keeps its captured size and address, so
    a later call's tensor would not be written (the capture raised on its own check)."""
    def f(x, out):
        return torch.mul(x, 2, out=out)

    def g_resize(x, buf):
        buf.resize_(x.shape)
        buf.copy_(x)
        return buf + 1

    for fn in (f, g_resize):
        for warmup in (0, 2):
            g = autograph.graphed(fn, warmup=warmup)
            with torch.no_grad():
                for _ in range(5):
                    x = torch.randn(3, 4, device=device)
                    out, ref = torch.empty(0, device=device), torch.empty(0, device=device)
                    got, want = g(x, out), fn(x, ref)
                    torch.testing.assert_close(got, want)
                    torch.testing.assert_close(out, ref)
            s = autograph.stats(g)
            assert s["eager_reasons"].get("assigns_attribute", 0) >= 3, s


def test_arguments_resized_by_the_call_run_eagerly(standin):
    check_arguments_resized_by_the_call()


def check_conjugate_and_negative_views(device="cpu"):
    """Outputs that are conjugate or negative views (``x.conj()``, ``x.conj().imag``, of
    an argument or of a tensor the call made) keep their values and bits: a view of the
    argument rebuilt without the bit had the imaginary part's sign wrong."""
    fns = [lambda x: x.conj(), lambda x: x.conj()[0], lambda x: x.conj().imag,
           lambda x: (x * 2).conj(), lambda x: (x * 2).conj().imag]
    for fn in fns:
        g = autograph.graphed(fn)
        with torch.no_grad():
            for _ in range(5):
                x = torch.randn(3, dtype=torch.complex64, device=device)
                got, want = g(x), fn(x)
                assert (got.is_conj(), got.is_neg()) == (want.is_conj(), want.is_neg())
                torch.testing.assert_close(got.resolve_conj().resolve_neg(),
                                           want.resolve_conj().resolve_neg())
        assert autograph.stats(g)["replays"] >= 2


def test_conjugate_and_negative_views_keep_their_bits(standin):
    check_conjugate_and_negative_views()


def _matrix_and_adjoint(a):
    y = a @ a
    return y, y.mH


def _conjugate_first(a):
    y = a @ a
    return y.conj(), y


def _with_negative_imaginary(a):
    y = a @ a
    return y, y.conj().imag, y.conj()


def check_shared_outputs_keep_conjugate_and_negative_bits(device="cpu"):
    """Outputs sharing memory where some are conjugate or negative views (``y, y.mH``):
    cloned together, each keeps its bits (they were dropped: the adjoint came back a
    plain transpose, the wrong sign), and writes through one show in the others."""
    for fn in (_matrix_and_adjoint, _conjugate_first, _with_negative_imaginary):
        g = autograph.graphed(fn)
        with torch.no_grad():
            for _ in range(5):
                a = torch.randn(3, 3, dtype=torch.complex64, device=device)
                got, want = g(a), fn(a)
                got[-1].mul_(2)
                want[-1].mul_(2)
                for o, e in zip(got, want):
                    assert (o.is_conj(), o.is_neg()) == (e.is_conj(), e.is_neg()), fn
                    torch.testing.assert_close(o.resolve_conj().resolve_neg(),
                                               e.resolve_conj().resolve_neg())
        assert autograph.stats(g)["replays"] >= 2, fn


def test_shared_outputs_keep_conjugate_and_negative_bits(standin):
    check_shared_outputs_keep_conjugate_and_negative_bits()


def check_written_conjugate_and_negative_views(device="cpu"):
    """An argument written in place, passed now as itself and now as a conjugate or
    negative view of the same memory (same address, strides and dtype): each is its
    own graph, so the write has eager's sign."""

    def accumulate(c, x):
        c.add_(x)
        return c.abs()

    g = autograph.graphed(accumulate)
    c, mine = (torch.zeros(3, dtype=torch.complex64, device=device) for _ in range(2))
    x = torch.full((3,), 1j, dtype=torch.complex64, device=device)
    with torch.no_grad():
        for view in (lambda t: t, lambda t: t.conj(), lambda t: t):
            for _ in range(4):
                torch.testing.assert_close(g(view(c), x), accumulate(view(mine), x))
                torch.testing.assert_close(c, mine)
        r, mine_r = (torch.zeros(3, device=device) for _ in range(2))
        z, mine_z = (torch.zeros(3, dtype=torch.complex64, device=device) for _ in range(2))
        for view in (lambda t: t.imag, lambda t: t.conj().imag):
            for _ in range(4):
                torch.testing.assert_close(g(view(z), r + 1), accumulate(view(mine_z), mine_r + 1))
                torch.testing.assert_close(z, mine_z)
    assert autograph.stats(g)["replays"] >= 6, autograph.stats(g)


def test_written_conjugate_and_negative_views(standin):
    check_written_conjugate_and_negative_views()


def check_a_callable_object_reads_its_attributes(device="cpu"):
    """An instance of a class with ``__call__``, graphed, is graphed as its bound
    ``__call__``: the attributes it reads are guarded (a changed scale or a rebound
    tensor replayed the captured values)."""
    class Scale:
        def __init__(self):
            self.k = 2.0
            self.w = torch.ones(3, device=device)

        def __call__(self, x):
            return x * self.k * self.w

    c = Scale()
    g = autograph.graphed(c)
    with torch.no_grad():
        for i in range(15):
            if i == 5:
                c.k = 5.0
            if i == 10:
                c.w = torch.full((3,), 10.0, device=device)
            x = torch.randn(3, device=device)
            torch.testing.assert_close(g(x), x * c.k * c.w)
    assert autograph.stats(g)["replays"] >= 6


def test_a_callable_object_reads_its_attributes(standin):
    check_a_callable_object_reads_its_attributes()


def check_views_of_parameters_are_new_views_per_call(device="cpu"):
    """An output that is a view of a parameter (``self.pos[:n]``, ``weight.t()``) is a
    new view per call, as in eager mode: a caller's ``unsqueeze_`` on one call's output
    does not reach later calls (the view made at capture was handed out every time);
    the parameter itself, returned, is still the parameter."""
    class PosEmb(nn.Module):
        def __init__(self):
            super().__init__()
            self.pos = nn.Parameter(torch.randn(16, 4))

        def forward(self, x):
            return x + 1, self.pos[: x.shape[0]], self.pos

    m = PosEmb().to(device).eval()
    g = autograph.graphed(m)
    with torch.no_grad():
        for _ in range(6):
            x = torch.randn(3, 4, device=device)
            _, view, itself = g(x)
            want = m.pos[:3]
            assert view.shape == (3, 4), view.shape
            assert (view.requires_grad, view.grad_fn) == (want.requires_grad, None)
            assert itself is m.pos
            torch.testing.assert_close(view, want)
            view.unsqueeze_(0)
    assert autograph.stats(g)["replays"] >= 3


def test_views_of_parameters_are_new_views_per_call(standin):
    check_views_of_parameters_are_new_views_per_call()


class KeepsMaps(nn.Module):
    """Stores each call's attention map in a list it holds (as visualisation code does)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.maps = []

    def forward(self, x):
        a = self.lin(x).softmax(-1)
        self.maps.append(a)
        return a * 2


class FillsOnce(nn.Module):
    """Fills a dict it holds at its first call per shape (a lazy cache)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scales = {}

    def forward(self, x):
        if x.shape not in self.scales:
            self.scales[x.shape] = torch.full((x.shape[-1],), 2.0, device=x.device)
        return self.lin(x) * self.scales[x.shape]


class KeepsNested(nn.Module):
    """Stores into a dict inside an ``OrderedDict`` it holds, and a ``defaultdict``."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.feats = collections.OrderedDict(a={})
        self.log = collections.defaultdict(list)

    def forward(self, x):
        y = self.lin(x)
        self.feats["a"]["last"] = y * 2
        self.log["norms"].append(y.norm())
        return y


def check_lists_and_dicts_a_module_holds(device="cpu"):
    """A forward that changes a list or dict its module holds (``self.maps.append``)
    runs eagerly: a replay would not append, and the map the capture appended was the
    graph's, overwritten by every later replay.  A dict filled once (a lazy cache)
    is learned again and graphed."""
    torch.manual_seed(0)
    m, twin = KeepsMaps().to(device), KeepsMaps().to(device)
    twin.load_state_dict(m.state_dict())
    g = autograph.graphed(m)
    with torch.no_grad():
        for _ in range(6):
            x = torch.randn(2, 4, device=device)
            torch.testing.assert_close(g(x), twin(x))
    assert len(m.maps) == len(twin.maps) == 6
    for got, want in zip(m.maps, twin.maps):
        torch.testing.assert_close(got, want)
    assert autograph.stats(g)["eager_reasons"].get("assigns_attribute", 0) >= 3
    nested, twin = KeepsNested().to(device), KeepsNested().to(device)
    twin.load_state_dict(nested.state_dict())
    g = autograph.graphed(nested)
    with torch.no_grad():
        for _ in range(6):
            x = torch.randn(2, 4, device=device)
            torch.testing.assert_close(g(x), twin(x))
            torch.testing.assert_close(nested.feats["a"]["last"], twin.feats["a"]["last"])
    assert len(nested.log["norms"]) == 6
    lazy = FillsOnce().to(device)
    g = autograph.graphed(lazy)
    with torch.no_grad():
        for _ in range(6):
            x = torch.randn(2, 4, device=device)
            torch.testing.assert_close(g(x), lazy.lin(x) * 2)
    assert autograph.stats(g)["replays"] >= 2, autograph.stats(g)


def test_lists_and_dicts_a_module_holds(standin):
    check_lists_and_dicts_a_module_holds()


SEEN_NORMS: list = []
_MASKS: dict = {}


def _logs_norms(x):
    y = x * 2
    SEEN_NORMS.append(y.norm())
    return y


def _cached_mask(x):
    if x.shape not in _MASKS:  # filled once per shape: a lazy cache
        _MASKS[x.shape] = torch.arange(x.shape[-1], device=x.device) % 2
    return x * _MASKS[x.shape]


def check_lists_and_dicts_named_as_globals_or_cells(device="cpu"):
    """A function that appends to a global list or one in a closure cell runs eagerly
    (a replay would not append; the capture's item would be the graph's tensor); one
    that fills a global dict once (a lazy cache) is learned again and graphed."""
    kept: list = []

    def logs_to_a_cell(x):
        kept.append(x.sum())
        return x + 1

    SEEN_NORMS.clear()
    for fn, log in ((_logs_norms, SEEN_NORMS), (logs_to_a_cell, kept)):
        g = autograph.graphed(fn)
        xs = [torch.randn(3, device=device) for _ in range(6)]
        norms = fn is _logs_norms
        for x in xs:
            torch.testing.assert_close(g(x), x * 2 if norms else x + 1)
        assert len(log) == 6, len(log)
        want = [(x * 2).norm() if norms else x.sum() for x in xs]
        torch.testing.assert_close(torch.stack(log), torch.stack(want))
        s = autograph.stats(g)
        assert s["replays"] == 0 and s["eager_reasons"].get("assigns_attribute"), s
    g = autograph.graphed(_cached_mask)
    for _ in range(6):
        x = torch.randn(2, 4, device=device)
        torch.testing.assert_close(g(x), x * (torch.arange(4, device=device) % 2))
    assert autograph.stats(g)["replays"] >= 2, autograph.stats(g)


def test_lists_and_dicts_named_as_globals_or_cells(standin):
    check_lists_and_dicts_named_as_globals_or_cells()


LOG_CFG = types.SimpleNamespace(items=[])
STATE: dict = {}


class _EventLog:
    items: list = []


def _note(y):
    SEEN_NORMS.append(y.sum())


class _Recorder:
    def __init__(self):
        self.history = []

    def step(self, x):
        self.history.append(x.sum())
        return x * 2


def check_containers_changed_by_every_route_run_eagerly(device="cpu"):
    """A list appended to through a helper function (a global or a closure cell), a
    namespace, a class the code names, a default argument, or the graphed method's
    object (``self.history``) gets
    every call's item (replays dropped them, and the capture's item was the graph's)."""
    def by_helper(x):
        _note(x)
        return x * 2

    def by_namespace(x):
        LOG_CFG.items.append(x.sum())
        return x * 2

    def by_class(x):
        _EventLog.items.append(x.sum())
        return x * 2

    def by_default(x, acc=[]):  # noqa: B006 - the pattern under test
        acc.append(x.sum())
        return x * 2

    def log_in_cell(y):
        cell_log.append(y.sum())

    cell_log = []

    def by_helper_in_cell(x):  # the helper is a closure cell, as is its list
        log_in_cell(x)
        return x * 2

    recorder = _Recorder()
    logs = {by_helper: SEEN_NORMS, by_namespace: LOG_CFG.items, by_class: _EventLog.items,
            by_default: by_default.__defaults__[0], recorder.step: recorder.history,
            by_helper_in_cell: cell_log}
    for fn, log in logs.items():
        log.clear()
        g = autograph.graphed(fn)
        xs = [torch.randn(3, device=device) for _ in range(6)]
        for x in xs:
            torch.testing.assert_close(g(x), x * 2)
        torch.testing.assert_close(torch.stack(log), torch.stack([x.sum() for x in xs]))
        assert autograph.stats(g)["replays"] == 0, (fn, autograph.stats(g))



def test_containers_changed_by_every_route_run_eagerly(standin):
    check_containers_changed_by_every_route_run_eagerly()


class _Layer:
    def __init__(self, k, v):
        self.keys, self.values, self.ready = k, v, True


class _Memory:
    """A cache object the call makes (as transformers' DynamicCache): not a pytree."""

    def __init__(self, layers):
        self.layers = layers
        self.seen = {"tokens": layers[0].keys.shape[0]}


class _Slotted:
    __slots__ = ("state", "step")

    def __init__(self, state):
        self.state, self.step = state, 1


class _HoldsModule:
    def __init__(self, m, y):
        self.m, self.y = m, y


def check_objects_the_call_returns(device="cpu"):
    """An object the call makes and returns (a transformers ``DynamicCache``, a user's
    cache or state class, with slots or a dict) is made again per call around clones
    of the graph's tensors: same type, attributes and identities inside (one layer
    listed twice stays one), never overwritten later; such calls ran eagerly.  What
    existed before the call (a module) is returned as itself; an object holding what
    cannot be made again (a lock) runs eagerly."""
    torch.manual_seed(0)
    w = torch.randn(4, 4, device=device)

    def step(x):
        k, v = x @ w, (x * 2).relu()
        first = _Layer(k, v)
        return x.sum(), _Memory([first, _Layer(v, k), first]), _Slotted((k + 1, [v]))

    g = autograph.graphed(step)
    kept = []
    with torch.no_grad():
        for _ in range(6):
            x = torch.randn(3, 4, device=device)
            total, mem, slotted = g(x)
            want = step(x)
            torch.testing.assert_close(total, want[0])
            assert type(mem) is _Memory and mem.layers[0] is mem.layers[2]
            assert mem.seen == {"tokens": 3} and mem.layers[1].ready is True
            torch.testing.assert_close(mem.layers[1].keys, want[1].layers[1].keys)
            torch.testing.assert_close(slotted.state[1][0], want[2].state[1][0])
            assert slotted.step == 1 and type(slotted) is _Slotted
            kept.append((mem.layers[0].keys, want[1].layers[0].keys))
    for got, expect in kept:
        torch.testing.assert_close(got, expect)
    assert autograph.stats(g)["replays"] >= 3, autograph.stats(g)
    lin = nn.Linear(4, 4).to(device)
    h = autograph.graphed(lambda x: _HoldsModule(lin, lin(x)))
    with torch.no_grad():
        for _ in range(5):
            x = torch.randn(3, 4, device=device)
            got = h(x)
            torch.testing.assert_close(got.y, lin(x))
            assert got.m is lin  # made before the call: itself, as eager returns it
    assert autograph.stats(h)["replays"] >= 2
    lock = threading.Lock()  # made by the call and held: no replay can make it again
    k = autograph.graphed(lambda x: _HoldsModule(threading.Lock(), x * 2))
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(3, 4, device=device)
            torch.testing.assert_close(k(x).y, x * 2)
    assert autograph.stats(k)["replays"] == 0 and lock is not None


def test_objects_the_call_returns(standin):
    check_objects_the_call_returns()


class _Vocab:
    def __init__(self):
        self.labels = ["neg", "pos"]


class _Pred:
    def __init__(self, logits, vocab):
        self.logits, self.vocab = logits, vocab


class _WithTable(nn.Module):
    """Holds a large table of plain values (a tokenizer's merges) and a vocabulary
    object that its forward returns inside a new object."""

    def __init__(self, n, kind=tuple):
        super().__init__()
        self.vocab = _Vocab()
        self.lin = nn.Linear(4, 2)
        self.merges = [kind((f"a{i}", f"b{i}")) for i in range(n)]

    def forward(self, x):
        return _Pred(self.lin(x), self.vocab)


def check_objects_past_the_walk_limit_are_not_copied(device="cpu"):
    """A returned object holding an object that existed before the call is that very
    object, also where the modules hold more values than the walk that finds such
    objects reads (``returned.MAX_NODES``): past it, replays handed back a copy made
    at capture (its contents stale).  Now such a call runs eagerly; pairs of constants
    (a merges table) are not walked into, so a table of them keeps the graphs."""
    for n, kind in ((10, list), (20_000, tuple), (20_000, list)):
        m = _WithTable(n, kind).to(device)
        g = autograph.graphed(m)
        with torch.no_grad():
            for i in range(5):
                m.vocab.labels[1] = f"pos{i}"
                x = torch.randn(3, 4, device=device)
                got = g(x)
                assert got.vocab is m.vocab, (n, i)
                torch.testing.assert_close(got.logits, m.lin(x))
        s = autograph.stats(g)
        assert s["replays"] >= 2 if n == 10 or kind is tuple else s["replays"] == 0, (n, s)


def test_objects_past_the_walk_limit_are_not_copied(standin):
    check_objects_past_the_walk_limit_are_not_copied()


def check_transformed_distributions_are_returned_by_replays(device="cpu"):
    """A policy returning a ``TransformedDistribution`` (SAC's tanh-squashed Normal)
    ran eagerly for good: a transform's ``__getstate__``, which only drops the weak
    reference to its inverse, counted as a copy protocol of its own.  Each replay
    returns new distribution and transform objects; samples (drawn from the same seed)
    and log-probabilities equal eager's, with gradients under grad mode."""
    import torch.distributions as D

    torch.manual_seed(0)
    lin = nn.Linear(3, 4).to(device)

    def policy(s):
        mu, log_std = lin(s).chunk(2, -1)
        base = D.Normal(mu, log_std.exp(), validate_args=False)
        return D.TransformedDistribution(base, [D.TanhTransform(cache_size=1)],
                                         validate_args=False)

    g = autograph.graphed(policy)
    seen = []
    for grad in (False, True):
        for _ in range(5):
            s = torch.randn(5, 3, device=device)
            with torch.set_grad_enabled(grad):
                torch.manual_seed(1)
                got = g(s)
                a = got.rsample()
                lp = got.log_prob(a).sum()
                with autograph.disabled():
                    torch.manual_seed(1)
                    want = policy(s)
                    b = want.rsample()
                    lq = want.log_prob(b).sum()
            torch.testing.assert_close(a, b)
            torch.testing.assert_close(lp, lq)
            assert type(got.transforms[0]) is D.TanhTransform
            seen.append(got.transforms[0])
            if grad:
                gl, = torch.autograd.grad(lp, lin.weight)
                gw, = torch.autograd.grad(lq, lin.weight)
                torch.testing.assert_close(gl, gw)
    assert len({id(t) for t in seen}) == len(seen)
    assert autograph.stats(g)["replays"] >= 4, autograph.stats(g)
    # a transform the module holds, whose cache the call sets (``rsample``): a replay
    # would leave the capture's cache there, and a log_prob outside would miss it
    squash = D.TanhTransform(cache_size=1)
    holder = nn.Module()
    holder.lin, holder.squash = lin, squash

    def sample(s):
        mu, log_std = holder.lin(s).chunk(2, -1)
        d = D.TransformedDistribution(D.Normal(mu * 20, log_std.exp(), validate_args=False),
                                      [holder.squash], validate_args=False)
        return d, d.rsample()

    h = autograph.graphed(sample)
    with torch.no_grad():
        for _ in range(5):
            s = torch.randn(5, 3, device=device)
            torch.manual_seed(2)
            d, a = h(s)
            lp = d.log_prob(a)
            torch.manual_seed(2)
            with autograph.disabled():
                e, b = sample(s)
                lq = e.log_prob(b)
            torch.testing.assert_close(a, b)
            torch.testing.assert_close(lp, lq)


def test_transformed_distributions_are_returned_by_replays(standin):
    check_transformed_distributions_are_returned_by_replays()


class _Out:
    def __init__(self, d, top):
        self.d, self.top = d, top


def check_objects_holding_ordered_dicts_and_return_types(device="cpu"):
    """A returned object holding an ``OrderedDict`` or a ``torch.return_types`` tuple
    (``x.topk(2)``), both pytree containers, ran eagerly for good ("made otherwise").
    Each replay makes them again, of their own types, equal to eager's."""
    w = torch.randn(4, 4, device=device)

    def f(x):
        y = x @ w
        return _Out(collections.OrderedDict(a=y * 2, b=[y + 1]), y.topk(2))

    g = autograph.graphed(f)
    with torch.no_grad():
        for _ in range(5):
            x = torch.randn(3, 4, device=device)
            got, want = g(x), f(x)
            assert type(got.d) is collections.OrderedDict and list(got.d) == ["a", "b"]
            assert type(got.top) is type(want.top)
            torch.testing.assert_close(got.d["b"][0], want.d["b"][0])
            torch.testing.assert_close(got.top.values, want.top.values)
            assert torch.equal(got.top.indices, want.top.indices)
    assert autograph.stats(g)["replays"] >= 2, autograph.stats(g)
    import time

    h = autograph.graphed(lambda x: _Out(time.gmtime(0), x * 2))  # hidden fields: eager
    with torch.no_grad():
        for _ in range(4):
            got = h(torch.randn(3, device=device))
            assert got.d.tm_zone == time.gmtime(0).tm_zone and got.d == time.gmtime(0)


def test_objects_holding_ordered_dicts_and_return_types(standin):
    check_objects_holding_ordered_dicts_and_return_types()


class _HoldsWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return _HoldsModule(self.lin.weight, self.lin(x))


def check_verified_objects_holding_parameters(device="cpu"):
    """``verify_every`` compared a returned object holding a parameter as one opaque
    value (two objects: never equal), so every such key failed its verification and
    ran eagerly for good.  Objects are compared by their tensors, parameters too."""
    m = _HoldsWeight().to(device)
    g = autograph.graphed(m, verify_every=1)
    with torch.no_grad():
        for _ in range(6):
            x = torch.randn(2, 4, device=device)
            got = g(x)
            assert got.m is m.lin.weight
            torch.testing.assert_close(got.y, m.lin(x))
    s = autograph.stats(g)
    assert s["replays"] >= 3 and s["verify_failures"] == 0 and s["verifications"] >= 3, s


def test_verified_objects_holding_parameters(standin):
    check_verified_objects_holding_parameters()


class _Private:
    __slots__ = ("__state", "out")  # stored as _Private__state

    def __init__(self, state, out):
        self.__state, self.out = state, out

    @property
    def state(self):
        return self.__state


class _Kind(enum.Enum):
    SCORE = 1


class _Vocab:
    def __init__(self):
        self.labels = ["neg", "pos"]


class _Prediction:
    def __init__(self, logits, vocab, weight):
        self.logits, self.vocab, self.weight, self.kind = logits, vocab, weight, _Kind.SCORE


class _Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.vocab = _Vocab()

    def forward(self, x):
        h = self.lin(x)
        pred = _Prediction(h, self.vocab, self.lin.weight)
        return {"pred": pred, "again": [pred, pred], "private": _Private(h.tanh(), h)}


def check_returned_objects_keep_identities(device="cpu"):
    """Returned objects: one object returned in several places is one object per call;
    what existed before the call (the module's vocabulary, a parameter) is itself, so a
    later change to it shows; private slots, enums inside are kept."""
    torch.manual_seed(0)
    m = _Classifier().to(device).eval()
    g = autograph.graphed(m)
    with torch.no_grad():
        for step in range(6):
            if step == 4:
                m.vocab.labels[1] = "positive"
            x = torch.randn(3, 4, device=device)
            out = g(x)
            pred = out["pred"]
            assert pred is out["again"][0] is out["again"][1]
            assert pred.vocab is m.vocab and pred.weight is m.lin.weight
            assert pred.kind is _Kind.SCORE and pred.vocab.labels[1] == m.vocab.labels[1]
            torch.testing.assert_close(pred.logits, m.lin(x))
            torch.testing.assert_close(out["private"].state, m.lin(x).tanh())
    assert autograph.stats(g)["replays"] >= 3, autograph.stats(g)


def test_returned_objects_keep_identities(standin):
    check_returned_objects_keep_identities()


def check_returned_attribute_tensors_are_themselves(device="cpu"):
    """A tensor returned from a module's plain attribute (no parameter or buffer), or
    from a plain object the call reads and writes, is that tensor, as eager returns it
    (it came back as a copy: writes through it were lost, a held one went stale)."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.table = torch.zeros(3)

        def forward(self, x):
            return self.lin(x), self.table

    class Acc:
        def __init__(self):
            self.acc = torch.zeros(3, device=device)

    m = M().to(device)
    m.table = m.table.to(device)
    g = autograph.graphed(m)
    acc = Acc()

    def bump(x):
        acc.acc.add_(x.sum())
        return acc.acc

    gb = autograph.graphed(bump)
    held = []
    with torch.no_grad():
        for _ in range(5):
            _, table = g(torch.randn(2, 3, device=device))
            assert table is m.table
            table.add_(1)
            held.append(gb(torch.ones(1, device=device)))
    assert torch.equal(m.table, torch.full((3,), 5.0, device=device))
    assert all(h is acc.acc for h in held) and float(acc.acc[0]) == 5.0
    assert autograph.stats(g)["replays"] >= 2 and autograph.stats(gb)["replays"] >= 2


def test_returned_attribute_tensors_are_themselves(standin):
    check_returned_attribute_tensors_are_themselves()


def check_outputs_viewing_bytes_as_another_dtype(device="cpu"):
    """Outputs that read an argument's or another output's bytes as another dtype
    (``x.view(torch.int32)``, ``torch.view_as_real``): eager's dtype, values and
    sharing, on replays too (shared with tests/gpu)."""
    for f, dtype in ((_as_int, torch.float32), (_bytes_of_slice, torch.float32),
                     (torch.view_as_real, torch.complex64), (_shared_dtypes, torch.float32)):
        g = autograph.graphed(f)
        with torch.no_grad():
            for _ in range(CALLS):
                x = torch.randn(4, dtype=dtype, device=device)
                got, expect = g(x), f(x)
                got = got if isinstance(got, tuple) else (got,)
                expect = expect if isinstance(expect, tuple) else (expect,)
                for a, b in zip(got, expect):
                    assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
                got[0].add_(1)  # a write through one shows in the others, as in eager
                expect[0].add_(1)
                for a, b in zip(got, expect):
                    assert torch.equal(a, b), f
        replayed(g)


def test_outputs_viewing_bytes_as_another_dtype():
    check_outputs_viewing_bytes_as_another_dtype()


def _real_of(z):
    return z.real


def _imag_of(z):
    return z.imag * 1, z.imag


def check_real_views_of_strided_complex_arguments(device="cpu"):
    """``z.real``, ``z.imag`` or ``torch.view_as_real(z)`` of a complex argument whose
    last dimension is not contiguous (``z.t()``, ``z[:, ::2]``) returned: it ran
    eagerly every call (the argument has no ``view(float32)``); it replays, a view of
    the caller's argument as in eager."""
    for f in (_real_of, _imag_of, torch.view_as_real):
        for shape, part in (((4, 3), lambda b: b.t()), ((3, 6), lambda b: b[:, ::2])):
            g = autograph.graphed(f)
            with torch.no_grad():
                for _ in range(CALLS):
                    base = torch.randn(shape, dtype=torch.complex64, device=device)
                    twin = base.clone()
                    got, want = g(part(base)), f(part(twin))
                    got = got if isinstance(got, tuple) else (got,)
                    want = want if isinstance(want, tuple) else (want,)
                    for a, b in zip(got, want):
                        assert a.stride() == b.stride() and torch.equal(a, b)
                    got[-1].add_(1)  # writes the caller's argument, as in eager
                    want[-1].add_(1)
                    assert torch.equal(base, twin)
            replayed(g)


def test_real_views_of_strided_complex_arguments(standin):
    check_real_views_of_strided_complex_arguments()


def check_output_building_failure_writes_once(device="cpu"):
    """A call that writes an argument and returns its input's bytes: the output is
    rebuilt as eager's (it once failed after the replay, and the eager run that
    followed wrote the argument a second time; shared with tests/gpu)."""
    def f(x, counter):
        counter.add_(1)
        return x.view(torch.uint8)

    g = autograph.graphed(f)
    counter, expect = torch.zeros(1, device=device), torch.zeros(1, device=device)
    with torch.no_grad():
        for _ in range(CALLS):
            x = torch.randn(3, device=device)
            assert torch.equal(g(x, counter), f(x, expect))
            torch.testing.assert_close(counter, expect)
    replayed(g)


def test_a_call_writing_an_argument_and_returning_its_bytes_writes_once():
    check_output_building_failure_writes_once()

class SizeHead(nn.Linear):
    """A linear layer that also returns shapes: a torch.Size, alone and in a dict."""

    def forward(self, x):
        y = super().forward(x)
        return x.shape, y, {"shape": y.shape[1:], "n": y.shape.numel()}


def check_size_outputs_stay_sizes(device="cpu"):
    """A returned torch.Size comes back a torch.Size equal to eager's (pytree rebuilds
    it as a plain tuple) from the replays of inference and training graphs and from
    bucketed calls, padded or not (shared with tests/gpu)."""
    torch.manual_seed(0)
    m = SizeHead(4, 3).to(device)
    plain, trained = autograph.graphed(copy.deepcopy(m)), autograph.graphed(copy.deepcopy(m))
    padded = autograph.graphed(copy.deepcopy(m), buckets=[8])

    def widths(x):
        return x * 2, x.shape[1:]

    bucketed = autograph.graphed(widths, buckets=[8])

    def same(got, expect):
        assert type(got[0]) is torch.Size and type(got[-1]) is type(expect[-1]), got
        if isinstance(got[-1], dict):
            assert type(got[-1]["shape"]) is torch.Size, got
        assert got[0] == expect[0] and got[-1] == expect[-1]
        torch.testing.assert_close(got[1], expect[1])

    for n in [3] * CALLS + [5, 7, 6] * 3:
        x = torch.randn(n, 4, device=device)
        with torch.no_grad():
            if n == 3:
                same(plain(x), m(x))
            same(padded(x), m(x))
            got, width = bucketed(x)
            assert type(width) is torch.Size and width == (4,)
            torch.testing.assert_close(got, x * 2)
        if n == 3:  # autograd records: a training graph
            got, expect = trained(x), m(x)
            same(got, expect)
            got[1].sum().backward()
            expect[1].sum().backward()
    torch.testing.assert_close(trained.weight.grad, m.weight.grad)
    assert counts(trained)["backward_replays"] > 0
    # gradients differentiated again: the forward runs again, its outputs read as the
    # graph's (a Size one leaf), then the key runs eagerly
    x, replays = torch.randn(3, 4, device=device), counts(trained)["replays"]
    grads = [torch.autograd.grad(out[1].square().sum(), w, create_graph=True)[0]
             for out, w in ((trained(x), trained.weight), (m(x), m.weight))]
    torch.testing.assert_close(*grads)
    assert counts(trained)["replays"] == replays + 1
    for g in (plain, trained, padded, bucketed):
        replayed(g)
    assert counts(bucketed)["padding"] is None  # a width: padding stays on


def test_a_returned_torch_size_stays_a_torch_size():
    check_size_outputs_stay_sizes()


# 3. Exceptions ----------------------------------------------------------------------


def test_an_exception_on_the_capturing_call_propagates_once_and_the_body_runs_once():
    runs = Tally()

    def f(x):
        if runs.tick() == 3:  # the call that captures
            raise ValueError("third call")
        return x * 2 + 1

    g = autograph.graphed(f)
    with torch.no_grad():
        for i in range(2):
            x = torch.randn(4)
            torch.testing.assert_close(g(x), x * 2 + 1)
            assert runs.n == i + 1
        with pytest.raises(ValueError, match="third call"):
            g(torch.randn(4))
        assert runs.n == 3
        for _ in range(CALLS):
            x = torch.randn(4)
            torch.testing.assert_close(g(x), x * 2 + 1)
    replayed(g)


@pytest.mark.parametrize("failing", [1, 2])
def test_an_exception_in_a_warmup_call_propagates_once(failing):
    runs = Tally()

    def f(x):
        if runs.tick() == failing:
            raise ValueError("warmup")
        return x.exp()

    g = autograph.graphed(f)
    with torch.no_grad():
        for call in range(1, 3 + CALLS):
            x = torch.randn(4)
            before = runs.n
            if call == failing:
                with pytest.raises(ValueError, match="warmup"):
                    g(x)
            else:
                torch.testing.assert_close(g(x), x.exp())
            if call <= 4:  # warmups and the capture: the body ran exactly once
                assert runs.n == before + 1, (call, runs.n)
    replayed(g)


FAIL = {"on": False}
RUNS = {}  # per Flaky module: how many times its forward's Python ran


class Flaky(nn.Module):
    """Raises while a global flag says so.  (Its count lives outside the module: a
    module's own list changed by the forward makes its calls eager.)"""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        RUNS[id(self)] = Tally()

    @property
    def runs(self):
        return RUNS[id(self)]

    def forward(self, x):
        RUNS[id(self)].tick()
        if FAIL["on"]:
            raise ValueError("flag")
        return self.fc(x)


@pytest.mark.parametrize("style", ["wrapper", "region"])
def test_a_module_raising_on_the_capturing_call(style):
    torch.manual_seed(0)
    m = Flaky().eval()
    g = autograph.graphed(m) if style == "wrapper" else m
    region = autograph.capture_region()

    def call(x):
        if style == "region":
            with region:
                return g(x)
        return g(x)

    try:
        with torch.no_grad():
            for i in range(2):
                x = torch.randn(3, 4)
                torch.testing.assert_close(call(x), m.fc(x))
                assert m.runs.n == i + 1
            FAIL["on"] = True
            with pytest.raises(ValueError, match="flag"):
                call(torch.randn(3, 4))
            assert m.runs.n == 3
            FAIL["on"] = False
            for _ in range(CALLS):
                x = torch.randn(3, 4)
                torch.testing.assert_close(call(x), m.fc(x))
    finally:
        FAIL["on"] = False
    assert nn.Module.__call__ is ORIGINAL_CALL
    replayed(g if style == "wrapper" else m)


# 4. Buckets -----------------------------------------------------------------------------


def test_buckets_a_later_call_writing_another_argument_updates_the_callers_tensor():
    def f(x, a, b, which):
        (a if which else b).add_(x)
        return x * 2

    g = autograph.graphed(f, buckets=[2, 4, 8])
    a, b = torch.randn(3, 5), torch.randn(3, 5)
    ra, rb = a.clone(), b.clone()
    with torch.no_grad():
        for which in (True, False, True, False):
            for _ in range(CALLS):
                x = torch.randn(3, 5)
                out = g(x, a, b, which)
                expect = f(x, ra, rb, which)
                torch.testing.assert_close(out, expect)
                assert out.shape == (3, 5)
                torch.testing.assert_close(a, ra)
                torch.testing.assert_close(b, rb)
    replayed(g)


MIX = False


class Centre(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 5)
        self.mix = False

    def forward(self, x):
        x = self.fc(x)
        return x - x.mean(0) if self.mix else x * 2


def centre(x):
    return x - x.mean(0) if MIX else x * 2


@pytest.mark.parametrize("switch", ["argument", "attribute", "global"])
def test_buckets_a_flag_that_switches_on_a_row_mixing_path_later(switch):
    """Batch 3 padded to 4: with mix=False the rows do not interact; when the flag turns
    the mixing path on later, padded rows must not enter the mean."""
    global MIX
    torch.manual_seed(0)
    if switch == "argument":
        def f(x, mix):
            return x - x.mean(0) if mix else x * 2

        g = autograph.graphed(f, buckets=[2, 4, 8])

        def call(fn, x, mix):
            return fn(x, mix)
    elif switch == "attribute":
        m = Centre().eval()
        g = autograph.graphed(m, buckets=[2, 4, 8])
        f = m

        def call(fn, x, mix):
            m.mix = mix
            return fn(x)
    else:
        g = autograph.graphed(centre, buckets=[2, 4, 8])
        f = centre

        def call(fn, x, mix):
            global MIX
            MIX = mix
            return fn(x)
    try:
        with torch.no_grad():
            for mix in (False, True, False, True):
                for _ in range(CALLS):
                    x = torch.randn(3, 5)
                    out = call(g, x, mix)
                    expect = call(f, x, mix)
                    torch.testing.assert_close(out, expect)
    finally:
        MIX = False
    counts(g)


# 5. Tensors read from outside the arguments, parameters and buffers --------------------


class Symmetric(nn.Module):
    def forward(self, w):
        return w.triu() + w.triu(1).transpose(-1, -2)


def parametrized_linear():
    torch.manual_seed(0)
    layer = nn.Linear(6, 6).eval()
    parametrize.register_parametrization(layer, "weight", Symmetric())
    return layer


def test_parametrization_without_cache_sees_weight_updates():
    layer = parametrized_linear()
    g = autograph.graphed(layer)
    with torch.no_grad():
        for step in range(3 * CALLS):
            if step % CALLS == CALLS - 1:
                layer.parametrizations.weight.original.mul_(2)
            x = torch.randn(2, 6)
            torch.testing.assert_close(g(x), layer(x))
    replayed(g)


@pytest.mark.parametrize("update", ["in-place", "new-data"])
def test_parametrize_cached_then_a_weight_update_after_the_block(update):
    if update == "in-place":
        pytest.skip(STANDIN_KEEPS)
    layer = parametrized_linear()
    g = autograph.graphed(layer)
    with torch.no_grad():
        with parametrize.cached():
            for _ in range(CALLS):
                x = torch.randn(2, 6)
                torch.testing.assert_close(g(x), layer(x))
        original = layer.parametrizations.weight.original
        if update == "in-place":
            original.mul_(2)
        else:
            original.data = torch.randn_like(original)
        for _ in range(CALLS):
            x = torch.randn(2, 6)
            torch.testing.assert_close(g(x), layer(x))
        with parametrize.cached():  # a new cache: a new weight tensor
            for _ in range(CALLS):
                x = torch.randn(2, 6)
                torch.testing.assert_close(g(x), layer(x))
        original.mul_(-1)
        for _ in range(CALLS):
            x = torch.randn(2, 6)
            torch.testing.assert_close(g(x), layer(x))
    counts(g)


G = torch.randn(6)
STANDIN_KEEPS = ("the CPU stand-in's recorded graph holds the tensors it read, so a swapped "
                 "tensor never dies there; tests/gpu/test_usage_cuda.py covers it")


def scale_by_global(x):
    return x * G


class ByGlobal(nn.Module):
    def forward(self, x):
        return x * G + 1


@pytest.mark.parametrize("style", ["function", "module"])
def test_a_global_tensor_replaced_by_another_of_the_same_shape(style):
    global G
    saved = G
    fn = scale_by_global if style == "function" else ByGlobal()
    g = autograph.graphed(fn)
    try:
        with torch.no_grad():
            for _ in range(3):
                for _ in range(CALLS):
                    x = torch.randn(6)
                    torch.testing.assert_close(g(x), fn(x))
                G = torch.randn(6)  # a new object, same shape, dtype and device
    finally:
        G = saved
    replayed(g)


def test_a_tensor_in_an_attribute_of_a_plain_object_swapped_between_calls():
    pytest.skip(STANDIN_KEEPS)

    cfg = types.SimpleNamespace(scale_tensor=torch.randn(6))

    def f(x):
        return x * cfg.scale_tensor

    g = autograph.graphed(f)
    with torch.no_grad():
        for _ in range(3):
            for _ in range(CALLS):
                x = torch.randn(6)
                torch.testing.assert_close(g(x), f(x))
            cfg.scale_tensor = torch.randn(6)
    counts(g)


def test_a_tensor_attribute_of_a_config_object_held_by_a_module():
    pytest.skip(STANDIN_KEEPS)

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(6, 6)
            self.config = types.SimpleNamespace(scale_tensor=torch.randn(6))

        def forward(self, x):
            return self.fc(x) * self.config.scale_tensor

    torch.manual_seed(0)
    m = Scaled().eval()
    g = autograph.graphed(m)
    with torch.no_grad():
        for _ in range(3):
            for _ in range(CALLS):
                x = torch.randn(2, 6)
                torch.testing.assert_close(g(x), m(x))
            m.config.scale_tensor = torch.randn(6)
    counts(g)


# 6. Numerics flags ------------------------------------------------------------------


def add_ones(x):
    return x + torch.ones(x.shape[-1])


def test_default_dtype_changed_between_calls():
    g = autograph.graphed(add_ones)
    saved = torch.get_default_dtype()
    try:
        with torch.no_grad():
            for dtype in (torch.float32, torch.float64, torch.float32, torch.float64):
                torch.set_default_dtype(dtype)
                for _ in range(CALLS):
                    x = torch.randn(5, dtype=torch.float32)
                    out, expect = g(x), add_ones(x)
                    assert out.dtype == expect.dtype == torch.promote_types(
                        torch.float32, dtype)
                    torch.testing.assert_close(out, expect)
    finally:
        torch.set_default_dtype(saved)
    replayed(g)


def test_default_dtype_for_a_tensor_made_inside_only():
    def f(x):
        return x.sum() + torch.ones(3)

    g = autograph.graphed(f)
    saved = torch.get_default_dtype()
    try:
        with torch.no_grad():
            for dtype in (torch.float64, torch.float32, torch.float64):
                torch.set_default_dtype(dtype)
                for _ in range(CALLS):
                    x = torch.randn(4, dtype=torch.float64)
                    out, expect = g(x), f(x)
                    assert out.dtype == expect.dtype
                    torch.testing.assert_close(out, expect)
    finally:
        torch.set_default_dtype(saved)
    replayed(g)


def deterministic_aware(x):
    """Code that picks another algorithm when deterministic algorithms are requested
    (as libraries do for scatter-style reductions)."""
    if torch.are_deterministic_algorithms_enabled():
        return x.cumsum(0)
    return x * 3


def test_deterministic_algorithms_flag_toggled_between_calls():
    g = autograph.graphed(deterministic_aware)
    saved = (torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled())
    try:
        with torch.no_grad():
            for flag in (False, True, False, True):
                torch.use_deterministic_algorithms(flag)
                for _ in range(CALLS):
                    x = torch.randn(6)
                    torch.testing.assert_close(g(x), deterministic_aware(x))
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
    replayed(g)


def matmul_precision_aware(x):
    if torch.get_float32_matmul_precision() == "highest":
        return x * 2
    return x - 1


def test_float32_matmul_precision_toggled_between_calls():
    g = autograph.graphed(matmul_precision_aware)
    saved = torch.get_float32_matmul_precision()
    try:
        with torch.no_grad():
            for precision in ("highest", "high", "highest", "medium"):
                torch.set_float32_matmul_precision(precision)
                for _ in range(CALLS):
                    x = torch.randn(6)
                    torch.testing.assert_close(g(x), matmul_precision_aware(x))
    finally:
        torch.set_float32_matmul_precision(saved)
    replayed(g)


def test_matmul_fp32_precision_new_api_does_not_raise():
    """torch.backends.cuda.matmul.fp32_precision (the new API) set by the user: graphed
    calls neither raise nor differ from eager (reading the legacy precision then raises
    in torch)."""
    matmul = torch.backends.cuda.matmul
    if not hasattr(matmul, "fp32_precision"):
        pytest.skip("torch.backends.cuda.matmul.fp32_precision is not in this torch")
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)).eval()
    g = autograph.graphed(m)
    saved = matmul.fp32_precision
    try:
        with torch.no_grad():
            for precision in ("tf32", "ieee", saved, "tf32"):
                matmul.fp32_precision = precision
                for _ in range(CALLS):
                    x = torch.randn(3, 16)
                    torch.testing.assert_close(g(x), m(x))
    finally:
        matmul.fp32_precision = saved
    replayed(g)


# 7. Host randomness -----------------------------------------------------------------


class LayerDrop(nn.Module):
    def __init__(self, source):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(4))
        self.source = source

    def forward(self, x):
        for layer in self.layers:
            if self.source == "torch":
                keep = torch.rand(()) < 0.5  # the CPU generator decides what runs
            else:
                keep = random.random() < 0.5
            if keep:
                x = layer(x)
        return x


STANDIN_RNG = ("on the CPU stand-in torch's CPU generator is the graph device's own "
               "generator; tests/gpu/test_usage_cuda.py covers it")


@pytest.mark.parametrize("source", ["torch", "python"])
def test_layerdrop_on_host_random_numbers_equals_eager_under_the_same_seeds(source):
    if source == "torch":
        pytest.skip(STANDIN_RNG)
    torch.manual_seed(0)
    m = LayerDrop(source).eval()
    g = autograph.graphed(m)
    with torch.no_grad():
        for i in range(3 * CALLS):
            x = torch.randn(2, 6)
            torch.manual_seed(i)
            random.seed(i)
            out = g(x)
            torch.manual_seed(i)
            random.seed(i)
            expect = m(x)
            torch.testing.assert_close(out, expect)
    s = counts(g)
    assert s["eager"] > 2, s  # beyond the warmups: the decisions are the host's


def test_host_random_numbers_made_into_a_tensor():
    pytest.skip(STANDIN_RNG)

    def f(x):
        return x + torch.rand(x.shape[-1])  # CPU generator: fresh numbers every call

    g = autograph.graphed(f)
    with torch.no_grad():
        for i in range(3 * CALLS):
            x = torch.randn(4)
            torch.manual_seed(i)
            out = g(x)
            torch.manual_seed(i)
            torch.testing.assert_close(out, f(x))
    counts(g)


# 8. Autograd through tensors that are not parameters ----------------------------------

W = torch.randn(5, requires_grad=True)


def by_global_leaf(x):
    return (x * W).tanh()


@pytest.mark.parametrize("where", ["closure", "global", "object", "module-attribute"])
def test_gradient_reaches_a_tensor_that_is_not_a_parameter(where):
    leaf = torch.randn(5, requires_grad=True)
    cfg = types.SimpleNamespace(w=leaf)
    if where == "closure":
        def f(x):
            return (x * leaf).tanh()
    elif where == "global":
        f, leaf = by_global_leaf, W
    elif where == "object":
        def f(x):
            return (x * cfg.w).tanh()
    else:
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.w = leaf  # a plain attribute, not a parameter

            def forward(self, x):
                return (x * self.w).tanh()

        f = M()
    g = autograph.graphed(f)
    for _ in range(CALLS):
        x = torch.randn(3, 5)
        leaf.grad = None
        loss = g(x).sum()
        loss.backward()
        got = leaf.grad.clone()
        leaf.grad = None
        f(x).sum().backward()
        torch.testing.assert_close(got, leaf.grad)
        torch.testing.assert_close(loss, f(x).sum())
    leaf.grad = None
    counts(g)


# 9. Regions across threads and generators -------------------------------------------


def mlp():
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).eval()


def test_a_region_in_a_generator_resumed_on_another_thread():
    model = mlp()
    results = []

    def gen():
        with torch.no_grad(), autograph.capture_region():
            for _ in range(4):
                x = torch.randn(2, 4)
                results.append((x, model(x)))
                yield 1
            yield 2

    errors = []
    it = gen()
    next(it)
    next(it)  # part on the main thread

    def rest():
        try:
            for _ in it:
                pass
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    t = threading.Thread(target=rest)
    t.start()
    t.join()
    assert not errors, errors
    assert nn.Module.__call__ is ORIGINAL_CALL
    with torch.no_grad():
        for x, out in results:
            torch.testing.assert_close(out, model(x))
        x = torch.randn(2, 4)
        torch.testing.assert_close(model(x), model.forward(x))


def test_a_region_in_a_generator_closed_on_another_thread():
    model = mlp()

    def gen():
        with torch.no_grad(), autograph.capture_region():
            while True:
                yield model(torch.randn(2, 4))

    it = gen()
    for _ in range(3):
        next(it)
    errors = []

    def close():
        try:
            it.close()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    t = threading.Thread(target=close)
    t.start()
    t.join()
    assert not errors, errors
    assert nn.Module.__call__ is ORIGINAL_CALL


def test_regions_on_four_threads_count_only_their_own_calls():
    torch.manual_seed(0)
    model = mlp()
    regions, errors, pairs = {}, [], []
    start = threading.Barrier(4)

    def worker(k):
        gen = torch.Generator().manual_seed(k)
        try:
            start.wait()
            with torch.no_grad(), autograph.capture_region() as region:
                regions[k] = region
                for _ in range(20):
                    x = torch.randn(3, 4, generator=gen)
                    pairs.append((x, model(x)))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert nn.Module.__call__ is ORIGINAL_CALL
    for region in regions.values():
        s = one(region.stats())
        assert s["calls"] == 20, s
        assert s["replays"] <= s["calls"], s
        assert s["calls"] == s["replays"] + s["captures"] + s["eager"], s
    total = counts(model)
    assert total["calls"] == 80 and total["replays"] > 0
    with torch.no_grad():
        for x, out in pairs:
            torch.testing.assert_close(out, model(x))


# 10. Smaller ------------------------------------------------------------------------


class Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("n", torch.zeros(()))

    def forward(self, x):
        self.n += 1  # in place, then the same tensor assigned back to the buffer
        return self.fc(x) * self.n


def test_a_forward_reassigning_its_buffer_after_an_in_place_add_is_graphed():
    torch.manual_seed(0)
    m = Counter().eval()
    ref = copy.deepcopy(m)
    g = autograph.graphed(m)
    n = m.n
    with torch.no_grad():
        for step in range(2 * CALLS):
            x = torch.randn(2, 4)
            torch.testing.assert_close(g(x), ref(x))
            assert m.n.item() == ref.n.item() == step + 1
    assert m.n is n
    replayed(g)


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_spectral_norm_equals_eager(mode):
    torch.manual_seed(0)
    m = nn.utils.parametrizations.spectral_norm(nn.Linear(6, 6)).train(mode == "train")
    ref = copy.deepcopy(m)
    g = autograph.graphed(m)
    with torch.no_grad():
        for _ in range(2 * CALLS):
            x = torch.randn(3, 6)
            torch.testing.assert_close(g(x), ref(x))
            for (name, a), (_, e) in zip(m.state_dict().items(), ref.state_dict().items()):
                torch.testing.assert_close(a, e, msg=name)
    if mode == "eval":
        replayed(g)
    else:
        counts(g)


# Verified replays (graphed(..., verify_every=N), AUTOGRAPH_VERIFY_EVERY) -------------

needs_verify = pytest.mark.skipif(
    "verify_every" not in inspect.signature(autograph.graphed).parameters,
    reason="graphed(verify_every=) is not there yet")


@needs_verify
def test_verify_every_replay_catches_a_stale_graph_and_runs_eagerly_after(caplog):
    cfg = {"k": 2.0}  # a value in a mutable container: not guarded

    def f(x):
        return x * cfg["k"]

    g = autograph.graphed(f, verify_every=1)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="autograph"):
        for _ in range(CALLS):
            x = torch.randn(5)
            torch.testing.assert_close(g(x), f(x))
        before = counts(g)
        assert before["replays"] > 0 and before["verify_failures"] == 0
        assert before["verifications"] == before["replays"]
        cfg["k"] = 3.0  # the graph is now stale
        g(torch.randn(5))  # the verification of this replay finds the mismatch
        for _ in range(CALLS):
            x = torch.randn(5)
            torch.testing.assert_close(g(x), f(x))
    s = counts(g)
    assert s["verify_failures"] >= 1
    assert s["verifications"] >= before["verifications"] + 1
    # the mismatching call returns eager's result (counted eager), and so do later ones
    assert s["replays"] == before["replays"]
    assert s["eager_reasons"]["verify_failed"] == CALLS + 1
    assert any(r.levelno == logging.WARNING for r in caplog.records)


@needs_verify
def test_verify_every_n_checks_every_nth_replay():
    def f(x):
        return x.exp() - 1

    g = autograph.graphed(f, verify_every=3)
    with torch.no_grad():
        for _ in range(2 + 1 + 12):  # two warmups, the capture, 12 replays
            x = torch.randn(5)
            torch.testing.assert_close(g(x), f(x))
    s = counts(g)
    assert s["replays"] == 12 and s["verify_failures"] == 0
    assert s["verifications"] == 4


@needs_verify
def test_verify_runs_on_copies_and_leaves_written_arguments_as_eager():
    def step(cache, pos, value):
        cache.index_copy_(0, pos, value)
        return cache.sum(0) * 2

    g = autograph.graphed(step, verify_every=1)
    cache, ref = torch.randn(16, 4), None
    ref = cache.clone()
    with torch.no_grad():
        for i in range(12):
            pos, value = torch.tensor([i]), torch.randn(1, 4)
            torch.testing.assert_close(g(cache, pos, value), step(ref, pos, value))
            torch.testing.assert_close(cache, ref)
    s = counts(g)
    assert s["replays"] > 0 and s["verify_failures"] == 0 and s["verifications"] > 0


@needs_verify
def test_verify_every_from_the_environment(monkeypatch):
    monkeypatch.setenv("AUTOGRAPH_VERIFY_EVERY", "1")
    cfg = {"k": 2.0}  # a value in a mutable container: not guarded

    def f(x):
        return x + cfg["k"]

    g = autograph.graphed(f)
    with torch.no_grad():
        for _ in range(CALLS):
            g(torch.randn(5))
        cfg["k"] = -1.0
        g(torch.randn(5))
        for _ in range(CALLS):
            x = torch.randn(5)
            torch.testing.assert_close(g(x), f(x))
    s = counts(g)
    assert s["verify_failures"] >= 1 and s["verifications"] >= 1


@needs_verify
def test_verify_keeps_the_aliasing_of_overlapping_arguments():
    """A read argument overlapping a written one: the eager check runs on copies that
    overlap alike, so a correct replay is not reported as a mismatch."""
    def f(x, state, extra):
        state.mul_(0.5).add_(x)
        return x + extra

    g = autograph.graphed(f, verify_every=1)
    d = 4
    buf = torch.randn(2, 2 * d)
    ref = buf.clone()
    with torch.no_grad():
        for _ in range(CALLS):
            x = torch.randn(2, d)
            out = g(x, buf[:, :d], buf[:, d // 2:d // 2 + d])
            torch.testing.assert_close(out, f(x, ref[:, :d], ref[:, d // 2:d // 2 + d]))
            torch.testing.assert_close(buf, ref)
    s = counts(g)
    assert s["verifications"] > 0 and s["verify_failures"] == 0, s



@needs_verify
def test_attention_without_dropout_is_verified_and_dropout_is_not():
    """Attention kernels carry the 'seeded' tag for their dropout: with dropout_p=0 a
    replay is checked; a call whose dropout draws numbers is not."""
    def attend(q, k, v):
        return nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.0)

    def dropped(x):
        return nn.functional.dropout(x, p=0.5, training=True) * 2

    g, h = autograph.graphed(attend, verify_every=2), autograph.graphed(dropped, verify_every=2)
    with torch.no_grad():
        for _ in range(CALLS):
            q, k, v = (torch.randn(1, 2, 3, 4) for _ in range(3))
            torch.testing.assert_close(g(q, k, v), attend(q, k, v))
            h(torch.randn(4, 4))
    checked, unchecked = counts(g), counts(h)
    assert checked["replays"] > 0 and checked["verifications"] > 0, checked
    assert checked["verify_failures"] == 0
    assert unchecked["replays"] > 0 and unchecked["verifications"] == 0, unchecked


@needs_verify
def test_calls_with_object_arguments_are_not_verified():
    """An eager rerun would advance the object's own state a second time."""
    class Counter:
        def __init__(self):
            self.buf = torch.zeros(8, 2)
            self.pos = torch.zeros((), dtype=torch.long)

    def step(x, c):
        c.buf.index_copy_(0, c.pos.view(1), x)
        c.pos.add_(1)
        return c.buf.sum(0)

    g = autograph.graphed(step, verify_every=1)
    mine, ref = Counter(), Counter()
    with torch.no_grad():
        for _ in range(6):
            x = torch.randn(1, 2)
            torch.testing.assert_close(g(x, mine), step(x, ref))
            torch.testing.assert_close(mine.buf, ref.buf)
    s = counts(g)
    assert s["replays"] > 0 and s["verifications"] == 0, s


def _reshaped(x, shape, shapes):
    return x.reshape(shape) * shape.numel() + shapes[0].numel()


def test_size_arguments_stay_sizes_and_are_keyed_by_value():
    """A ``torch.Size`` argument, alone or in a list, reaches the function as a
    ``torch.Size`` (it was rebuilt as a tuple, so ``.numel()`` raised where eager
    runs), and another size selects another graph."""
    g = autograph.graphed(_reshaped)
    with torch.no_grad():
        for shape in [torch.Size([4, 3])] * CALLS + [torch.Size([3, 4])] * CALLS:
            x = torch.randn(12)
            torch.testing.assert_close(g(x, shape, [shape]), _reshaped(x, shape, [shape]))
    s = replayed(g)
    assert s["captures"] == 2, s


_COMPILE_WEIGHT = {}


@autograph.graphed
def _times_weight(x):
    return x @ _COMPILE_WEIGHT[x.device.type]


def check_graphed_calls_inside_torch_compile(device="cpu", backend="eager"):
    """A graphed module or function called from code that ``torch.compile`` traces is
    traced through to the original (compiled with its caller, no call counted); it
    raised on CUDA, where the trace reached the warmup's ``record_stream``.  Outside
    the compiled code the same object graphs as before (shared with tests/gpu)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)).to(device)
    g = autograph.graphed(m)
    bucketed = autograph.graphed(m, buckets=[4])
    w = _COMPILE_WEIGHT[torch.device(device).type] = torch.randn(16, 4, device=device)

    @torch.compile(backend=backend)
    def outer(x):
        return g(x) * 2 + bucketed(x) + _times_weight(x)

    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(2, 16, device=device)
            torch.testing.assert_close(outer(x), m(x) * 3 + x @ w)
        for h in (g, bucketed, _times_weight):
            assert autograph.stats(h)["calls"] == 0, autograph.stats(h)
        for _ in range(CALLS):
            x = torch.randn(2, 16, device=device)
            torch.testing.assert_close(g(x), m(x))
    replayed(g)


def test_graphed_calls_inside_torch_compile_trace_the_original():
    check_graphed_calls_inside_torch_compile()


def check_graphed_modules_inside_fullgraph_compile_and_jit_trace(device="cpu"):
    """A graphed module inside ``torch.compile(fullgraph=True)`` raised (Dynamo met the
    region's context variables on the way to the original); one inside a module that
    ``torch.jit.trace`` traces ran autograph under the tracer, so from the third trace
    on the trace recorded a replay (a batch-3 trace answered batch 1 with 3 rows).
    Both now reach the original."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 2).to(device).requires_grad_(False)
    g = autograph.graphed(lin)
    parent = nn.Sequential(g, nn.Tanh())

    @torch.compile(backend="eager", fullgraph=True)
    def outer(x):
        return g(x) * 2

    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(3, 4, device=device)
            torch.testing.assert_close(outer(x), lin(x) * 2)
            traced = torch.jit.trace(parent, (x,), check_trace=False)
            for n in (1, 5):
                y = torch.randn(n, 4, device=device)
                torch.testing.assert_close(traced(y), torch.tanh(lin(y)))
        for _ in range(CALLS):
            x = torch.randn(3, 4, device=device)
            torch.testing.assert_close(g(x), lin(x))
    replayed(g)


def check_a_compiled_submodule_is_not_compiled_again(device="cpu"):
    """A ``torch.compile``'d submodule inside a graphed module was compiled again for
    the call's second warmup (run with the autocast cache off, a setting Dynamo guards
    on), and under ``set_stance("fail_on_recompile")`` every call raised.  Outside
    autocast the cache is left alone."""
    torch.manual_seed(0)
    inner = nn.Linear(4, 4).to(device)
    model = nn.Sequential(torch.compile(inner, backend="eager"), nn.ReLU())
    with torch.no_grad():
        model(torch.randn(5, 4, device=device))  # compiled once, as eager use does
        g = autograph.graphed(model)
        with torch.compiler.set_stance("fail_on_recompile"):
            for _ in range(CALLS + 3):
                x = torch.randn(5, 4, device=device)
                torch.testing.assert_close(g(x), torch.relu(inner(x)))
    replayed(g)


def test_a_compiled_submodule_is_not_compiled_again():
    check_a_compiled_submodule_is_not_compiled_again()


class _OwnAutocast(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            return self.fc(x).float()


def check_casts_are_not_cached_inside_an_outer_autocast_block(device="cpu"):
    """A forward entering autocast itself, captured inside an outer autocast block
    with autocast disabled around the call: the cache, left on (no autocast enabled),
    still held the warmup's cast of the weight, the capture recorded no cast, and
    replays kept the old weight's cast after an in-place update."""
    torch.manual_seed(0)
    m = _OwnAutocast().to(device)
    g = autograph.graphed(m)
    x = torch.randn(2, 8, device=device)
    with torch.no_grad():
        with torch.autocast(device, dtype=torch.bfloat16), \
                torch.autocast(device, enabled=False):
            for _ in range(3):
                g(x)
        for _ in range(3):
            m.fc.weight.add_(1.0)
            with autograph.disabled():
                want = m(x)
            torch.testing.assert_close(g(x), want)
    replayed(g)


def test_casts_are_not_cached_inside_an_outer_autocast_block():
    check_casts_are_not_cached_inside_an_outer_autocast_block()


def test_graphed_modules_inside_fullgraph_compile_and_jit_trace():
    check_graphed_modules_inside_fullgraph_compile_and_jit_trace()


def _branchy(x):
    return torch.cond(x.sum() > 0, lambda t: t * 2, lambda t: t - 1, (x,))


def _looped(x):
    from torch._higher_order_ops import while_loop

    return while_loop(lambda i, t: i < 3, lambda i, t: (i + 1, t * 2),
                      (torch.zeros((), dtype=torch.long, device=x.device), x))[1]


def check_higher_order_operators_run_eagerly(device="cpu"):
    """A call running one of torch's higher-order operators eagerly (``torch.cond``,
    ``while_loop``) gives eager's results, whatever the grad mode: it raised under
    autograph's recorder (no rule for its mode), and, once Dynamo had met the
    operator's frame under the recorder, every later ``torch.cond``, graphed or not,
    failed to trace.  It runs eagerly (its inner operators cannot be followed)."""
    for fn in (_branchy, _looped):
        g = autograph.graphed(fn)
        for grad in (False, True, False):
            with torch.set_grad_enabled(grad):
                for i in range(4):
                    x = torch.randn(3, 4, device=device) * (1 if i % 2 else -1)
                    torch.testing.assert_close(g(x), fn(x))
        s = autograph.stats(g)
        assert s["eager_reasons"].get("capture_failed"), s
        assert "higher-order" in str(s["eager_details"]), s


def test_higher_order_operators_run_eagerly(standin):
    check_higher_order_operators_run_eagerly()


def check_compiled_code_met_in_a_graphed_call_compiles_later(device="cpu"):
    """A ``torch.compile``'d function first called inside a graphed call's warmup runs
    eagerly there (autograph's recorder must see its operators), and is compiled when
    called outside: Dynamo marked its code skipped for ever under the recorder."""
    compiled: list[int] = []

    def backend(gm, example_inputs):
        compiled.append(1)
        return gm.forward

    @torch.compile(backend=backend)
    def inner(x):
        return x.sin() * 2

    g = autograph.graphed(lambda x: inner(x) + 1)
    with torch.no_grad():
        for _ in range(CALLS):
            x = torch.randn(3, device=device)
            torch.testing.assert_close(g(x), x.sin() * 2 + 1)
        assert autograph.stats(g)["replays"] >= 1, autograph.stats(g)
        torch.testing.assert_close(inner(x), x.sin() * 2)
    assert compiled, "inner was never compiled"


def test_compiled_code_met_in_a_graphed_call_compiles_later(standin):
    check_compiled_code_met_in_a_graphed_call_compiles_later()


def test_dynamos_stance_is_put_back_as_the_user_left_it():
    """Recording runs compiled code eagerly (Dynamo's ``force_eager`` stance, process-
    wide): a stance the user sets inside the recorded call stays, and one left stuck by
    another's context exit overlapping a recording is put back at the next recording."""
    import torch._dynamo  # noqa: F401 - the stance needs Dynamo
    from torch._dynamo import eval_frame

    from autograph.mutation import WriteRecorder

    try:
        with WriteRecorder({}, set()):
            assert eval_frame._stance.stance == "force_eager"
            torch.compiler.set_stance("eager_on_recompile")
        assert eval_frame._stance.stance == "eager_on_recompile"
        torch.compiler.set_stance("default")
        recorder = WriteRecorder({}, set())
        recorder.__enter__()
        other = torch.compiler.set_stance("eager_on_recompile")
        other.__enter__()  # another thread's context, overlapping the recording
        recorder.__exit__(None, None, None)
        other.__exit__(None, None, None)  # puts back the recording's force_eager
        with WriteRecorder({}, set()):
            pass
        assert eval_frame._stance.stance == "default"
    finally:
        torch.compiler.set_stance("default")


# Known differences from eager, found exploring on 2026-12-02 after the session's last GPU
# run (a fix needs tests/gpu on CUDA): strict, so a fix that makes one pass fails the
# suite until its mark is removed.
def test_an_item_added_to_a_dict_argument_reaches_the_callers_dict(standin):
    def pool(features):
        features["pooled"] = features["tokens"].mean(1)
        return features

    g = autograph.graphed(pool)
    with torch.no_grad():
        for _ in range(4):
            features = {"tokens": torch.randn(2, 3, 4)}
            out = g(features)
            assert out is features and "pooled" in features
    assert autograph.stats(g)["replays"] >= 1, autograph.stats(g)


class Gate(nn.Module):
    fused = True  # a class attribute, flipped for every instance at once

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        return torch.softmax(y, -1) if self.fused else y


def check_a_class_attribute_flag_is_seen(device: str = "cpu") -> None:
    """A flag flipped on the class (every instance at once) drops the graphs that took
    its old branch; flipped back, graphs replay again."""
    model = Gate().to(device).eval()
    g = autograph.graphed(model)
    try:
        with torch.no_grad():
            for i in range(18):
                if i in (6, 12):
                    Gate.fused = i == 12
                x = torch.randn(2, 4, device=device)
                torch.testing.assert_close(g(x), model.forward(x))
    finally:
        Gate.fused = True
    s = autograph.stats(g)
    assert s["replays"] >= 6 and s["invalidations"] >= 2, s


def test_a_class_attribute_flag_is_seen(standin):
    check_a_class_attribute_flag_is_seen()


class InferenceForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    @torch.inference_mode()
    def forward(self, x):
        return self.lin(x).relu()


def check_an_inference_mode_forward_returns_inference_tensors(device: str = "cpu") -> None:
    """A forward decorated with ``@torch.inference_mode()``, called outside it (grad
    mode on or off): replays return inference tensors, as eager does (an in-place
    update outside inference mode raises), with eager's values."""
    model = InferenceForward().to(device)
    for mode in (torch.enable_grad, torch.no_grad):
        g = autograph.graphed(model)
        with mode():
            for _ in range(12):
                x = torch.randn(2, 4, device=device)
                y = g(x)
                assert y.is_inference() and not y.requires_grad
                torch.testing.assert_close(y, model(x))
        assert autograph.stats(g)["replays"] >= 8, autograph.stats(g)

    @torch.inference_mode(False)
    def normal(x):  # called inside inference mode: eager returns a normal tensor
        return x.clone() * 2

    def mixed(x):
        with torch.inference_mode():
            a = x * 2
        return a, x * 3

    for fn, mode in ((normal, torch.inference_mode), (mixed, torch.no_grad)):
        g = autograph.graphed(fn)
        for _ in range(6):
            with mode():
                x = torch.randn(3, device=device)
            with mode():
                want, got = fn(x), g(x)
            for w, o in zip(pytree.tree_leaves(want), pytree.tree_leaves(got)):
                assert o.is_inference() == w.is_inference()
                torch.testing.assert_close(o, w)
        s = autograph.stats(g)  # eager: a replay would copy them in one mode
        assert s["eager_reasons"].get("unsupported_output", 0) >= 3, s


def test_an_inference_mode_forward_returns_inference_tensors(standin):
    check_an_inference_mode_forward_returns_inference_tensors()


def check_container_arguments_changed_by_the_call(device: str = "cpu") -> None:
    """A function that adds an item to a dict argument (and returns it, as
    sentence-transformers' modules do) or appends to a list argument: the caller's
    container shows the change on every call, replayed or not, and is what comes back
    (a key rebound to a new list too); one that changes a container it does not return
    runs eagerly, changing it too."""
    def pool(features):
        features["pooled"] = features["tokens"].mean(1)
        return features

    def extend(xs, scale=1.0):
        xs.append(xs[0] * scale)
        return xs[0] + 1, xs

    def hidden_update(features):
        features["pooled"] = features["tokens"].mean(1)
        return features["pooled"] * 2

    def parts(features):  # a key holding a list rebound to a new list
        features["parts"] = [features["tokens"] * 2]
        return features

    g, h, k, p = (autograph.graphed(f) for f in (pool, extend, hidden_update, parts))
    reused = {"tokens": torch.zeros(2, 3, 4, device=device), "parts": []}
    with torch.no_grad():
        for _ in range(6):
            tokens = torch.randn(2, 3, 4, device=device)
            reused["tokens"].copy_(tokens)
            old = reused["parts"]
            assert p(reused) is reused and reused["parts"] is not old
            torch.testing.assert_close(reused["parts"][0], tokens * 2)
            features = {"tokens": tokens}
            out = g(features)
            assert out is features and list(features) == ["tokens", "pooled"]
            assert features["tokens"] is tokens
            torch.testing.assert_close(features["pooled"], tokens.mean(1))
            xs = [torch.randn(3, device=device)]
            y, back = h(xs, scale=2.0)
            assert back is xs and len(xs) == 2
            torch.testing.assert_close(xs[1], xs[0] * 2)
            torch.testing.assert_close(y, xs[0] + 1)
            features = {"tokens": tokens}
            torch.testing.assert_close(k(features), tokens.mean(1) * 2)
            torch.testing.assert_close(features["pooled"], tokens.mean(1))
    assert autograph.stats(g)["replays"] >= 3 and autograph.stats(h)["replays"] >= 3
    assert autograph.stats(p)["replays"] >= 2, autograph.stats(p)  # (the first call: a key)
    s = autograph.stats(k)
    assert s["replays"] == 0 and s["eager_reasons"].get("assigns_attribute"), s


def test_container_arguments_changed_by_the_call(standin):
    check_container_arguments_changed_by_the_call()


class CountsCalls(nn.Module):
    calls = 0  # a class attribute the forward reads and changes

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        CountsCalls.calls += 1
        return self.lin(x) * 2


def check_a_forward_that_changes_a_name_it_reads(device: str = "cpu") -> None:
    """A forward that changes a class attribute (or global) it reads runs eagerly, so
    the change happens on every call as in eager mode, without dropping and warming up
    graphs on every call; a caller's change between calls is still seen."""
    model = CountsCalls().to(device)
    g = autograph.graphed(model)
    before = CountsCalls.calls
    with torch.no_grad():
        for _ in range(10):
            x = torch.randn(2, 4, device=device)
            torch.testing.assert_close(g(x), model.lin(x) * 2)
    assert CountsCalls.calls == before + 10
    s = autograph.stats(g)
    assert s["invalidations"] == 0 and s["eager_reasons"].get("assigns_attribute", 0) >= 8, s
    lazy = autograph.graphed(lazily_scaled)  # a global set once, on the first call
    with torch.no_grad():
        for _ in range(6):
            x = torch.randn(3, device=device)
            torch.testing.assert_close(lazy(x), x * 2)
    assert autograph.stats(lazy)["replays"] >= 2, autograph.stats(lazy)


LAZY_SCALE = None


def lazily_scaled(x):
    global LAZY_SCALE
    if LAZY_SCALE is None:
        LAZY_SCALE = 2.0
    return x * LAZY_SCALE


def test_a_forward_that_changes_a_name_it_reads(standin):
    check_a_forward_that_changes_a_name_it_reads()


def check_container_arguments_shared_nested_and_returned_twice(device: str = "cpu"
                                                                ) -> None:
    """One dict passed twice runs eagerly (a change through one name shows through the
    other); dicts held by a changed dict stay the caller's objects, and a change inside
    one runs eagerly; a changed dict returned twice is the caller's dict twice."""
    def through_both(a, b):
        a["y"] = a["x"] * 2
        return a, b["y"] * 3

    def nested(d):
        d["out"] = d["x"] + d["cfg"]["bias"]
        return d

    def inner_change(d):
        d["cfg"]["seen"] = d["x"].sum()
        return d

    def twice(d):
        d["y"] = d["x"] + 1
        return d, d

    fns = [through_both, nested, inner_change, twice]
    g = {f: autograph.graphed(f) for f in fns}
    with torch.no_grad():
        for _ in range(6):
            x = torch.randn(3, device=device)
            d = {"x": x}
            out, y = g[through_both](d, d)
            assert out is d and torch.equal(y, x * 6)
            cfg = {"bias": torch.ones(3, device=device)}
            d = {"x": x, "cfg": cfg}
            assert g[nested](d) is d and d["cfg"] is cfg
            torch.testing.assert_close(d["out"], x + 1)
            cfg = {}
            d = {"x": x, "cfg": cfg}
            g[inner_change](d)
            assert d["cfg"] is cfg and torch.equal(cfg["seen"], x.sum())
            d = {"x": x}
            a, b = g[twice](d)
            assert a is d and b is d and torch.equal(d["y"], x + 1)
    stats = {f.__name__: autograph.stats(h) for f, h in g.items()}
    assert stats["through_both"]["replays"] == 0, stats
    assert stats["inner_change"]["replays"] == 0, stats
    assert stats["nested"]["replays"] >= 3 and stats["twice"]["replays"] >= 3, stats


def test_container_arguments_shared_nested_and_returned_twice(standin):
    check_container_arguments_shared_nested_and_returned_twice()


class Mode(enum.Enum):
    DOUBLE = 2
    TRIPLE = 3


class FlagBase(nn.Module):
    flag = True
    scale = None  # set to a number later
    mode = Mode.DOUBLE
    dims = (0,)

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        y = y.relu() if self.flag else y
        if self.scale is not None:
            y = y * self.scale
        return y * self.mode.value + y.sum(self.dims, keepdim=True)


class FlagSub(FlagBase):
    @torch.no_grad()
    def forward(self, x):  # decorated, and reaching the base's code through super()
        return super().forward(x) + (1 if self.extra else 0)

    extra = False


class Settings:
    bias = 0.0


LAST_SEEN = None


def uses_settings(x):
    global LAST_SEEN
    LAST_SEEN = "seen"
    return x + Settings.bias


def check_flags_read_through_classes_and_globals(device: str = "cpu") -> None:
    """Values a call reads from classes and globals, flipped between calls, are seen
    as eager sees them: class attributes read through ``super()``, under a decorated
    forward, by ``getattr(self, "name")``, holding None, an enum member or a tuple; a
    plain global class's attribute; a global the function assigns."""
    global LAST_SEEN
    model = FlagSub().to(device).eval()
    g = autograph.graphed(model)
    f = autograph.graphed(uses_settings)
    flips = [lambda: setattr(FlagBase, "flag", False), lambda: setattr(FlagBase, "scale", 3.0),
             lambda: setattr(FlagBase, "mode", Mode.TRIPLE),
             lambda: setattr(FlagBase, "dims", (1,)), lambda: setattr(FlagSub, "extra", True)]
    try:
        with torch.no_grad():
            for flip in [lambda: None, *flips]:
                flip()
                for _ in range(4):
                    x = torch.randn(2, 4, device=device)
                    torch.testing.assert_close(g(x), model.forward(x))
            for bias in (0.0, 0.0, 0.0, 1.5, 1.5, 1.5):
                Settings.bias = bias
                LAST_SEEN = None
                x = torch.randn(3, device=device)
                torch.testing.assert_close(f(x), x + bias)
                assert LAST_SEEN == "seen"
    finally:
        FlagBase.flag, FlagBase.scale, FlagBase.mode, FlagBase.dims = True, None, Mode.DOUBLE, (0,)
        FlagSub.extra, Settings.bias = False, 0.0
    s = autograph.stats(g)
    assert s["replays"] >= 6 and s["invalidations"] >= 5, s


def test_flags_read_through_classes_and_globals(standin):
    check_flags_read_through_classes_and_globals()


# settings held by a user's module, a namespace and a dataclass instance, named as
# globals by a function (``import config; config.SCALE``)
USER_CONFIG = types.ModuleType("user_config")
USER_CONFIG.SCALE = 1.0
USER_NAMESPACE = types.SimpleNamespace(shift=0.0)


@dataclasses.dataclass
class RunCfg:
    negate: bool = False


RUN_CFG = RunCfg()


USER_PACKAGE = types.ModuleType("user_package")  # ``import user_package.consts``
USER_PACKAGE.consts = types.ModuleType("user_package.consts")
USER_PACKAGE.consts.OFFSET = 0.0
USER_CONFIG.act = torch.relu


def scaled_by_settings(x):
    y = USER_CONFIG.act(x * USER_CONFIG.SCALE + USER_NAMESPACE.shift)
    y = y + USER_PACKAGE.consts.OFFSET
    return -y if RUN_CFG.negate else y


COUNTS = types.SimpleNamespace(calls=0, hw=None, device=None, nan=0.0, kinds=None,
                               act=torch.Tensor.exp, last=None)


def counts_its_calls(x):
    COUNTS.calls += 1  # a replay would not count
    return x * 2


def reads_shape_and_device(x):
    y = x * COUNTS.hw[1] if COUNTS.device == x.device and "a" in COUNTS.kinds else x
    return y * COUNTS.act(torch.ones_like(y)) if COUNTS.nan != COUNTS.nan else y


def keeps_its_last_output(x):
    COUNTS.last = x * 2  # only assigned: a replay would not
    return x + 1


def check_flags_read_through_namespaces_are_seen(device: str = "cpu") -> None:
    """A setting a function reads through a global module, ``SimpleNamespace``,
    dataclass instance or ``argparse.Namespace`` (or one in a closure cell), changed
    between calls, is seen by replays as by eager (it was baked in at capture); an
    attribute the code does not read of it changes without dropping the graphs."""
    args = argparse.Namespace(scale=1.0, step=0)

    def closure_scaled(x):
        return x * args.scale

    c = autograph.graphed(closure_scaled)
    with torch.no_grad():
        for k in range(10):
            args.step += 1  # not read by the function
            if k == 5:
                args.scale = 3.0
            x = torch.randn(3, device=device)
            torch.testing.assert_close(c(x), x * args.scale)
    s = autograph.stats(c)
    assert s["replays"] >= 3 and s["invalidations"] == 1, s
    g = autograph.graphed(scaled_by_settings)
    flips = [lambda: None, lambda: setattr(USER_CONFIG, "SCALE", 5.0),
             lambda: setattr(USER_NAMESPACE, "shift", 2.0),
             lambda: setattr(RUN_CFG, "negate", True),
             lambda: setattr(USER_CONFIG, "act", torch.tanh),
             lambda: setattr(USER_PACKAGE.consts, "OFFSET", 1.5)]
    try:
        with torch.no_grad():
            for flip in flips:
                flip()
                for _ in range(4):
                    x = torch.randn(3, device=device)
                    torch.testing.assert_close(g(x), scaled_by_settings(x))
    finally:
        USER_CONFIG.SCALE, USER_NAMESPACE.shift, RUN_CFG.negate = 1.0, 0.0, False
        USER_CONFIG.act, USER_PACKAGE.consts.OFFSET = torch.relu, 0.0
    s = autograph.stats(g)
    assert s["replays"] >= 6 and s["invalidations"] >= 5, s
    # a call that counts itself through a namespace runs eagerly: it counts every call
    counted = autograph.graphed(counts_its_calls)
    for _ in range(6):
        counted(torch.randn(3, device=device))
    assert COUNTS.calls == 6
    # equal values set again every step (a new tuple, ``x.device``) keep the graphs
    shaped = autograph.graphed(reads_shape_and_device)
    with torch.no_grad():
        for k in range(9):
            x = torch.randn(3, device=device)
            COUNTS.hw, COUNTS.device = (x.shape[0], 8), x.device
            COUNTS.nan, COUNTS.kinds = float("nan"), frozenset({"a", "b"})
            COUNTS.act = torch.Tensor.exp if k < 6 else torch.Tensor.neg  # swapped
            torch.testing.assert_close(shaped(x), x * 8 * COUNTS.act(torch.ones(3, device=device)))
    s = autograph.stats(shaped)
    assert s["replays"] >= 3 and s["invalidations"] == 1, s
    kept = autograph.graphed(keeps_its_last_output)
    with torch.no_grad():
        for _ in range(6):
            x = torch.randn(3, device=device)
            kept(x)
            torch.testing.assert_close(COUNTS.last, x * 2)


def test_settings_held_per_thread_are_seen(standin):
    check_settings_held_per_thread_are_seen()


def test_flags_read_through_namespaces_are_seen(standin):
    check_flags_read_through_namespaces_are_seen()


class _PerThread(threading.local):
    scale = 1.0

    def one(self):  # a method the code calls (a bound method is new at every read)
        return 1.0


PER_THREAD = _PerThread()
PLAIN_LOCAL = threading.local()


def _scaled_per_thread(x):
    return x * PER_THREAD.scale * PER_THREAD.one() + PLAIN_LOCAL.shift


def check_settings_held_per_thread_are_seen(device="cpu"):
    """A setting read from a ``threading.local`` (a subclass, or a plain one) is each
    thread's own: a graph captured in one thread is not replayed with its value in
    another (each thread got the first thread's result)."""
    g = autograph.graphed(_scaled_per_thread)
    bad: list = []

    def serve(scale, shift):
        PER_THREAD.scale, PLAIN_LOCAL.shift = scale, shift
        for _ in range(5):
            x = torch.randn(3, device=device)
            if not torch.allclose(g(x), x * scale + shift):
                bad.append((scale, shift))

    for scale, shift in ((2.0, 0.0), (3.0, 0.0), (3.0, 1.0)):
        t = threading.Thread(target=serve, args=(scale, shift))
        t.start()
        t.join(timeout=60)
    assert not bad, bad
    PLAIN_LOCAL.shift = 0.0
    try:  # a class default read by a thread that never set its own
        for default in (1.0, 4.0):
            _PerThread.scale = default
            for _ in range(4):
                x = torch.randn(3, device=device)
                torch.testing.assert_close(g(x), x * default)
    finally:
        _PerThread.scale = 1.0
    assert autograph.stats(g)["replays"] >= 3, autograph.stats(g)


class Tagged(torch.Tensor):
    """A user's tensor subclass, made by the call with ``as_subclass``."""


def check_outputs_keep_the_class_and_requires_grad_the_call_gave_them(
        device: str = "cpu") -> None:
    """An output the call marks ``requires_grad_()`` (a perturbation made under
    ``no_grad``), makes a ``Parameter`` or a subclass of: every replay returns it as
    eager does (a copy was a plain tensor that required no grad), clones and
    ``reuse``; one carrying Python attributes runs eagerly."""
    def marked(x):
        d = torch.zeros_like(x).add_(0.01 * x.sign())
        return d.requires_grad_()

    def tagged(x):
        return (x * 2).as_subclass(Tagged)

    def parameter(x):
        return nn.Parameter(x * 2)

    def with_attribute(x):
        y = x * 2
        y.note = "set by the call"
        return y

    for outputs in ("clone", "reuse"):
        for fn in (marked, tagged, parameter):
            autograph.reset()
            g = autograph.graphed(fn, outputs=outputs)
            with torch.no_grad():
                for _ in range(6):
                    x = torch.randn(4, device=device)
                    got, want = g(x), fn(x)
                    assert type(got) is type(want) and got.requires_grad == want.requires_grad
                    assert got.is_leaf
                    torch.testing.assert_close(got.detach().as_subclass(torch.Tensor),
                                               want.detach().as_subclass(torch.Tensor))
                    del got  # (reuse: the next call replays)
            assert autograph.stats(g)["replays"] >= 3, (fn.__name__, outputs)
    def shared_subclass(x):  # views of one memory: one plain copy would lose the class
        y = x * 2
        return y, y[:2].as_subclass(Tagged)

    def parameter_twice(x):
        p = nn.Parameter(x * 2)
        return p, p

    for fn in (shared_subclass, parameter_twice):
        g = autograph.graphed(fn)
        with torch.no_grad():
            for _ in range(4):
                x = torch.randn(4, device=device)
                got, want = g(x), fn(x)
                assert [type(t) for t in got] == [type(t) for t in want]
                assert [t.requires_grad for t in got] == [t.requires_grad for t in want]
                assert (got[0] is got[1]) == (want[0] is want[1])
    g = autograph.graphed(with_attribute)
    with torch.no_grad():
        for _ in range(4):
            assert g(torch.randn(4, device=device)).note == "set by the call"
    assert autograph.stats(g)["eager_reasons"].get("unsupported_output", 0) >= 1


def test_outputs_keep_the_class_and_requires_grad_the_call_gave_them(standin):
    check_outputs_keep_the_class_and_requires_grad_the_call_gave_them()


@dataclasses.dataclass
class DataCfg:
    scale: float = 2.0


class PlainCfg:
    flag = True


class OtherCfg:
    flag = False


ACTIVATION = torch.relu
SUB_SCALE = 2.0


class ScaledSub(nn.Module):
    def forward(self, x):
        return x * SUB_SCALE  # a global read by a submodule's forward


class UsesGlobals(nn.Module):
    def __init__(self):
        super().__init__()
        self.sub = ScaledSub()

    def forward(self, x):
        y = self.sub(ACTIVATION(x)) * DataCfg.scale
        return y if PlainCfg.flag else -y


def check_rebound_globals_are_seen(device: str = "cpu") -> None:
    """Globals changed between calls are seen by replays as by eager: a global class
    rebound to another, a dataclass's class-level value, a global function swapped,
    a global read by a submodule's forward."""
    global PlainCfg, ACTIVATION, SUB_SCALE
    model = UsesGlobals()
    g = autograph.graphed(model)
    saved = (PlainCfg, ACTIVATION, SUB_SCALE, DataCfg.scale)
    flips = [lambda: None, lambda: globals().__setitem__("PlainCfg", OtherCfg),
             lambda: setattr(DataCfg, "scale", 5.0),
             lambda: globals().__setitem__("ACTIVATION", torch.tanh),
             lambda: globals().__setitem__("SUB_SCALE", 7.0)]
    try:
        with torch.no_grad():
            for flip in flips:
                flip()
                for _ in range(4):
                    x = torch.randn(3, device=device)
                    torch.testing.assert_close(g(x), model.forward(x))
    finally:
        PlainCfg, ACTIVATION, SUB_SCALE, DataCfg.scale = saved
    s = autograph.stats(g)
    assert s["replays"] >= 5 and s["invalidations"] >= 4, s


def test_rebound_globals_are_seen(standin):
    check_rebound_globals_are_seen()


def check_attention_kernel_choices_are_keyed(device: str = "cpu") -> None:
    """The attention kernels ``scaled_dot_product_attention`` may pick (``sdpa_kernel``)
    and ``nn.MultiheadAttention``'s fast path select their own graphs: each call matches
    eager under the choice in force, and a choice eager cannot run raises as in eager."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def attend(q, k, v):
        return nn.functional.scaled_dot_product_attention(q, k, v)

    g = autograph.graphed(attend)
    q, k, v = (torch.randn(1, 2, 8, 16, device=device) for _ in range(3))
    with torch.no_grad():
        for backends in ([SDPBackend.MATH], None, [SDPBackend.MATH]):
            for _ in range(4):
                if backends is None:
                    torch.testing.assert_close(g(q, k, v), attend(q, k, v), rtol=0, atol=0)
                    continue
                with sdpa_kernel(backends):
                    torch.testing.assert_close(g(q, k, v), attend(q, k, v), rtol=0, atol=0)
    assert autograph.stats(g)["replays"] >= 4 and autograph.stats(g)["captures"] >= 2
    if "set_priority" in inspect.signature(sdpa_kernel).parameters:  # the order tried
        dtype = torch.float16 if device == "cuda" else torch.float32
        q, k, v = (torch.randn(1, 2, 8, 64, device=device, dtype=dtype) for _ in range(3))
        orders = ([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION],
                  [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION])
        with torch.no_grad():
            for order in (*orders, *orders):
                with sdpa_kernel(order, set_priority=True):
                    for _ in range(4):
                        torch.testing.assert_close(g(q, k, v), attend(q, k, v), rtol=0,
                                                   atol=0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True).to(device).eval()
    h = autograph.graphed(layer)
    x = torch.randn(2, 5, 16, device=device)
    try:
        with torch.inference_mode():
            for fast in (True, False):
                torch.backends.mha.set_fastpath_enabled(fast)
                for _ in range(4):  # (the two paths differ in the last bits)
                    torch.testing.assert_close(h(x), layer(x))
    finally:
        torch.backends.mha.set_fastpath_enabled(True)
    assert autograph.stats(h)["captures"] >= 2, autograph.stats(h)


def test_attention_kernel_choices_are_keyed(standin):
    check_attention_kernel_choices_are_keyed()


class Scaler:
    scale = 3.0

    @classmethod
    def by_class(cls, x):
        return x * cls.scale


class PlainRunner:
    def __init__(self):
        self.k = 2.0

    def run(self, x, scale):
        return x * self.k * scale

    prun = functools.partialmethod(run, scale=2.0)


def apply_module(x, m):
    return m(x)


def check_state_bound_by_partials_defaults_and_classmethods(device: str = "cpu") -> None:
    """What a graphed callable reaches through ``functools.partial`` (a module, an
    object), a default argument holding a module, or a classmethod's ``cls`` is
    watched: a weight replaced, ``eval()``, an attribute or class value changed are
    seen as by eager; ``functools.partialmethod`` binds its instance once."""
    torch.manual_seed(0)
    lin = nn.Linear(3, 3).to(device)
    bn = nn.BatchNorm1d(3).to(device)

    def with_default(x, m=lin):
        return m(x)

    runner = PlainRunner()
    cases = [(functools.partial(apply_module, m=lin),
              lambda: setattr(lin, "weight", nn.Parameter(torch.ones(3, 3, device=device)))),
             (functools.partial(apply_module, m=bn), bn.eval),
             (with_default, lambda: setattr(lin, "bias", None)),
             (functools.partial(PlainRunner.run, runner, scale=1.0),
              lambda: setattr(runner, "k", 5.0)),
             (runner.prun, lambda: setattr(runner, "k", 7.0)),
             (Scaler.by_class, lambda: setattr(Scaler, "scale", 4.0))]
    try:
        for fn, change in cases:
            g = autograph.graphed(fn)
            with torch.no_grad():
                for step in range(8):
                    if step == 5:
                        change()
                    x = torch.randn(4, 3, device=device)
                    torch.testing.assert_close(g(x), fn(x))
            s = autograph.stats(g)
            assert s["replays"] >= 2, (fn, s["replays"], s["eager_reasons"])
    finally:
        Scaler.scale = 3.0


def test_state_bound_by_partials_defaults_and_classmethods(standin):
    check_state_bound_by_partials_defaults_and_classmethods()


def check_classmethods_decorated_in_the_class_body(device: str = "cpu") -> None:
    """``@autograph.graphed`` on a classmethod in the class body (either order with
    ``@classmethod``): a subclass's call binds the subclass (the first class called
    used to be bound for all, even under ``disabled()``) and class values are guarded."""
    for outer in (True, False):
        def scale(cls, x):
            return x * cls.factor

        method = classmethod(autograph.graphed(scale)) if outer else \
            autograph.graphed(classmethod(scale))
        base = type("Base", (), {"factor": 3.0, "scale": method})
        sub = type("Sub", (base,), {"factor": 5.0})
        with torch.no_grad():
            for step in range(7):
                if step == 4:
                    base.factor = 4.0
                x = torch.randn(3, device=device)
                torch.testing.assert_close(base.scale(x), x * base.factor)
                torch.testing.assert_close(sub.scale(x), x * sub.factor)
                with autograph.disabled():
                    torch.testing.assert_close(sub.scale(x), x * sub.factor)
        of_sub, of_base = autograph.stats(sub.scale), autograph.stats(base.scale)
        assert of_sub["replays"] >= 3, of_sub
        assert of_base["replays"] >= 1, of_base
        assert not of_sub["eager_reasons"].get("bad_arguments"), of_sub
        sub.scale.reset()
        assert autograph.stats(sub.scale)["graphs"] == 0
        assert autograph.stats(base.scale)["graphs"] == 1


def test_classmethods_decorated_in_the_class_body(standin):
    check_classmethods_decorated_in_the_class_body()


class _WithStatic:
    @autograph.graphed
    @staticmethod
    def double(x):
        return x * 2


def test_a_graphed_staticmethod_read_from_an_instance_reports_its_calls(standin):
    """``@autograph.graphed`` over ``@staticmethod``, called through an instance: its
    calls replay through the function's engine, but ``stats(obj.method)`` looked for an
    instance's engine and reported 0 calls (``warmup`` raised "not graphed")."""
    for _ in range(4):
        x = torch.randn(3)
        torch.testing.assert_close(_WithStatic().double(x), x * 2)
    s = autograph.stats(_WithStatic().double)
    assert s["calls"] == 4 and s["replays"] >= 1, s
    assert autograph.stats(_WithStatic.double) == s
    autograph.warmup(_WithStatic().double, torch.randn(5))
    assert autograph.stats(_WithStatic().double)["graphs"] == 2


class _SlottedScale:
    __slots__ = ("w",)

    def __init__(self, w):
        self.w = w

    @autograph.graphed
    def run(self, x):
        return x * self.w


class _ParamsTuple(typing.NamedTuple):
    w: torch.Tensor

    @autograph.graphed
    def run(self, x):
        return x * self.w


def check_methods_of_objects_without_weak_references(device: str = "cpu") -> None:
    """A graphed method of an object that takes no weak reference (``__slots__``
    without ``__weakref__``, a ``NamedTuple``, ``dataclass(slots=True)``) raised
    ``TypeError``; it replays, its engine held with the object (the last few such
    objects per method), and a slot assigned between calls is seen."""
    from autograph import functions

    for make in (_SlottedScale, _ParamsTuple):
        obj = make(torch.randn(4, device=device))
        for i in range(9):
            if i == 4:
                obj.w.mul_(2)  # in place: the graph reads it
            if i == 6 and make is _SlottedScale:
                obj.w = torch.randn(4, device=device)  # a slot assigned: seen
            x = torch.randn(4, device=device)
            torch.testing.assert_close(obj.run(x), x * obj.w)
        assert autograph.stats(obj.run)["replays"] >= 2, autograph.stats(obj.run)
        for _ in range(functions.MAX_HELD + 4):  # a new object per call: a bounded few kept
            other = make(torch.randn(4, device=device))
            x = torch.randn(4, device=device)
            torch.testing.assert_close(other.run(x), x * other.w)
        dispatch = type(obj).run._self_wrapper
        assert len(dispatch.instances) <= functions.MAX_HELD


def test_methods_of_objects_without_weak_references(standin):
    check_methods_of_objects_without_weak_references()


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, mask=None, scale=1.0):
        y = self.lin(x) * scale
        return y if mask is None else y * mask


def test_keyword_spellings_share_one_key(standin):
    """``f(x=a, mask=m)``, ``f(mask=m, x=a)``, ``f(a, mask=m)`` and ``f(a, m)`` are one
    call: one key, one capture (each spelling had its own warmups and capture), and a
    keyword call takes the shortcut of positional calls.  A keyword after a gap stays
    one; a module whose forward pre-hook reads ``kwargs`` sees the call as written."""
    m = TwoInputs()
    g = autograph.graphed(m)
    x, mask = torch.randn(2, 4), torch.ones(2, 4)
    with torch.no_grad():
        spellings = [lambda: g(x=x, mask=mask), lambda: g(mask=mask, x=x),
                     lambda: g(x, mask=mask), lambda: g(x, mask)]
        for spell in spellings * 3:
            torch.testing.assert_close(spell(), m(x, mask))
        s = autograph.stats(g)
        assert s["captures"] == 1 and s["replays"] == 12 - 3, s
        torch.testing.assert_close(g(x, scale=2.0), m(x, scale=2.0))  # after a gap
    seen = []
    m.register_forward_pre_hook(lambda mod, a, kw: seen.append(sorted(kw)), with_kwargs=True)
    with torch.no_grad():
        g(x=x, mask=mask)
    assert seen == [["mask", "x"]]


def _probabilities_unless_logits(fn):
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        out = fn(self, *args, **kwargs)
        return out if kwargs.get("logits") else out.softmax(-1)

    return wrapper


class WrappedHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    @_probabilities_unless_logits
    def forward(self, x, logits=False):
        return self.lin(x)


def test_keywords_stay_keywords_where_the_called_function_reads_them(standin):
    """No keyword moves into position where the function called is a decorator's
    ``wrapper(*args, **kwargs)`` reading ``kwargs`` (its signature, followed through
    ``__wrapped__``, names the inner function's parameters), nor into a positional-only
    parameter (it belongs to ``**kwargs``, or eager raises)."""
    m = WrappedHead()
    g = autograph.graphed(m)
    with torch.no_grad():
        for _ in range(5):
            x = torch.randn(2, 4)
            torch.testing.assert_close(g(x, logits=True), m(x, logits=True))

    def f(x, scale=None, /, **opts):
        return x * (1.0 if scale is None else scale) + opts.get("scale", 0)

    h = autograph.graphed(f)
    with torch.no_grad():
        for _ in range(5):
            x = torch.randn(3)
            torch.testing.assert_close(h(x, scale=2.0), f(x, scale=2.0))
    only = autograph.graphed(lambda x, /: x * 2)
    with pytest.raises(TypeError):
        only(x=torch.randn(3))


class _Clamping(nn.Module):
    """A module whose own ``__call__`` reads how it was called."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, mask=None):
        y = self.lin(x)
        return y if mask is None else y * mask

    def __call__(self, *args, **kwargs):
        if "mask" in kwargs:
            kwargs["mask"] = kwargs["mask"].clamp(min=0.5)
        return super().__call__(*args, **kwargs)


class _Ordered(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, mask=None):
        return self.lin(x) * (1 if mask is None else mask)


def test_keywords_stay_keywords_for_a_class_call_or_a_patched_forward(standin):
    """A class overriding ``__call__`` reads ``kwargs``: a keyword moved into position
    changed every call; so did a class ``forward`` patched after wrapping to take
    ``(*args, **kwargs)`` (the moving used the forward seen at wrapping)."""
    torch.manual_seed(0)
    m = _Clamping()
    g = autograph.graphed(m)
    with torch.no_grad():
        for _ in range(5):
            x, k = torch.randn(2, 4), torch.rand(2, 4)
            torch.testing.assert_close(g(x, mask=k), m(x, mask=k))
    assert autograph.stats(g)["replays"] >= 2

    o = _Ordered()
    h = autograph.graphed(o)
    with torch.no_grad():
        x, k = torch.randn(2, 4), torch.rand(2, 4)
        torch.testing.assert_close(h(x, mask=k), o(x, mask=k))
        original = _Ordered.forward
        _Ordered.forward = lambda self, *args, **kw: self.lin(args[0]) + kw.get("mask", 0)
        try:
            for _ in range(5):
                x, k = torch.randn(2, 4), torch.rand(2, 4)
                torch.testing.assert_close(h(x, mask=k), o(x, mask=k))
        finally:
            _Ordered.forward = original


class _PlusOne(torch.overrides.TorchFunctionMode):
    """A user's function mode that changes what a matmul returns."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return out + 1 if func is torch.matmul else out


def _project(x, w):
    return torch.matmul(x, w).relu()


def check_function_modes_are_keyed(device: str = "cpu") -> None:
    """A graph captured under a user's ``TorchFunctionMode`` replayed its effect after
    the mode was gone, and one captured without it ignored it; a device context
    (``with torch.device(...)``) was not keyed either (shared with tests/gpu)."""
    g = autograph.graphed(_project)
    mode = _PlusOne()
    w = torch.randn(4, 4, device=device)
    with torch.no_grad():
        for phase in range(3):
            for _ in range(4):
                x = torch.randn(2, 4, device=device)
                if phase == 1:
                    with mode:
                        got = g(x, w)
                    with mode:
                        want = _project(x, w)
                else:
                    got, want = g(x, w), _project(x, w)
                torch.testing.assert_close(got, want, rtol=0, atol=0)
        made = autograph.graphed(lambda x: x + torch.arange(4, device=x.device))
        for _ in range(4):
            x = torch.randn(4, device=device)
            with torch.device("meta"):
                torch.testing.assert_close(made(x), x + torch.arange(4, device=device))
    assert autograph.stats(g)["replays"] >= 4, autograph.stats(g)


def test_function_modes_are_keyed(standin):
    check_function_modes_are_keyed()


def check_class_tensors_and_modules_are_guarded(device: str = "cpu") -> None:
    """A tensor or module a class holds, read through a classmethod's ``cls`` or a
    global class, rebound between calls: the graphs see it (only plain values were
    guarded: replays kept the old tensor and module)."""
    codebook = type("Codebook", (), {
        "table": torch.ones(4, 4, device=device),
        "proj": nn.Linear(4, 4).to(device),
        "encode": classmethod(autograph.graphed(lambda cls, x: cls.proj(x @ cls.table)))})

    def eager(x):
        return codebook.proj(x @ codebook.table)

    with torch.no_grad():
        for step in range(9):
            if step == 4:
                codebook.table = torch.full((4, 4), 3.0, device=device)
            if step == 6:
                codebook.proj = nn.Linear(4, 4).to(device)
            x = torch.randn(2, 4, device=device)
            torch.testing.assert_close(codebook.encode(x), eager(x))
    s = autograph.stats(codebook.encode)
    assert s["invalidations"] >= 2 and s["replays"] >= 1, s


def test_class_tensors_and_modules_are_guarded(standin):
    check_class_tensors_and_modules_are_guarded()


def check_running_statistics_written_under_inference_mode(device: str = "cpu") -> None:
    """Batch and instance norm in training mode called under ``inference_mode`` (where a
    mode sees the composite ``batch_norm``/``instance_norm``, whose schemas do not mark
    the running statistics as written) and under ``no_grad``: the statistics follow
    eager's call by call, and the calls replay."""
    import copy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8),
                          nn.Unflatten(1, (2, 4)),
                          nn.InstanceNorm1d(2, track_running_stats=True)).to(device).train()
    eager = copy.deepcopy(model)
    g = autograph.graphed(model)
    for ctx in (torch.inference_mode, torch.no_grad):
        for _ in range(6):
            x = torch.randn(4, 8, device=device)
            with ctx():
                torch.testing.assert_close(g(x), eager(x))
            for (name, got), want in zip(model.named_buffers(), eager.buffers()):
                torch.testing.assert_close(got, want, msg=name)
    assert autograph.stats(g)["replays"] >= 6, autograph.stats(g)


def test_running_statistics_written_under_inference_mode(standin):
    check_running_statistics_written_under_inference_mode()


def check_python_attributes_set_on_tensor_arguments(device: str = "cpu") -> None:
    """A call that sets a Python attribute on a tensor argument (``x.tag = ...``) runs
    eagerly: a replay would not set it on the next call's tensor."""

    def tag(x):
        x.tag = "seen"
        return x * 2

    g = autograph.graphed(tag)
    for _ in range(5):
        x = torch.randn(3, device=device)
        torch.testing.assert_close(g(x), x * 2)
        assert getattr(x, "tag", None) == "seen"
    assert autograph.stats(g)["eager_reasons"].get("assigns_attribute"), autograph.stats(g)


def test_python_attributes_set_on_tensor_arguments(standin):
    check_python_attributes_set_on_tensor_arguments()


class _Heads(nn.Module):
    def __init__(self):
        super().__init__()
        self.heads = nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Linear(4, 4)})

    def forward(self, x):
        for head in self.heads.values():
            x = head(x)
        return x


def check_containers_changed_in_place_are_seen(device: str = "cpu") -> None:
    """``Sequential.insert``, ``ModuleList.insert``, ``ModuleDict.clear`` and ``del``
    write the submodules past ``__setattr__``: the graphs of the old layer stack were
    replayed.  Each change is seen; later calls replay the new stack."""
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(4, 4), nn.ReLU()).to(device)
    listed = nn.Sequential(nn.Linear(4, 4)).to(device)
    listed.blocks = nn.ModuleList([nn.Linear(4, 4)]).to(device)
    listed.forward = lambda x: listed.blocks[0](x) if len(listed.blocks) == 1 else \
        listed.blocks[1](listed.blocks[0](x))
    heads = _Heads().to(device)
    changes = [
        (seq, lambda: seq.insert(0, nn.Linear(4, 4).to(device))),
        (listed, lambda: listed.blocks.insert(0, nn.Linear(4, 4).to(device))),
        (heads, lambda: heads.heads.__delitem__("a")),
        (heads, lambda: heads.heads.clear()),
    ]
    x = torch.randn(2, 4, device=device)
    with torch.no_grad():
        for model, change in changes:
            g = autograph.graphed(model)
            for _ in range(4):
                torch.testing.assert_close(g(x), model(x))
            change()
            for _ in range(4):
                with autograph.disabled():
                    want = model(x)
                torch.testing.assert_close(g(x), want)
            assert autograph.stats(g)["replays"] >= 2, autograph.stats(g)


def test_containers_changed_in_place_are_seen(standin):
    check_containers_changed_in_place_are_seen()


def check_global_hooks_registered_through_any_name_are_seen(device: str = "cpu") -> None:
    """A global module forward (pre-)hook registered after capture through a name
    imported before autograph wrapped the registration functions: the calls run
    eagerly while it is registered (replays skipped it), and replay once removed."""
    from torch.nn.modules import module as mm

    registrations = [mm.__dict__["register_module_forward_hook"],
                     mm.__dict__["register_module_forward_pre_hook"]]
    # the unwrapped functions, as a name imported early holds them
    registrations = [getattr(r, "__wrapped__", r) for r in registrations]
    hooks = [lambda mod, args, out: out * 2, lambda mod, args: (args[0] * 3,)]
    model = nn.Linear(4, 4).to(device).eval()
    x = torch.randn(2, 4, device=device)
    for register, hook in zip(registrations, hooks):
        g = autograph.graphed(model)
        with torch.no_grad():
            for _ in range(4):
                torch.testing.assert_close(g(x), model(x))
            handle = register(hook)
            try:
                for _ in range(2):
                    got = g(x)
                    with autograph.disabled():
                        torch.testing.assert_close(got, model(x))
            finally:
                handle.remove()
            for _ in range(2):
                torch.testing.assert_close(g(x), model(x))
        s = autograph.stats(g)
        assert s["eager_reasons"].get("hooks") == 2 and s["replays"] >= 3, s
        autograph.reset(g)


def test_global_hooks_registered_through_any_name_are_seen(standin):
    check_global_hooks_registered_through_any_name_are_seen()


def check_global_backward_hooks_registered_through_any_name_are_seen(device="cpu"):
    """A global module backward (pre-)hook registered after capture through a name
    imported before autograph wrapped the registration functions: training replays
    (a graphed model's, a whole step's) skipped it, so gradients differed from eager's.
    The calls run eagerly while it is registered, and replay once it is removed."""
    from torch.nn.modules import module as mm

    registrations = [mm.__dict__["register_module_full_backward_hook"],
                     mm.__dict__["register_module_full_backward_pre_hook"]]
    registrations = [getattr(r, "__wrapped__", r) for r in registrations]
    hooks = [lambda mod, gi, go: tuple(torch.zeros_like(t) for t in gi)
             if isinstance(mod, nn.ReLU) else None,
             lambda mod, go: tuple(g * 3 for g in go) if isinstance(mod, nn.ReLU) else None]
    for whole_step in (False, True):
        for register, hook in zip(registrations, hooks):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).to(device)
            twin = copy.deepcopy(model)

            def step(m, x):
                m.zero_grad(set_to_none=False)
                m(x).sum().backward()
                return torch.stack([p.grad.sum() for p in m.parameters()])

            g = autograph.graphed(functools.partial(step, model) if whole_step else model)
            for i in range(12):
                x = torch.randn(3, 4, device=device, requires_grad=i % 2 == 0)
                handle = register(hook) if i == 8 else None
                try:
                    got = g(x) if whole_step else step(g, x)
                    with autograph.disabled():
                        torch.testing.assert_close(got, step(twin, x))
                finally:
                    if handle is not None:
                        handle.remove()
            s = autograph.stats(g)
            details = s["eager_details"]["backward_unsupported"]
            assert details["global module backward hooks are registered"] == 1, s
            assert s["replays"] >= 3, s


def check_backward_hooks_leave_calls_autograd_does_not_record(device="cpu"):
    """A frozen model called under grad mode (nothing requires grad: autograd records
    nothing, so no backward hook can fire) replays while backward hooks, global or on
    its modules, are registered."""
    from torch.nn.modules import module as mm

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU()).to(device).requires_grad_(False)
    g = autograph.graphed(model)
    handles = [mm.register_module_full_backward_hook(lambda *a: None),
               model[0].register_full_backward_hook(lambda *a: None)]
    try:
        for _ in range(6):
            x = torch.randn(2, 4, device=device)
            torch.testing.assert_close(g(x), model(x))
    finally:
        for handle in handles:
            handle.remove()
    s = autograph.stats(g)
    assert s["replays"] >= 3 and "backward_unsupported" not in s["eager_reasons"], s


def test_backward_hooks_leave_calls_autograd_does_not_record(standin):
    check_backward_hooks_leave_calls_autograd_does_not_record()


def test_global_backward_hooks_registered_through_any_name_are_seen(standin):
    check_global_backward_hooks_registered_through_any_name_are_seen()


def test_hook_registrations_bound_before_the_first_graphed_call_are_seen(tmp_path):
    """``register = nn.Module.register_forward_hook`` bound after ``import autograph``
    and before the first graphed module: the wrappers that report registrations were
    installed at the first watched module, so a hook registered through the bound
    function after capture was skipped by replays.  They are installed at import."""
    import subprocess
    import sys

    code = """if True:
        import torch, autograph
        from torch import nn
        from autograph.capture import use_backend
        from tests.standin import StandinBackend
        register = nn.Module.register_forward_hook
        use_backend(StandinBackend())
        m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)).eval()
        g = autograph.graphed(m)
        x = torch.randn(2, 4)
        with torch.no_grad():
            for _ in range(4):
                g(x)
            register(m[2], lambda mod, args, out: torch.full_like(out, 7.0))
            print(g(x).tolist(), autograph.stats(g)["replays"])
    """
    root = str(__import__("pathlib").Path(__file__).resolve().parents[1])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=root, timeout=300, env={**__import__("os").environ,
                                                     "PYTHONPATH": root})
    assert out.returncode == 0, out.stderr
    values, replays = out.stdout.strip().rsplit(" ", 1)
    assert values == str([[7.0, 7.0], [7.0, 7.0]]) and int(replays) >= 1, out.stdout


def check_python_attributes_set_on_outputs_and_parameters(device: str = "cpu") -> None:
    """A call that tags an output it makes (``y.tag = ...``) or counts on a parameter
    (``w.calls += 1``) runs eagerly: replays handed out untagged copies and skipped the
    count."""

    def tag(x):
        y = x * 2
        y.tag = "made"
        return y

    lin = nn.Linear(3, 3).to(device)
    lin.weight.calls = 0

    def count(x):
        lin.weight.calls += 1
        return lin(x)

    for fn in (tag, count):
        g = autograph.graphed(fn)
        with torch.no_grad():
            for _ in range(5):
                out = g(torch.randn(2, 3, device=device))
                assert fn is not tag or out.tag == "made"
        assert autograph.stats(g)["replays"] == 0, autograph.stats(g)
    assert lin.weight.calls == 5


def test_python_attributes_set_on_outputs_and_parameters(standin):
    check_python_attributes_set_on_outputs_and_parameters()


def check_sparse_and_nested_outputs_run_eagerly(device: str = "cpu") -> None:
    """A call returning a sparse or nested tensor runs eagerly (`unsupported_output`):
    building its outputs at the capture raised from autograph's own code."""
    fns = [lambda x: x.to_sparse(), lambda x: (x * 2, x.to_sparse_csr()),
           lambda x: torch.nested.as_nested_tensor([x, x[:2]])]
    for fn in fns:
        g = autograph.graphed(fn)
        with torch.no_grad():
            for _ in range(5):
                x = torch.randn(4, 4, device=device).relu()
                got, want = g(x), fn(x)
                for a, b in zip(pytree.tree_leaves(got), pytree.tree_leaves(want)):
                    if a.is_nested:
                        a, b = a.to_padded_tensor(0.0), b.to_padded_tensor(0.0)
                    torch.testing.assert_close(a.to_dense(), b.to_dense())
        assert autograph.stats(g)["eager_reasons"].get("unsupported_output"), autograph.stats(g)


def test_sparse_and_nested_outputs_run_eagerly(standin):
    check_sparse_and_nested_outputs_run_eagerly()


def test_the_memory_parts_of_sparse_outputs_are_found():
    """A warmup's outputs are recorded on the caller's stream (``after_warmup``);
    sparse tensors have no ``record_stream`` of their own (on CUDA it raised from a
    warmup whose call returned one), so their indices and values are recorded."""
    from autograph.capture import _parts

    x = torch.randn(3, 3).relu()
    assert [p.shape for p in _parts(x.to_sparse())] == [x.to_sparse()._indices().shape,
                                                         x.to_sparse()._values().shape]
    assert len(_parts(x.to_sparse_csr())) == 3
    assert _parts(torch.nested.as_nested_tensor([x, x[:2]])) == []  # no parts: skipped


def test_a_call_leaving_a_flag_changed_runs_once_per_call(standin):
    """A function that sets a process-wide flag and leaves it set (the caller puts it
    back between calls) was captured, dropped ("the modes changed while it was
    captured") and run again on every call: its Python ran twice per call.  It runs
    eagerly, once per call, with a reason."""
    runs = []

    def f(x):
        runs.append(1)
        torch.set_float32_matmul_precision("high")
        return x @ x

    g = autograph.graphed(f)
    try:
        with torch.no_grad():
            for i in range(8):
                torch.set_float32_matmul_precision("highest")
                x = torch.randn(3, 3)
                torch.testing.assert_close(g(x), x @ x)
                assert len(runs) == i + 1
    finally:
        torch.set_float32_matmul_precision("highest")
    s = autograph.stats(g)
    assert s["captures"] == 0 and s["eager_reasons"].get("assigns_attribute"), s


def test_the_wrappers_forward_is_the_modules(standin):
    """``wrapper.forward`` is the module's own (a first version graphed it: a forward
    patched on the wrapper, as accelerate's hooks do, was ignored, and the Trainer's
    signature check saw ``(*args, **kwargs)`` and dropped every batch key)."""
    import inspect

    lin = nn.Linear(4, 3)
    g = autograph.graphed(lin)
    assert inspect.signature(g.forward) == inspect.signature(lin.forward)
    original = g.forward
    g.forward = lambda x: original(x) + 1
    with torch.no_grad():
        for _ in range(5):
            x = torch.randn(2, 4)
            torch.testing.assert_close(g(x), lin.weight.new_ones(1) + nn.functional.linear(
                x, lin.weight, lin.bias))



class _Recurrent(nn.Module):
    """A policy with a hidden state and a ``reset`` of its own (episode starts)."""

    def __init__(self):
        super().__init__()
        self.cell = nn.GRUCell(4, 8)
        self.register_buffer("h", torch.zeros(3, 8))

    def reset(self, done=None):
        if done is None:
            self.h.zero_()
        else:
            self.h.mul_(1 - done[:, None])

    def forward(self, x):
        self.h.copy_(self.cell(x, self.h))
        return self.h * 2


def check_a_modules_own_reset_is_not_hidden_by_the_wrapper(device="cpu"):
    """``graphed(policy).reset()`` dropped the graphs instead of running the policy's
    own ``reset`` (its hidden state carried into the next episode), and ``reset(done)``
    raised.  The module's ``reset`` runs; ``autograph.reset(wrapper)`` drops graphs."""
    torch.manual_seed(0)
    eager = _Recurrent().to(device)
    g = autograph.graphed(copy.deepcopy(eager))
    with torch.no_grad():
        for episode in range(3):
            done = torch.tensor([1.0, 0.0, 1.0], device=device)
            args = (done,) if episode == 2 else ()
            eager.reset(*args)
            g.reset(*args)
            for _ in range(4):
                x = torch.randn(3, 4, device=device)
                torch.testing.assert_close(g(x), eager(x))
            torch.testing.assert_close(g.h, eager.h)
    s = autograph.stats(g)
    assert s["replays"] >= 6 and s["invalidations"] == 0, s
    autograph.reset(g)
    assert autograph.stats(g)["graphs"] == 0
    plain = autograph.graphed(nn.Linear(2, 2).to(device))
    plain.reset()  # no reset of its own: drops the graphs
    plain.reset = 5  # set and deleted on the module, as eager sets it
    assert plain.reset == 5 and plain.__wrapped__.reset == 5
    del plain.reset
    assert not hasattr(plain.__wrapped__, "reset")


def test_a_modules_own_reset_is_not_hidden_by_the_wrapper(standin):
    check_a_modules_own_reset_is_not_hidden_by_the_wrapper()


class _Configured(nn.Module):
    """A module with config attributes named as ``nn.Module`` methods."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.type = "relu"
        self.scale = 0.5

    def forward(self, x):
        y = self.lin(x) * self.scale
        return y.relu() if self.type == "relu" else y.tanh()


def _nested_forward(modules, x):
    return modules[0][0](x) * 2


class _Runner:
    def __init__(self, module):
        self.module = module

    def run(self, x):
        return self.module(x) - 1


class _SlottedRunner(_Runner):
    __slots__ = ("module",)


def check_the_wrapper_is_the_module_for_attributes_and_bound_forwards(device="cpu"):
    """``wrapper.type`` (an attribute named as a module method the wrapper returns
    itself from) is the module's, read, set and deleted; a ``forward`` set on the
    instance to another module's bound forward (or a partial over it) watches that
    module too; a bound method the module stores comes back unrouted (accelerate puts
    ``_old_forward`` back as ``forward``: it must not hold the wrapper)."""
    import functools

    torch.manual_seed(0)
    m, other = _Configured().to(device), _Configured().to(device)
    twin, other_twin = copy.deepcopy(m), copy.deepcopy(other)
    g = autograph.graphed(m)
    assert g.type == "relu" and g.to(device) is g
    with torch.no_grad():
        for i in range(56):
            if i == 5:
                g.type = twin.type = "tanh"
                assert m.type == "tanh"
            if i == 10:
                m.forward = other.forward
                twin.forward = other_twin.forward
            if i == 18:
                m.forward = functools.partial(_Configured.forward, other)
                twin.forward = functools.partial(_Configured.forward, other_twin)
            if i == 26:  # deeper: a nested list, a lambda's closure
                m.forward = functools.partial(_nested_forward, [[other]])
                twin.forward = functools.partial(_nested_forward, [[other_twin]])
            if i == 34:
                m.forward = lambda x: other(x) + 1  # noqa: B023 - the loop's own
                twin.forward = lambda x: other_twin(x) + 1  # noqa: B023
            if i == 42:  # a plain object's method, the module its attribute
                m.forward = _Runner(other).run
                twin.forward = _Runner(other_twin).run
            if i == 50:  # a slotted object's
                m.forward = _SlottedRunner(other).run
                twin.forward = _SlottedRunner(other_twin).run
            if i in (14, 22, 30, 38, 46, 54):
                other.scale = other_twin.scale = i / 4
            x = torch.randn(2, 4, device=device)
            torch.testing.assert_close(g(x), twin(x))
    s = autograph.stats(g)
    assert s["replays"] >= 14 and s["invalidations"] == 13, s
    del g.type
    assert "type" not in vars(m) and g.type(torch.float32) is g  # the method again
    g.stored = m.lin.forward  # a bound method stored on the module
    assert g.stored == m.lin.forward
    m.kept = _Configured.forward.__get__(m)  # stored, as accelerate's _old_forward
    assert g.kept.__func__ is _Configured.forward and g.kept.__self__ is m


def test_the_wrapper_is_the_module_for_attributes_and_bound_forwards(standin):
    check_the_wrapper_is_the_module_for_attributes_and_bound_forwards()


def check_a_mask_assignment_replays(device="cpu"):
    """``h[~mask] = 0`` (wav2vec2's encoder with an attention mask) is a
    ``masked_fill_`` to ATen, no host read: it is captured and replays."""
    @autograph.graphed
    def masked(h, mask):
        h = h * 2
        h[~mask] = 0
        return h

    for _ in range(6):
        h = torch.randn(2, 5, 3, device=device)
        mask = torch.rand(2, 5, device=device) > 0.5
        want = h * 2
        want[~mask] = 0
        torch.testing.assert_close(masked(h, mask), want)
    s = autograph.stats(masked)
    assert s["replays"] >= 3, s


def test_a_mask_assignment_replays(standin):
    check_a_mask_assignment_replays()


def check_ctc_loss_with_host_lengths_equals_eager(device="cpu"):
    """``CTCLoss(reduction="mean")`` with Python lengths: ATen fills their tensor with a
    host copy no operator shows (``at::tensor(list)``); a replay must not rerun the
    allocation over it (the stand-in did) and the losses equal eager's."""
    loss = autograph.graphed(nn.CTCLoss(reduction="mean"))
    for _ in range(6):
        logp = torch.randn(12, 2, 5, device=device).log_softmax(-1)
        targets = torch.randint(1, 5, (2, 4), device=device)
        args = (logp, targets, [12, 10], [4, 3])
        with torch.no_grad():
            torch.testing.assert_close(loss(*args), nn.functional.ctc_loss(*args))
    if device == "cpu":
        assert autograph.stats(loss)["replays"] >= 3, autograph.stats(loss)


def test_ctc_loss_with_host_lengths_equals_eager(standin):
    check_ctc_loss_with_host_lengths_equals_eager()


class _Tripled(torch.autograd.Function):
    """Keeps an object on ``ctx``: a call made while its backward is pending waits."""

    @staticmethod
    def forward(ctx, x):
        ctx.note = object()
        return x * 3

    @staticmethod
    def backward(ctx, grad):
        return grad * 3


class _TripledNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return _Tripled.apply(self.lin(x))


def _verified_runs(verify_every, scenario):
    """The counters of one scenario run with ``verify_every``."""
    autograph.reset()
    torch.manual_seed(0)
    if scenario == "failed replay":  # a weight given another shape in place
        net = nn.Linear(8, 4).eval()
        g = autograph.graphed(net, verify_every=verify_every)
        with torch.no_grad():
            for _ in range(4):
                g(torch.randn(3, 8))
            net.weight.data, net.bias.data = net.weight.data[:2], net.bias.data[:2]
            assert g(torch.randn(3, 8)).shape == (3, 2)
    elif scenario == "held":  # a call made while a backward is pending
        g = autograph.graphed(_TripledNet(), verify_every=verify_every)
        for _ in range(8):
            a, b = g(torch.randn(4, 8)), g(torch.randn(4, 8))
            (a.sum() + b.sum()).backward()
    else:  # least recently used: the hot key replayed, verified, is kept
        g = autograph.graphed(nn.Linear(8, 4).eval(), max_graphs=2,
                              verify_every=verify_every)
        with torch.no_grad():
            for rows in [3] * 4 + [5] * 4:
                g(torch.randn(rows, 8))
            for _ in range(12):
                g(torch.randn(3, 8))
                g(torch.randn(7, 8))
    s = autograph.stats(g)
    assert s["calls"] == s["replays"] + s["captures"] + s["eager"], s
    return {k: s[k] for k in ("replays", "captures", "evictions", "eager", "eager_reasons")}


@pytest.mark.parametrize("scenario", ["failed replay", "held", "least recently used"])
def test_verified_replays_fail_wait_and_count_as_unverified_ones(standin, scenario):
    """``verify_every`` checks a replay that runs: one that fails ran eagerly only
    unverified (verified, it raised), one held back by a pending backward was counted
    as a verify failure (its key made eager), and verified replays did not mark their
    entry used (the least recently used went first) or the keys as repeating."""
    assert _verified_runs(1, scenario) == _verified_runs(None, scenario)
