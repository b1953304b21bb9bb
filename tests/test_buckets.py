"""Buckets (padding and slicing) and the graph memory budget, on the CPU stand-in."""

import copy
import threading

import pytest
import torch
from torch import nn

import autograph

from .standin import Tally
from .test_usage import counts

pytestmark = pytest.mark.usefixtures("standin")

BUCKETS = [1, 2, 4, 8]


def calls(fn, sizes, make, ref):
    with torch.no_grad():
        for n in sizes:
            args = make(n)
            out = fn(*args)
            torch.testing.assert_close(out, ref(*args))
            assert out.shape[0] == n


def test_padded_calls_equal_eager_on_real_rows_and_count_per_bucket():
    @autograph.graphed(buckets=BUCKETS, warmup=0)
    def f(x):
        return x * 2 + 1

    calls(f, [3, 1, 5, 8, 2, 7, 6, 4, 3], lambda n: (torch.randn(n, 5),), lambda x: x * 2 + 1)
    s = autograph.stats(f)
    assert s["captures"] == 4  # one graph per bucket, not per size
    # the first call (3 rows) ran eagerly to learn which arguments carry the batch
    assert s["buckets"][4] == {"hits": 2, "real_rows": 7, "padded_rows": 1, "eager": 0}
    assert s["buckets"][8] == {"hits": 4, "real_rows": 26, "padded_rows": 6, "eager": 0}
    assert s["padding"] is None and s["bucket_misses"] == 0


def test_larger_than_the_largest_bucket_is_a_miss():
    @autograph.graphed(buckets=BUCKETS, warmup=0)
    def f(x):
        return x.exp()

    calls(f, [2, 9, 12], lambda n: (torch.randn(n, 3),), torch.exp)
    s = autograph.stats(f)
    assert s["bucket_misses"] == 2
    assert s["eager_reasons"]["bucket_miss"] == 2


def test_batch_dims_and_pad_values_by_name_and_untouched_tables():
    table = torch.randn(50, 6)
    seen = Tally()

    @autograph.graphed(buckets=BUCKETS, warmup=0, batch_dims={"table": None, "h": 1},
                       pad_values={"ids": 49})
    def f(ids, h, table):
        seen.add(int(ids.shape[0]))
        return table[ids] + h.transpose(0, 1)

    def ref(ids, h, table):
        return table[ids] + h.transpose(0, 1)

    calls(f, [3, 3, 3, 6, 6],
          lambda n: (torch.randint(0, 49, (n,)), torch.randn(6, n), table), ref)
    assert 4 in seen.seen and 8 in seen.seen  # the function ran on padded batches
    s = autograph.stats(f)
    assert s["replays"] >= 2 and s["padding"] is None


def test_row_coupled_functions_turn_padding_off():
    @autograph.graphed(buckets=BUCKETS, warmup=0)
    def center(x):
        return x - x.mean(0)  # mixes rows: padded rows would change the mean

    calls(center, [3, 3, 3, 5], lambda n: (torch.randn(n, 4),), lambda x: x - x.mean(0))
    s = autograph.stats(center)
    assert s["padding"].startswith("padding off: padding changes results")
    assert s["captures"] == 2  # exact shapes 3 and 5


def test_padded_rows_writing_into_a_cache_turn_padding_off():
    @autograph.graphed(buckets=BUCKETS, warmup=0)
    def write(slots, values, cache):
        cache.index_copy_(0, slots, values)  # padded rows would write slot 0
        return cache.sum(0, keepdim=True).expand(slots.shape[0], -1) * 1

    cache, ref_cache = torch.zeros(16, 2), torch.zeros(16, 2)
    with torch.no_grad():
        for start in (1, 4, 7):
            slots = torch.arange(start, start + 3)
            values = torch.randn(3, 2)
            out = write(slots, values, cache)
            ref_cache.index_copy_(0, slots, values)
            torch.testing.assert_close(cache, ref_cache)
            torch.testing.assert_close(out, ref_cache.sum(0, keepdim=True).expand(3, -1))
    assert autograph.stats(write)["padding"].startswith("padding off: padding changes results")


