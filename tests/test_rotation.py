"""Outputs without a host copy in the default mode (rotation.py): a call's output comes
from one of two buffers that later graphs of the key copy into, and a buffer an
earlier output still holds (the tensor, a view, its storage object, in a list) is
never written again while it is held.  Proved on the CPU stand-in, whose replay
writes its captured buffers in place as a real graph does; the checks are shared
with tests/gpu/test_rotation_cuda.py, where ``lent`` counts allocations instead."""

import gc
import threading

import pytest
import torch
from torch import nn

import autograph


def mlp(device="cpu"):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(device)


def variant_replays(standin):
    """Replays of the graphs captured after the first of one key (the variants), less
    the one each gets at its capture (checked against the key's graph)."""
    graphs = [ref() for ref in standin.graphs]
    return sum(g.replays - 1 for g in graphs[1:] if g is not None)


def calls(g, model, xs, keep):
    """Call ``g`` on each input the way a loop does (``keep``): every output checked
    against eager at the end, after all the calls that could have overwritten it."""
    kept, expect, y = [], [], None
    for x in xs:
        y = g(x)  # the previous output is still bound while this call runs
        expect.append(model(x))
        if keep == "all":
            kept.append(y)
        elif keep == "view":
            kept.append(y[1:].t())
            expect[-1] = expect[-1][1:].t()
        elif keep == "storage":
            kept.append(y.untyped_storage())
            del y
            y = None
        else:
            kept, expect = [y], [expect[-1]]
    for got, want in zip(kept, expect):
        if isinstance(got, torch.UntypedStorage):
            got = torch.empty(0, device=want.device).set_(got).view(want.shape)
        torch.testing.assert_close(got, want)
    return kept


def check_rebinding_loop(device, lent):
    """``lent(call)``: the call's result and whether it came from a variant's buffer."""
    model = mlp(device)
    g = autograph.graphed(model, warmup=1)
    xs = [torch.randn(3, 8, device=device) for _ in range(12)]
    with torch.no_grad():
        want = [model(x) for x in xs]
        y = previous = None
        served = 0
        for i, x in enumerate(xs):
            y, from_buffer = lent(lambda x=x: g(x))  # the previous output is still bound
            served += from_buffer
            if previous is not None:  # not written by the call made while it was held
                torch.testing.assert_close(previous, want[i - 1])
            torch.testing.assert_close(y, want[i])
            previous = y
    assert served >= len(xs) - 4  # outputs from the variants' buffers, not clones
    s = autograph.stats(g)
    assert s["replays"] == len(xs) - 2 and s["captures"] == 1


def check_held_outputs_are_never_written(device, keep):
    model = mlp(device)
    g = autograph.graphed(model, warmup=1)
    xs = [torch.randn(3, 8, device=device) for _ in range(10)]
    with torch.no_grad():
        calls(g, model, xs[:3], "last")
        calls(g, model, xs[3:], keep)  # every held output equals its eager result
    assert autograph.stats(g)["replays"] == len(xs) - 2


def check_alternating_keys(device):
    """Two keys whose outputs are held across each other's replays."""
    model = mlp(device)
    g = autograph.graphed(model, warmup=1)
    with torch.no_grad():
        for _ in range(3):
            for rows in (2, 5):
                g(torch.randn(rows, 8, device=device))
        held = []
        for _ in range(4):
            for rows in (2, 5):
                x = torch.randn(rows, 8, device=device)
                held.append((g(x), model(x)))
                if len(held) > 2:
                    held.pop(0)
                for got, want in held:
                    torch.testing.assert_close(got, want)
    assert autograph.stats(g)["replays"] >= 10


def check_state_the_code_names_is_written_once_per_call(device, verify_every=None):
    """A tensor the function names (a global, a closure's, a plain object's ``self.k``)
    and writes in place is written once per call, as in eager mode: no output variant
    (whose check replays the graphs once more), no second write by a verified replay."""
    count = torch.zeros(4, device=device)

    def step(x):
        count.add_(1)
        return x * 2 + count

    class Cache:  # no module: its tensor is named by the code (``self.k``)
        def __init__(self):
            self.k = torch.zeros(4, device=device)

        @autograph.graphed(warmup=1, verify_every=verify_every)
        def add(self, x):
            self.k.add_(x)
            return self.k * 1

    g = autograph.graphed(step, warmup=1, verify_every=verify_every)
    cache = Cache()
    with torch.no_grad():
        for i in range(8):
            x = torch.full((4,), float(i), device=device)
            torch.testing.assert_close(g(x), x * 2 + i + 1)
            torch.testing.assert_close(cache.add(torch.ones(4, device=device)),
                                       torch.full((4,), i + 1.0, device=device))
    assert count.tolist() == [8.0] * 4 and cache.k.tolist() == [8.0] * 4
    s = autograph.stats(g)
    assert s["replays"] == 6 and s["verify_failures"] == 0, s


