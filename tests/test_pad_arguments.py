"""Buckets in serving (issue 16), on the CPU stand-in: per-argument options resolve
alike by name and position, ``pad_writes`` keeps a slot-cache decode step padded, and
padded calls write into persistent buffers."""

import threading

import pytest
import torch
from torch import nn

import autograph
from autograph import padding
from autograph.lookup import handle_of

from .serving import BUCKETS, DUMMY, SlotDecoder, assert_same_outside_dummy, serve, warm

pytestmark = pytest.mark.usefixtures("standin")


# -- names and positions --------------------------------------------------------------
def write_rows(x, slots, cache):
    cache[slots] = x  # padded rows write where their slot id says
    return x * 2


def check_padding(g, call, n_calls=6):
    """Calls of 3 rows, padded to 4: padded rows must carry slot DUMMY, so slot 0 is never
    written and padding stays on with one graph."""
    cache = torch.zeros(DUMMY + 1, 2)
    with torch.no_grad():
        for i in range(n_calls):
            x = torch.full((3, 2), float(i + 1))
            out = call(g, x, torch.tensor([1, 2, 3]), cache)
            torch.testing.assert_close(out, x * 2)
    s = autograph.stats(g)
    assert s["padding"] is None, s["padding"]
    assert s["graphs"] == 1 and s["replays"] >= 2 and s["buckets"][4]["padded_rows"] > 0
    assert cache[0].eq(0).all() and cache[1:4].eq(n_calls).all()


CALLS = {
    "positional": lambda g, x, slots, cache: g(x, slots, cache),
    "keyword": lambda g, x, slots, cache: g(cache=cache, slots=slots, x=x),
    "mixed": lambda g, x, slots, cache: g(x, slots, cache=cache),
}
KEYS = {
    "by name": ({"slots": DUMMY}, {"cache": (0, DUMMY)}),
    "by position": ({1: DUMMY}, {2: (0, DUMMY)}),
}


@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("keys", KEYS)
def test_functions_resolve_names_and_positions_alike(call, keys):
    pads, writes = KEYS[keys]
    g = autograph.graphed(write_rows, buckets=[4], warmup=0, pad_values=pads,
                          pad_writes=writes)
    check_padding(g, CALLS[call])


@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("keys", KEYS)
def test_methods_skip_self(call, keys):
    pads, writes = KEYS[keys]

    class Server:
        @autograph.graphed(buckets=[4], warmup=0, pad_values=pads, pad_writes=writes)
        def step(self, x, slots, cache):
            return write_rows(x, slots, cache)

    server = Server()
    check_padding(server.step, lambda g, *a, **k: CALLS[call](server.step, *a, **k))


@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("keys", KEYS)
def test_modules_wrapped_and_in_regions(call, keys):
    pads, writes = KEYS[keys]

    class Step(nn.Module):
        def forward(self, x, slots, cache):
            return write_rows(x, slots, cache)

    g = autograph.graphed(Step(), buckets=[4], warmup=0, pad_values=pads, pad_writes=writes)
    check_padding(g, CALLS[call])

    m = Step()  # a region applies the options per module, by its forward's names

    def in_region(*args, **kwargs):
        with autograph.capture_region(buckets=[4], warmup=0, pad_values=pads,
                                      pad_writes=writes):
            return m(*args, **kwargs)

    check_padding(m, lambda g, *a, **k: CALLS[call](in_region, *a, **k))


@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("keys", KEYS)
@pytest.mark.parametrize("kind", ["classmethod", "staticmethod"])
def test_class_and_static_methods_resolve_names_and_positions(call, keys, kind):
    """A classmethod's per-argument options name the parameters after ``cls``, as a
    method's do after ``self`` (by name they were once resolved against nothing)."""
    pads, writes = KEYS[keys]
    decorate = autograph.graphed(buckets=[4], warmup=0, pad_values=pads, pad_writes=writes)

    class Server:
        if kind == "classmethod":
            @decorate
            @classmethod
            def step(cls, x, slots, cache):
                return write_rows(x, slots, cache)
        else:
            @decorate
            @staticmethod
            def step(x, slots, cache):
                return write_rows(x, slots, cache)

    check_padding(Server.step, CALLS[call])


def test_var_args_by_position_and_defaults_by_name():
    @autograph.graphed(buckets=[4], warmup=0, pad_values={1: DUMMY},
                       pad_writes={2: (0, DUMMY)})
    def star(*args):
        return write_rows(*args)

    check_padding(star, CALLS["positional"])

    def defaults(x, slots, cache, scale=2.0, h=None):
        out = write_rows(x, slots, cache) * scale / 2
        return out if h is None else out + h.t()

    h = torch.zeros(2, 3)  # batch in dim 1 (by name), passed by keyword
    for call in (lambda g, x, slots, cache: g(x, slots, cache),
                 lambda g, x, slots, cache: g(x, slots, cache, 2.0),
                 lambda g, x, slots, cache: g(x, slots, cache, h=h)):
        g = autograph.graphed(defaults, buckets=[4], warmup=0, pad_values={"slots": DUMMY},
                              pad_writes={"cache": (0, DUMMY)}, batch_dims={"h": 1})
        check_padding(g, call)