def test_module_state_updates_turn_padding_off():
    bn = nn.BatchNorm1d(4).train()
    g = autograph.graphed(bn, buckets=BUCKETS, warmup=0)
    ref = nn.BatchNorm1d(4).train()
    with torch.no_grad():
        for n in (3, 3, 3):
            x = torch.randn(n, 4)
            torch.testing.assert_close(g(x), ref(x))
    torch.testing.assert_close(bn.running_mean, ref.running_mean)
    assert "module state" in autograph.stats(g)["padding"]


class RowNorm(nn.Module):
    """Each row's length: ``sqrt`` has an infinite derivative at a zero (padded) row."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4, bias=False)

    def forward(self, x):
        return self.lin(x).pow(2).sum(-1).sqrt()


def check_calls_autograd_records_are_not_padded(device="cpu"):
    """A call autograd records runs at its own size: padded rows would run through the
    backward too, and a NaN (an infinite derivative times their zero gradient) would
    reach every parameter's gradient."""
    torch.manual_seed(0)
    model = RowNorm().to(device)
    g = autograph.graphed(copy.deepcopy(model), buckets=[4])
    for _ in range(5):
        x = torch.randn(3, 4, device=device)
        for m in (model, g):
            m.zero_grad()
            m(x).sum().backward()
        assert torch.isfinite(g.lin.weight.grad).all()
        torch.testing.assert_close(g.lin.weight.grad, model.lin.weight.grad)
    s = autograph.stats(g)
    assert s["replays"] >= 1 and s["backward_replays"] >= 1, s
    hidden = RowNorm().to(device).requires_grad_(False)  # a plain tensor attribute trains
    hidden.w = torch.randn(4, 4, device=device, requires_grad=True)
    hidden.lin.forward = lambda x: x @ hidden.w
    h = autograph.graphed(hidden, buckets=[4])
    for _ in range(4):
        hidden.w.grad = None
        x = torch.randn(3, 4, device=device)
        with autograph.disabled():
            hidden(x).sum().backward()
        want, hidden.w.grad = hidden.w.grad, None
        h(x).sum().backward()
        torch.testing.assert_close(hidden.w.grad, want)
    with torch.no_grad():  # inference calls are still padded
        for _ in range(4):
            x = torch.randn(3, 4, device=device)
            torch.testing.assert_close(g(x), model(x))
    assert autograph.stats(g)["buckets"], autograph.stats(g)


def test_calls_autograd_records_are_not_padded(standin):
    check_calls_autograd_records_are_not_padded()


def check_a_sampling_step_keeps_eagers_random_stream(device="cpu"):
    """A row-wise sampler (``multinomial``) under ``buckets=``: padded, it draws for
    the padded rows too, so the generator would stand elsewhere than eager's after
    each call (the real rows' draws equal: the check passed, and every later draw
    differed).  The check compares where the generator ends: padding turns off, and
    the samples and the generator follow eager's, call after call."""
    torch.manual_seed(0)
    weight = torch.randn(16, 40, device=device)

    def sample(h):
        return torch.multinomial((h @ weight).softmax(-1), 1).squeeze(1)

    g = autograph.graphed(sample, buckets=[4, 8])

    def run(fn):
        torch.manual_seed(1)
        data = torch.Generator(device=device).manual_seed(2)
        out = []
        with torch.inference_mode():
            for batch in [3, 5] * 6:
                out.append(fn(torch.randn(batch, 16, device=device, generator=data)))
                out.append(torch.rand(2, device=device))  # where the generator stands
        return out

    alone = threading.active_count() == 1  # (else the check cannot put the defaults back)
    got, want = run(g), run(sample)
    for a, b in zip(got, want):
        assert torch.equal(a, b) or not alone
    s = autograph.stats(g)
    assert s["replays"] >= 4 and s["padding"] is not None, s
    if device == "cpu":  # (CUDA's kernel may draw otherwise per size: the outputs differ)
        assert "more random numbers" in s["padding"], s
    return s


def test_a_sampling_step_keeps_eagers_random_stream(standin):
    check_a_sampling_step_keeps_eagers_random_stream()