def check_outputs_match_eager_mode(device):
    """Inference tensors where eager gives them, a result the caller may write."""
    model = mlp(device)
    g = autograph.graphed(model, warmup=1)
    x = torch.randn(3, 8, device=device)
    with torch.inference_mode():
        outs = [g(x) for _ in range(6)]
        assert all(o.is_inference() for o in outs)
    with torch.no_grad():
        for _ in range(6):
            y = g(x)
            assert not y.is_inference() and not y.requires_grad
            y.add_(1)  # the caller's own: the next call is unaffected
        torch.testing.assert_close(g(x), model(x))
    assert autograph.stats(g)["replays"] == 4 + 5  # not eager: two keys replayed


def test_rebinding_loop_alternates_two_buffers(standin):
    def lent(call):
        before = variant_replays(standin)
        out = call()
        return out, variant_replays(standin) > before

    check_rebinding_loop("cpu", lent)
    assert standin.captures == 3  # the key's graph and its two variants


@pytest.mark.parametrize("keep", ["all", "view", "storage"])
def test_held_outputs_are_never_written(standin, keep):
    check_held_outputs_are_never_written("cpu", keep)


def test_alternating_keys_keep_their_outputs(standin):
    check_alternating_keys("cpu")


def test_outputs_are_inference_tensors_where_eager_gives_them(standin):
    check_outputs_match_eager_mode("cpu")


def test_a_dropped_output_frees_its_buffer_for_the_next_call(standin):
    model = mlp()
    g = autograph.graphed(model, warmup=1)
    with torch.no_grad():
        for _ in range(8):
            x = torch.randn(3, 8)
            torch.testing.assert_close(g(x), model(x))  # dropped at once
    assert standin.captures == 2  # one variant is enough
    assert variant_replays(standin) == 8 - 2  # all but the warmup and the capture


def test_outputs_with_nan_keep_their_variants(standin):
    """A variant whose output holds NaN (a log of a negative) agrees with the key's
    graph: NaN equals NaN there (``torch.equal`` said otherwise, and every call cloned)."""
    def f(x):
        return (x - 0.5).log()

    g = autograph.graphed(f, warmup=1)
    with torch.no_grad():
        for _ in range(8):
            x = torch.rand(3, 8)
            torch.testing.assert_close(g(x), f(x), equal_nan=True)
    assert standin.captures == 2  # the key's graph and one variant
    assert variant_replays(standin) == 8 - 2


def test_a_variant_that_fails_to_capture_leaves_clones(standin):
    model = mlp()
    g = autograph.graphed(model, warmup=1)
    with torch.no_grad():
        for _ in range(2):  # warmup, capture
            g(torch.randn(3, 8))
        standin.fail_next = RuntimeError("no variant")  # the first variant's capture
        held = []
        for _ in range(5):
            x = torch.randn(3, 8)
            held.append((g(x), model(x)))
        for got, want in held:
            torch.testing.assert_close(got, want)
    assert standin.captures == 1 and variant_replays(standin) == 0
    assert autograph.stats(g)["replays"] == 5


def test_no_variants_for_graphs_that_draw_write_or_keep_several_outputs(standin):
    pairs = nn.Linear(8, 4)
    g = autograph.graphed(lambda x: (pairs(x), pairs(x) * 2), warmup=1)
    noisy = autograph.graphed(lambda x: x + torch.rand_like(x), warmup=1)
    with torch.no_grad():
        for _ in range(5):
            g(torch.randn(3, 8))
            noisy(torch.randn(3, 8))
    assert standin.captures == 2


@pytest.mark.parametrize("verify_every", [None, 2])
def test_state_the_code_names_is_written_once_per_call(standin, verify_every):
    check_state_the_code_names_is_written_once_per_call("cpu", verify_every)


def test_threads_never_share_a_held_buffer(standin):
    model = mlp()
    g = autograph.graphed(model, warmup=1)
    errors = []

    def work(seed):
        gen = torch.Generator().manual_seed(seed)
        try:
            with torch.no_grad():
                held = []
                for _ in range(30):
                    x = torch.randn(3, 8, generator=gen)
                    held.append((g(x), model(x)))
                    held = held[-3:]
                    for got, want in held:
                        torch.testing.assert_close(got, want)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert autograph.stats(g)["replays"] > 0


def test_warmup_captures_the_variants_before_traffic(standin):
    model = mlp()
    g = autograph.graphed(model, warmup=1)
    with torch.no_grad():
        autograph.warmup(g, torch.randn(3, 8))
        assert standin.captures == 3  # the graph and both variants, under its modes
        y = None
        for _ in range(6):
            x = torch.randn(3, 8)
            y = g(x)  # the last output is held during the call: the other buffer
            torch.testing.assert_close(y, model(x))
    assert standin.captures == 3 and variant_replays(standin) == 6


def test_an_expanded_output_is_cloned_as_before(standin):
    g = autograph.graphed(lambda x: (x * 2).sum(0, keepdim=True).expand(4, 8), warmup=1)
    with torch.no_grad():
        for _ in range(5):
            x = torch.randn(3, 8)
            torch.testing.assert_close(g(x), (x * 2).sum(0, keepdim=True).expand(4, 8))
    assert standin.captures == 1 and autograph.stats(g)["replays"] == 3