def test_pad_writes_keys_are_checked_against_the_signature():
    with pytest.raises(ValueError, match=r"pad_writes names 'kv'.*write_rows"):
        autograph.graphed(write_rows, pad_writes={"kv": (0, 1)})
    with pytest.raises(ValueError, match=r"pad_writes\['cache'\] must be a \(dim, index\)"):
        autograph.graphed(write_rows, pad_writes={"cache": 7})
    with pytest.raises(ValueError, match=r"index must be an int, a slice"):
        autograph.graphed(write_rows, pad_writes={"cache": (0, "x")})
    autograph.graphed(write_rows, pad_writes={"cache": (0, slice(8, None))})
    autograph.graphed(write_rows, pad_writes={"cache": (0, [7, 8])})


# -- pad_writes: the serving loop -----------------------------------------------------
def serving_step(**options):
    torch.manual_seed(0)
    model = SlotDecoder().eval()
    return model, autograph.graphed(model, buckets=BUCKETS, warmup=1, **options)


def test_slot_cache_serving_loop_keeps_its_buckets_with_pad_writes():
    model, step = serving_step(pad_values={"slot_ids": DUMMY},
                               pad_writes={"k_cache": (0, DUMMY), "v_cache": (0, DUMMY)})
    cache, ref = serve(step, model, model, "cpu")
    assert_same_outside_dummy(cache, ref)
    s = autograph.stats(step)
    assert s["padding"] is None
    assert s["graphs"] == s["captures"] == len(BUCKETS)  # one graph per bucket
    assert s["replays"] >= 40 and s["bucket_misses"] == 0
    assert sum(b["padded_rows"] for b in s["buckets"].values()) > 0


def test_after_warmup_the_serving_loop_captures_nothing():
    model, step = serving_step(pad_values={"slot_ids": DUMMY},
                               pad_writes={"k_cache": (0, DUMMY), "v_cache": (0, DUMMY)})
    cache = warm(step, model, "cpu")
    captured = autograph.stats(step)["captures"]
    assert captured == len(BUCKETS)
    cache, ref = serve(step, model, model, "cpu", cache=cache)
    assert_same_outside_dummy(cache, ref)
    s = autograph.stats(step)
    assert s["captures"] == captured and s["padding"] is None


def test_without_pad_writes_the_dummy_slot_write_turns_padding_off():
    model, step = serving_step(pad_values={"slot_ids": DUMMY})
    cache, ref = serve(step, model, model, "cpu", steps=30)
    assert_same_outside_dummy(cache, ref)
    assert "padded rows write into argument 'k_cache'" in autograph.stats(step)["padding"]


def test_a_write_outside_the_declared_region_still_turns_padding_off():
    # padded rows write the dummy slot, but the region declared is another one
    model, step = serving_step(pad_values={"slot_ids": DUMMY},
                               pad_writes={"k_cache": (0, 0), "v_cache": (0, 0)})
    cache, ref = serve(step, model, model, "cpu", steps=30)
    torch.testing.assert_close(cache, ref)  # padding off: exactly eager
    s = autograph.stats(step)
    assert "into argument 'k_cache' outside its pad_writes region" in s["padding"]


# -- persistent padded buffers --------------------------------------------------------
def test_padded_calls_allocate_no_padded_copy_after_the_first(monkeypatch):
    made = []
    real = padding.empty_in_layout
    monkeypatch.setattr(padding, "empty_in_layout", lambda t, s: made.append(s) or real(t, s))
    import autograph.padslots as padslots
    monkeypatch.setattr(padslots, "empty_in_layout", padding.empty_in_layout)

    @autograph.graphed(buckets=[8], warmup=1)
    def f(x, y):
        return x * y

    with torch.no_grad():
        for n in (8, 7, 7, 5, 6, 7, 3, 7, 5):
            x, y = torch.randn(n, 4), torch.randn(n, 4)
            torch.testing.assert_close(f(x, y), x * y)
        before = len(made)
        for n in (7, 5, 6, 3, 7):
            x, y = torch.randn(n, 4), torch.randn(n, 4)
            torch.testing.assert_close(f(x, y), x * y)
    assert len(made) == before  # the buffers of bucket 8 (and the check's copies) only
    assert autograph.stats(f)["graphs"] == 1


def test_padded_rows_hold_the_pad_value_after_a_larger_batch():
    seen = []

    @autograph.graphed(buckets=[8], warmup=100, pad_values={"ids": -1})  # eager runs
    def f(ids):
        seen.append(ids.tolist())
        return ids + 1

    with torch.no_grad():
        f(torch.arange(7))  # learns the arguments, unpadded
        for n in (7, 7, 3, 6, 2, 7, 1):
            ids = torch.arange(10, 10 + n)
            seen.clear()
            torch.testing.assert_close(f(ids), ids + 1)
            assert seen[-1] == list(range(10, 10 + n)) + [-1] * (8 - n)