def check_the_padding_check_leaves_the_generator_as_it_found_it(device="cpu"):
    """A bucketed step writing a cache (the check fills copies of it with random
    values) followed by sampling on the global generator: the samples equal eager's
    (the check's draws moved the generator: they differed from the second step on)."""
    torch.manual_seed(0)
    weight = torch.randn(8, 8, device=device)

    def decode(x, cache, slot):
        cache[slot] = x
        return torch.softmax(x @ weight, -1)

    g = autograph.graphed(decode, buckets=[4, 8], pad_values={"slot": 8},
                          pad_writes={"cache": (0, 8)})

    def run(fn):
        torch.manual_seed(1)
        data = torch.Generator(device=device).manual_seed(2)
        cache, tokens = torch.zeros(9, 8, device=device), []
        for batch in [3, 3, 3, 3, 3, 5, 5, 5, 5, 2, 2, 2]:
            x = torch.randn(batch, 8, generator=data, device=device)
            probs = fn(x, cache, torch.arange(batch, device=device))
            tokens.append(torch.multinomial(probs, 1).flatten())
        return tokens

    with torch.inference_mode():
        want, got = run(decode), run(g)
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    assert autograph.stats(g)["replays"] >= 3, autograph.stats(g)


def test_the_padding_check_leaves_the_generator_as_it_found_it(standin):
    check_the_padding_check_leaves_the_generator_as_it_found_it()


def check_a_branch_on_the_batch_size_is_checked_per_size(device="cpu"):
    """Code that branches on the real batch size (``if x.shape[0] > 5``): the padding
    check runs once per real size of a bucket, not once per bucket (sizes 5, 4 and 3
    got the padded size's branch, with padding still on)."""
    def f(x):
        return x * 2 if x.shape[0] > 5 else x * 3

    g = autograph.graphed(f, buckets=[8])
    with torch.no_grad():
        for n in (6, 6, 6, 7, 5, 4, 3):
            x = torch.randn(n, 2, device=device)
            torch.testing.assert_close(g(x), f(x))
    s = autograph.stats(g)
    assert s["padding"].startswith("padding off: padding changes results"), s
    assert s["buckets"][8]["hits"] >= 2, s


def test_a_branch_on_the_batch_size_is_checked_per_size(standin):
    check_a_branch_on_the_batch_size_is_checked_per_size()


def check_a_write_the_first_call_did_not_make_reaches_the_caller(device="cpu"):
    """The arguments a context writes were learned from its first call only: a write on
    a branch (``if x.sum() > 0``) or for some batch sizes only (``if x.shape[0] > 2``)
    went into the padded buffer, and the caller's tensor never changed."""
    def on_values(x, state):
        if x.sum() > 0:
            state.add_(x)
        return x * 2

    def on_sizes(x, state):
        if x.shape[0] > 2:
            state.add_(x)
        return x * 2

    for f, calls in ((on_values, [(3, -1), (3, 1), (3, 1), (3, 1), (3, 1)]),
                     (on_sizes, [(1, 1), (3, 1), (3, 1), (3, 1), (3, 1), (3, 1)])):
        g = autograph.graphed(f, buckets=[4])
        with torch.no_grad():
            for n, sign in calls:
                x = torch.rand(n, 4, device=device) * sign
                want, got = torch.zeros(n, 4, device=device), torch.zeros(n, 4, device=device)
                torch.testing.assert_close(g(x, got), f(x, want))
                torch.testing.assert_close(got, want)
    assert autograph.stats(g)["replays"] >= 2  # on_sizes: the written bucket replays


def test_a_write_the_first_call_did_not_make_reaches_the_caller(standin):
    check_a_write_the_first_call_did_not_make_reaches_the_caller()


def check_padding_ends_where_the_padded_calls_run_eagerly(device="cpu"):
    """A call reading tensor values on the host is never graphed; its padded calls ran
    eagerly on the padded rows for good, where a branch the padding check saw one way
    mixed rows the other way (``x - x.mean(0)``): padding ends once such a key gives up."""
    def normalize(x):
        if x.abs().max() > 10:
            return x - x.mean(0)
        return x * 2

    g = autograph.graphed(normalize, buckets=[4])
    with torch.no_grad():
        for _ in range(4):  # learning, the check, warmups and the failed capture: calm
            x = torch.rand(3, 2, device=device)
            torch.testing.assert_close(g(x), normalize(x))
        for _ in range(4):
            x = torch.rand(3, 2, device=device) * 30
            torch.testing.assert_close(g(x), normalize(x))
    s = autograph.stats(g)
    assert s["padding"] == "padding off: its padded calls run eagerly; one graph per batch size"