def test_a_large_output_is_cloned_as_before(standin, monkeypatch):
    monkeypatch.setattr("autograph.rotation.MAX_BYTES", 3 * 4 * 4 - 1)  # under 3x4 fp32
    model = mlp()
    g = autograph.graphed(model, warmup=1)
    with torch.no_grad():
        for _ in range(5):
            x = torch.randn(3, 8)
            torch.testing.assert_close(g(x), model(x))
    assert standin.captures == 1 and autograph.stats(g)["replays"] == 3


def test_variants_are_freed_without_a_collection(standin):
    """A runner that called itself again after capturing a variant made a cycle (the
    function and its own closure cell) that kept every graph of the key alive until
    the garbage collector ran (on CUDA, maybe during a user's own capture)."""

    def used() -> list:
        model = mlp()
        g = autograph.graphed(model, warmup=1)
        with torch.no_grad():
            y = None
            for _ in range(6):
                y = g(torch.randn(3, 8))  # held during the next call: both variants
        del y
        return [ref for ref in standin.graphs if ref() is not None]

    used()  # the first capture's lazy imports leave garbage of their own
    gc.collect()
    standin.graphs.clear()
    gc.disable()
    try:
        graphs = used()
        assert len(graphs) == 3
        assert all(ref() is None for ref in graphs)  # freed when the caller drops them
    finally:
        gc.enable()


def test_a_variant_that_differs_from_the_keys_graph_ends_the_rotation(standin):
    """State no guard sees (a value inside a dict the forward reads) changed between
    the key's capture and a variant's: the variant would alternate with the key's
    graph, so it is dropped and the key's graph serves every call (stale as before)."""
    cfg = {"scale": 1.0}
    g = autograph.graphed(lambda x: x * cfg["scale"], warmup=1)
    x = torch.randn(4)
    with torch.no_grad():
        g(x), g(x)  # warmup, capture
        cfg["scale"] = 2.0
        outs = [g(x) for _ in range(6)]
    assert all(torch.equal(o, outs[0]) for o in outs)  # one value, not two alternating
    assert standin.captures == 2 and variant_replays(standin) == 0


@pytest.mark.parametrize("how", ["storage", "tensor"])
def test_a_resized_output_ends_the_rotation(standin, how):
    """A caller that frees an output's memory (``untyped_storage().resize_(0)``) or
    grows it in place moves the buffer a variant writes: never replayed again."""
    model = mlp()
    g = autograph.graphed(model, warmup=1)
    with torch.no_grad():
        for i in range(8):
            x = torch.randn(3, 8)
            y = g(x)
            torch.testing.assert_close(y, model(x))
            if i == 3:
                if how == "storage":
                    y.untyped_storage().resize_(0)
                else:
                    y.resize_(64, 64)
            del y
    assert autograph.stats(g)["replays"] == 6
    before = variant_replays(standin)
    with torch.no_grad():
        g(torch.randn(3, 8))
    assert variant_replays(standin) == before  # clones from the key's graph now


def test_an_output_fed_back_in_is_never_written_while_read(standin):
    """``h = g(h)``: the argument is the previous output (held by the call itself)."""
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    g = autograph.graphed(lambda h: torch.tanh(lin(h)), warmup=1)
    h = want = torch.randn(3, 8)
    history = []
    with torch.no_grad():
        for _ in range(10):
            h, want = g(h), torch.tanh(lin(want))
            history.append((h, want.clone()))
            torch.testing.assert_close(h, want)
    for got, expect in history:  # every output kept, unchanged by the calls after it
        torch.testing.assert_close(got, expect)
    assert autograph.stats(g)["replays"] == 8 and variant_replays(standin) > 0


@pytest.mark.parametrize("how", ["dlpack", "parameter", "closure", "swap"])
def test_other_ways_of_holding_an_output(standin, how):
    model = mlp()
    g = autograph.graphed(model, warmup=1)
    with torch.no_grad():
        for _ in range(3):
            g(torch.randn(3, 8))
        x = torch.randn(3, 8)
        want = model(x)
        y = g(x)
        if how == "dlpack":
            held = torch.utils.dlpack.to_dlpack(y)
        elif how == "parameter":
            held = nn.Parameter(y, requires_grad=False)
        elif how == "closure":
            held = (lambda t: lambda: t)(y)
        else:
            held = torch.zeros(3, 4)
            torch.utils.swap_tensors(held, y)  # ``held`` now holds the output's memory
        del y
        for _ in range(4):
            z = torch.randn(3, 8)
            torch.testing.assert_close(g(z), model(z))
        kept = {"dlpack": lambda: torch.utils.dlpack.from_dlpack(held),
                "parameter": lambda: held, "closure": lambda: held(),
                "swap": lambda: held}[how]()
        torch.testing.assert_close(kept, want)
    assert variant_replays(standin) >= 4