def test_outputs_that_view_an_argument_are_not_changed_by_later_calls():
    @autograph.graphed(buckets=[4], warmup=0)
    def first_half(x):
        return x[:, :2]  # a view of the (padded) argument

    with torch.no_grad():
        xs = [torch.randn(3, 4) for _ in range(5)]
        outs = [first_half(x) for x in xs]
    for x, out in zip(xs, outs):
        torch.testing.assert_close(out, x[:, :2])
    assert autograph.stats(first_half)["replays"] >= 2


def test_a_padded_argument_written_in_place_reaches_the_callers_tensor():
    @autograph.graphed(buckets=[4], warmup=0, batch_dims={"out": 0})
    def f(x, out):
        out.copy_(x * 3)
        return x + 1

    with torch.no_grad():
        for _ in range(5):
            x, out = torch.randn(3, 2), torch.zeros(3, 2)
            keep = x.clone()
            torch.testing.assert_close(f(x, out), x + 1)
            torch.testing.assert_close(out, x * 3)
            torch.testing.assert_close(x, keep)  # the caller's argument is not touched
    s = autograph.stats(f)
    assert s["padding"] is None and s["buckets"][4]["padded_rows"] > 0


def test_a_call_while_the_buffers_are_in_use_pads_into_new_tensors():
    @autograph.graphed(buckets=[4], warmup=0)
    def f(x):
        return x * 2

    with torch.no_grad():
        for _ in range(3):
            f(torch.randn(3, 2))
        bucketer = handle_of(f).call
        done = []
        with bucketer.slots.lock:  # as if another thread were padding now
            x = torch.randn(3, 2)
            thread = threading.Thread(target=lambda: done.append(f(x)))
            thread.start()
            thread.join()
        torch.testing.assert_close(done[0], x * 2)


def check_written_argument_padded_into_new_tensors(held, device="cpu"):
    """Calls that cannot use the bucket's buffers pad into new tensors; what the
    function writes into a padded argument still reaches the caller's tensor (shared
    with tests/gpu)."""
    @autograph.graphed(buckets=[4, 8], warmup=0, batch_dims={"state": 0})
    def f(x, state):
        state.add_(x)
        return state * 2

    def call(x, state):
        if held == "grad mode":
            return f(x, state)
        done = []
        with torch.no_grad(), handle_of(f).call.slots.lock:  # another thread pads now
            thread = threading.Thread(target=lambda: done.append(f(x, state)))
            thread.start()
            thread.join()
        return done[0]

    with torch.no_grad():  # learns the batch arguments and which are written
        f(torch.ones(2, 3, device=device), torch.zeros(2, 3, device=device))
    for n in (1, 3, 1, 3, 5):
        x, state = torch.randn(n, 3, device=device), torch.randn(n, 3, device=device)
        expected = state + x
        torch.testing.assert_close(call(x, state), expected * 2)
        torch.testing.assert_close(state, expected)
    assert sum(b["padded_rows"] for b in autograph.stats(f)["buckets"].values()) > 0


@pytest.mark.parametrize("held", ["grad mode", "buffers in use"])
def test_a_written_argument_padded_into_new_tensors_reaches_the_callers_tensor(held):
    check_written_argument_padded_into_new_tensors(held)


def test_a_batch_argument_sharing_memory_with_another_is_not_padded_apart():
    """Padding copies a batch argument: when it is (a view of) another argument that
    the call writes, the padded copy would not see the write as eager mode does."""
    @autograph.graphed(buckets=[4, 8], warmup=0)
    def f(x, cache):
        cache.add_(1)
        return x * 2

    cache, ref = torch.zeros(3, 2), torch.zeros(3, 2)
    with torch.no_grad():
        for _ in range(6):  # separate arguments: learned, checked, captured, replayed
            x = torch.randn(3, 2)
            torch.testing.assert_close(f(x, cache), x * 2)
            ref.add_(1)
        assert autograph.stats(f)["replays"] >= 2
        for view in (lambda t: t, lambda t: t[:2]):
            got = f(view(cache), cache)
            ref.add_(1)
            torch.testing.assert_close(got, view(ref) * 2)
            torch.testing.assert_close(cache, ref)


def test_buffers_made_in_inference_mode_and_calls_under_no_grad_or_grad_mode():
    lin = nn.Linear(2, 2)
    g = autograph.graphed(lin, buckets=[4], warmup=0)
    with torch.inference_mode():  # buffers made here are inference tensors
        for _ in range(3):
            x = torch.randn(3, 2)
            torch.testing.assert_close(g(x), lin(x))
    with torch.no_grad():  # so calls outside inference mode get buffers of their own
        for _ in range(3):
            x = torch.randn(3, 2)
            torch.testing.assert_close(g(x), lin(x))
    # grad mode: autograd keeps the padded input for backward; a later call must not
    # overwrite it (these calls pad into new tensors, and run eagerly)
    x, other = torch.randn(3, 2, requires_grad=True), torch.randn(3, 2, requires_grad=True)
    out = g(x)
    g(other).sum().backward()
    out.sum().backward()
    torch.testing.assert_close(x.grad, lin.weight.sum(0).expand(3, -1))