def test_padding_ends_where_the_padded_calls_run_eagerly(standin):
    check_padding_ends_where_the_padded_calls_run_eagerly()


def check_padded_outputs_have_eager_layout(device="cpu"):
    """Rows cut back from a padded output where the batch is not the outermost dimension
    in memory (``batch_dims`` 1, a transposed input) come back dense in eager's order, so
    ``.view()`` works as on eager's output (a view with the bucket's strides raised)."""
    lin = nn.Linear(4, 3).to(device)
    seq = autograph.graphed(lambda x: lin(x), buckets=[4, 8], batch_dims={"x": 1})
    ew = autograph.graphed(lambda x: x * 2 + 1, buckets=[4, 8])
    with torch.no_grad():
        for _ in range(6):
            x = torch.randn(5, 3, 4, device=device)  # (sequence, batch 3, features)
            got, want = seq(x), lin(x)
            assert got.stride() == want.stride()
            torch.testing.assert_close(got.view(-1, 3), want.view(-1, 3))
            t = torch.randn(3, 3, device=device).T
            got, want = ew(t), t * 2 + 1
            assert got.stride() == want.stride()
            torch.testing.assert_close(got.T.reshape(-1), want.T.view(-1))
    for g in (seq, ew):
        s = autograph.stats(g)
        assert s["replays"] >= 2 and s["buckets"][4]["hits"] >= 4, s


def test_padded_outputs_have_eager_layout(standin):
    check_padded_outputs_have_eager_layout()


BUMPS = torch.zeros(())


def bump(x):
    BUMPS.add_(1)
    return x * 2


def test_a_named_global_written_in_place_turns_padding_off(standin):
    """A tensor the function names and writes (a global counter) is state as a buffer
    is: the padding check's extra eager runs would write it again (18 for 6 calls)."""
    g = autograph.graphed(bump, buckets=BUCKETS)
    before = float(BUMPS)
    with torch.no_grad():
        for n in (3, 3, 5, 5, 3, 6):
            x = torch.randn(n, 4)
            torch.testing.assert_close(g(x), x * 2)
    assert float(BUMPS) - before == 6
    assert "module state" in autograph.stats(g)["padding"]


def test_graph_memory_budget_evicts_and_refuses_graphs_too_large(standin):
    @autograph.graphed(warmup=0, max_graph_memory=3000)
    def f(x):
        return (x * 2).sum(1)

    with torch.no_grad():
        for n in (10, 11, 12, 13):  # each graph records about 1 KB of tensors
            x = torch.randn(n, 8)
            torch.testing.assert_close(f(x), (x * 2).sum(1))
        s = autograph.stats(f)
        assert s["graph_memory_bytes"] <= 3000 and s["evictions"] >= 1
        big = torch.randn(200, 8)
        torch.testing.assert_close(f(big), (big * 2).sum(1))
        torch.testing.assert_close(f(big), (big * 2).sum(1))
    s = autograph.stats(f)
    assert "over_memory_budget" in s["eager_reasons"]
    assert s["graph_memory_bytes"] <= 3000


def test_buckets_in_a_region():
    model = nn.Linear(4, 3)
    with torch.no_grad(), autograph.capture_region(buckets=[2, 4], warmup=0) as region:
        outs = [(x, model(x)) for x in (torch.randn(n, 4) for n in (1, 3, 2, 3))]
    with torch.no_grad():
        for x, out in outs:
            torch.testing.assert_close(out, model(x))
    (s,) = region.stats().values()
    assert s["captures"] == 2


def test_a_new_region_per_step_keeps_what_buckets_learned():
    model = nn.Linear(4, 3)
    outs = []
    with torch.no_grad():
        for n in (1, 3, 3, 3, 3, 1):
            with autograph.capture_region(buckets=[2, 4], warmup=0):
                x = torch.randn(n, 4)
                outs.append((x, model(x)))
        for x, out in outs:
            torch.testing.assert_close(out, model(x))
    s = autograph.stats(model)  # the module's region engine
    assert s["captures"] == 2 and s["replays"] == 3


@pytest.mark.parametrize(
    "kwargs",
    [{"buckets": []}, {"buckets": [0, 2]}, {"buckets": "1,2"}, {"max_graph_memory": 0},
     {"batch_dims": {"x": -1}}, {"batch_dims": [0]}, {"pad_values": {"x": "a"}},
     {"pad_values": {"x": None}}, {"pad_values": {0: torch.zeros(1)}}],
)
def test_bad_bucket_options_raise(kwargs):
    with pytest.raises(ValueError, match="autograph"):
        autograph.graphed(**kwargs)


def test_variable_batch_benchmark_runs_and_reports(standin):
    """The benchmark's variable-batch run, on the CPU stand-in (its timings mean nothing
    here; what it counts does)."""
    from autograph.cli.bench import bench_variable, format_variable

    rows = bench_variable(steps=40, rounds=1, device="cpu", width=16)
    by = {r.method: r for r in rows}
    assert by["buckets [1,2,4,8,16]"].graphs == 5
    assert by["one graph per size"].graphs == 16
    assert 0 < by["buckets [1,2,4,8,16]"].padding_waste < 1
    assert by["eager"].graphs == 0 and "padding waste" in format_variable(rows)



def test_switching_to_training_stops_padding_that_would_touch_running_statistics():
    """Padding checked in eval mode must not carry over to training mode, where padded
    rows would enter batch norm's running statistics."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).eval()
    ref = copy.deepcopy(m)
    g = autograph.graphed(m, buckets=[4, 8])
    with torch.no_grad():
        for mode in ("eval", "train", "eval"):
            m.train(mode == "train")
            ref.train(mode == "train")
            for _ in range(4):
                x = torch.randn(3, 4)
                torch.testing.assert_close(g(x), ref(x))
                torch.testing.assert_close(m[1].running_mean, ref[1].running_mean)
                torch.testing.assert_close(m[1].running_var, ref[1].running_var)
    s = autograph.stats(g)
    assert s["calls"] == s["replays"] + s["captures"] + s["eager"]
    assert s["invalidations"] == 0 and s["replays"] > 0  # train/eval keep their graphs


def test_a_malformed_request_raises_and_leaves_padding_on():
    """A call that raises in eager mode too (a wrong feature size), made when a bucket
    is first padded: it raises as eagerly, and the bucket is checked at its next call
    rather than padding being switched off for good."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    g = autograph.graphed(m, buckets=[4, 8])
    with torch.no_grad():
        for _ in range(4):
            g(torch.randn(4, 8))
        with pytest.raises(RuntimeError):
            g(torch.randn(3, 7))
        for n in [1, 2, 3, 5, 6, 7] * 2:
            x = torch.randn(n, 8)
            torch.testing.assert_close(g(x), m(x))
    s = autograph.stats(g)
    assert s["padding"] is None and s["graphs"] == 2, s
    assert s["buckets"][8]["hits"] >= 4, s


def check_batch_size_output_keeps_eager_values(device="cpu"):
    """A Python number derived from the batch size (``x.shape[0]``) is eager's on every
    call, replays included: padding, which would return the bucket's size, is switched
    off.  Non-tensor outputs that do not depend on the batch size (a width, a flag,
    None) keep padding on (shared with tests/gpu)."""
    @autograph.graphed(buckets=[8], warmup=0)
    def rows(x):
        return x * 2, x.shape[0]

    @autograph.graphed(buckets=[8], warmup=0)
    def constants(x):
        return x * 2, x.shape[1], True, None

    with torch.no_grad():
        for n in [5, 7, 6] * 3:
            x = torch.randn(n, 4, device=device)
            out, count = rows(x)
            torch.testing.assert_close(out, x * 2)
            assert count == n
            out, width, flag, none = constants(x)
            torch.testing.assert_close(out, x * 2)
            assert (width, flag, none) == (4, True, None)
    s = counts(rows)
    assert s["padding"].startswith("padding off: padding changes results"), s
    assert s["replays"] >= 5 and s["captures"] == 3, s  # one graph per batch size
    s = counts(constants)
    assert s["padding"] is None and s["captures"] == 1 and s["replays"] >= 7, s


def test_an_output_derived_from_the_batch_size_keeps_eager_values():
    check_batch_size_output_keeps_eager_values()


def test_batch_dims_past_an_arguments_dimensions_is_a_clear_error(standin):
    """``batch_dims`` naming a dimension the argument does not have was ignored (the
    argument went unpadded, every size its own graph); it is a ValueError naming it."""
    g = autograph.graphed(lambda x: x * 2, buckets=[4, 8], batch_dims={"x": 3})
    with torch.no_grad(), pytest.raises(ValueError,
                                        match="argument 'x' batch dimension 3, but it has 2"):
        g(torch.randn(3, 4))
    h = autograph.graphed(lambda x, n: x * n, buckets=[4], batch_dims={1: 0})
    with torch.no_grad(), pytest.raises(ValueError,
                                        match="argument 'n' batch dimension 0, but it has 0"):
        h(torch.randn(3, 4), torch.tensor(2.0))


def _amax(x):
    return x.amax(0)


def _sorted(x):
    return x.sort(0).values


def _summed(x):
    return x.sum(0)


def check_order_statistics_over_the_batch_turn_padding_off(device="cpu"):
    """A maximum, minimum or sort over the batch dimension ignores padded zeros only
    for some data: checked once on positive values it kept padding on, and later
    negative batches got the padded zeros.  Padding goes off for them (every call
    eager's result); a sum over the batch, exact with zero rows, keeps it (shared with
    tests/gpu)."""
    for f, padded in ((_amax, False), (_sorted, False), (_summed, True)):
        g = autograph.graphed(f, buckets=[2, 4])
        with torch.no_grad():
            for i, b in enumerate([3, 1, 2, 4, 3, 3, 3, 3, 2, 1, 4, 3, 3]):
                x = (torch.rand(b, 8, device=device) + 0.1) * (1 if i < 6 else -1)
                torch.testing.assert_close(g(x), f(x))
        s = autograph.stats(g)
        assert (s["padding"] is None) == padded, (f.__name__, s["padding"])
        assert s["replays"] >= 1, s


def test_order_statistics_over_the_batch_turn_padding_off(standin):
    check_order_statistics_over_the_batch_turn_padding_off()


def _all(mask):
    return mask.all(0)


def _integer_min(x):
    return x.min(0).values


def _weighted_mean(x, w):
    return x + x.mean(0, keepdim=True) * w


def check_boolean_integer_and_non_batch_arguments_in_the_padding_check(device="cpu"):
    """The check's values of one sign cover a boolean batch argument (``all`` over the
    batch, checked on rows already False), an integer one (a minimum, checked on rows
    holding 0) and a floating-point argument that is not batched (a weight of 0 on the
    checked call hid a mean over the batch): padding goes off, every call is eager's
    (shared with tests/gpu)."""
    cases = [
        (_all, lambda i: (torch.tensor([[1, 0], [0, 1], [1, 1]], device=device).bool(),)
         if i < 3 else (torch.ones(3, 2, dtype=torch.bool, device=device),)),
        (_integer_min, lambda i: (torch.randint(0 if i < 3 else 1, 9, (3, 2), device=device),)),
        (_weighted_mean, lambda i: (torch.randn(3, 2, device=device),
                                    torch.full((), 0.0 if i < 3 else 1.0, device=device))),
    ]
    for f, make in cases:
        g = autograph.graphed(f, buckets=[4])
        with torch.no_grad():
            for i in range(8):
                args = make(i)
                torch.testing.assert_close(g(*args), f(*args))
        s = autograph.stats(g)
        assert s["padding"] is not None and s["replays"] >= 1, (f.__name__, s)


def test_boolean_integer_and_non_batch_arguments_in_the_padding_check(standin):
    check_boolean_integer_and_non_batch_arguments_in_the_padding_check()


def test_an_argument_the_padding_check_cannot_see_says_so(standin):
    """A list of caches beside the batch: padding stays off for such calls (the check
    would not see padded rows write into them), and ``stats()`` says why."""

    @autograph.graphed(buckets=[4, 8])
    def step(x, caches):
        return x * 2 + caches[0].sum()

    caches = [torch.ones(2)]
    with torch.no_grad():
        for n in (3, 5, 3, 3):
            x = torch.randn(n, 2)
            torch.testing.assert_close(step(x, caches), x * 2 + 2)
    s = autograph.stats(step)
    assert s["buckets"] == {} and "argument of type list" in s["padding"], s


def check_one_calls_conditions_leave_padding_on(device="cpu"):
    """A forward hook for one call (the key runs eagerly for that call) turned padding
    off for good, as did a leaf requiring grad written under ``no_grad`` inside a
    padded call (the hand-back raised where eager does not)."""
    model = nn.Linear(4, 4).to(device)
    g = autograph.graphed(model, buckets=[4, 8])
    with torch.no_grad():
        for n in (3, 3, 3, 3):
            g(torch.randn(n, 4, device=device))
        handle = model.register_forward_hook(lambda m, i, o: None)
        x = torch.randn(3, 4, device=device)
        torch.testing.assert_close(g(x), model(x))
        handle.remove()
        for n in (3, 3, 5, 6, 7):
            x = torch.randn(n, 4, device=device)
            torch.testing.assert_close(g(x), model(x))
    s = autograph.stats(g)
    assert s["padding"] is None and s["graphs"] <= 2, s

    def clamp(x):
        if x.shape[0] > 2:
            with torch.no_grad():
                x.clamp_(-1, 1)
        return x * 2

    f = autograph.graphed(clamp, buckets=[4])
    for _ in range(3):
        x = torch.randn(3, 2, device=device, requires_grad=True)
        want = (x.detach() * 3).requires_grad_()
        got = want.detach().clone().requires_grad_()
        torch.testing.assert_close(f(got), clamp(want))
        torch.testing.assert_close(got, want)


def test_one_calls_conditions_leave_padding_on(standin):
    check_one_calls_conditions_leave_padding_on()


def test_a_bucketed_module_inside_a_graphed_call_draws_as_it_does(standin):
    """The padding check read the generators through ``torch.get_rng_state``, which an
    enclosing graphed call's warmup spies on: the outer call ran eagerly for good
    (``reads_rng_state``) once its inner module had buckets and dropout."""
    inner = autograph.graphed(nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5)), buckets=[4, 8])

    @autograph.graphed
    def outer(x):
        return inner(x) * 2

    with torch.no_grad():
        # the first: inner learns; then 5 in bucket 8 (inner's check sets the generator
        # back during one of outer's warmups: learned again)
        for b in (3, 5, 5, 5, 5, 5, 5, 5):
            outer(torch.randn(b, 8))
    s = autograph.stats(outer)
    assert s["replays"] >= 2 and not {"reads_rng_state", "sets_rng_state"} & set(
        s["eager_reasons"]), s


SAMPLER_GEN = {}  # device -> a generator the step below names (as a global would be)


def check_the_padding_check_puts_back_a_generator_the_call_names(device="cpu"):
    """A bucketed step drawing from a ``torch.Generator`` it names (16 numbers a call,
    whatever the batch): the check's extra runs drew from it too, so later draws
    differed from eager's and the check's own runs disagreed (padding turned off);
    with other threads alive too."""
    gen = SAMPLER_GEN.setdefault(device, torch.Generator(device=device))
    weight = torch.randn(8, 16, device=device)

    def sample(x):
        noise = torch.rand(16, generator=SAMPLER_GEN[x.device.type], device=x.device)
        return (x @ weight + noise).argmax(-1)

    g = autograph.graphed(sample, buckets=[4, 8])

    def run(fn):
        gen.manual_seed(0)
        data = torch.Generator(device=device).manual_seed(1)
        out = []
        with torch.inference_mode():
            for n in [3, 3, 3, 3, 5, 5, 5]:
                out.append(fn(torch.randn(n, 8, generator=data, device=device)))
                out.append(gen.get_state())
        return out

    idle = threading.Event()  # another thread alive (the defaults are not put back then)
    other = threading.Thread(target=idle.wait, daemon=True)
    other.start()
    try:
        got = run(g)
    finally:
        idle.set()
        other.join()
    want = run(sample)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert "changes results" not in str(autograph.stats(g)["padding"])  # (CUDA: eager)


def test_the_padding_check_puts_back_a_generator_the_call_names():
    check_the_padding_check_puts_back_a_generator_the_call_names()


def check_bucketed_calls_in_any_spelling_and_nested(device="cpu"):
    """A bucketed step called positionally, by keywords and mixed is one key (each
    spelling learned, warmed up and captured its own); a bucketed step calling a
    bucketed module captures (the inner call's exit unpinned the outer's buffers, so it
    warmed up for ever)."""
    lin = nn.Linear(4, 4).to(device)
    inner = autograph.graphed(lin, buckets=[4])

    @autograph.graphed(buckets=[4])
    def outer(x, cache):
        cache.add_(1)
        return inner(x).relu()

    @autograph.graphed(buckets=[4, 8])
    def step(x, scale):
        return x * scale

    cache, ref = torch.zeros(3, device=device), torch.zeros(3, device=device)
    scale = torch.full((), 2.0, device=device)
    with torch.inference_mode():
        for i in range(10):
            x = torch.randn(3, 4, device=device)
            torch.testing.assert_close(outer(x, cache), lin(x).relu())
            ref.add_(1)
            assert torch.equal(cache, ref)
            spelled = [step(x, scale), step(x=x, scale=scale), step(x, scale=scale)][i % 3]
            torch.testing.assert_close(spelled, x * 2)
    s = autograph.stats(outer)
    assert s["captures"] == 1 and s["replays"] >= 5, s
    s = autograph.stats(step)
    assert s["captures"] == 1 and s["replays"] >= 5, s


def test_bucketed_calls_in_any_spelling_and_nested():
    check_bucketed_calls_in_any_spelling_and_nested()


def check_a_first_call_that_writes_nothing_keeps_the_buckets(device="cpu"):
    """A context's first call returning early on an empty batch wrote nothing: the
    cache ``pad_writes`` names was taken for a batch argument for good, and no call
    was padded any more (one graph per batch size)."""
    def step(x, slots, cache):
        if x.shape[0] == 0:
            return x
        cache.index_copy_(0, slots, x)
        return x * 2

    g = autograph.graphed(step, buckets=[4, 8], pad_values={"slots": 8},
                          pad_writes={"cache": (0, 8)})
    cache, ref = torch.zeros(9, 5, device=device), torch.zeros(9, 5, device=device)
    with torch.inference_mode():
        g(torch.zeros(0, 5, device=device), torch.zeros(0, dtype=torch.long, device=device),
          cache)
        for n in [3, 2, 3, 2, 3, 2, 3, 2]:
            x, slots = torch.randn(n, 5, device=device), torch.arange(n, device=device)
            torch.testing.assert_close(g(x, slots, cache), x * 2)
            ref.index_copy_(0, slots, x)
            torch.testing.assert_close(cache[:8], ref[:8])
    s = autograph.stats(g)
    assert s["captures"] == 1 and s["buckets"][4]["hits"] == 8, s


def test_a_first_call_that_writes_nothing_keeps_the_buckets():
    check_a_first_call_that_writes_nothing_keeps_the_buckets()


class _Holder:
    """An object argument (a cache of the user's own): keyed as an object, but the
    padding check cannot see padded rows write into it."""

    def __init__(self):
        self.scale = torch.ones(1)


def test_padding_off_for_an_object_argument_names_its_type(standin):
    def step(x, holder):
        return x * holder.scale

    g = autograph.graphed(step, buckets=[2, 4])
    holder = _Holder()
    for rows in (1, 3) * 5:
        x = torch.randn(rows, 4)
        torch.testing.assert_close(g(x, holder), x)
    s = autograph.stats(g)
    assert s["replays"] >= 2, s  # keyed and replayed, one graph per batch size
    assert s["padding"] is not None and "of type _Holder" in s["padding"], s
    assert "are keyed" not in s["padding"], s
