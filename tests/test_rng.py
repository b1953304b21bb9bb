"""A call that sets the device's generator itself runs eagerly (``rng.py``); calls that
only draw replay with eager's numbers under the same seeds.  Through the stand-in,
whose capture, like a CUDA one, advances no generator; the ``check_*`` bodies run on
CUDA too (tests/gpu/test_limits_cuda.py)."""

import collections
import copy
import functools
import itertools
import random
import threading

import pytest
import torch
from torch import nn
from torch.random import get_rng_state as saved_state
from torch.random import set_rng_state as restore_state

import autograph
from autograph import rng


@torch.library.custom_op("autograph_test::noisy", mutates_args=())
def _noisy(x: torch.Tensor) -> torch.Tensor:  # a fused kernel drawing its own numbers
    return x + torch.randn_like(x)


@_noisy.register_fake
def _(x):
    return torch.empty_like(x)


def _seeded_calls(fn, g, make, device, seeds=range(6)):
    """Each call under a new seed, eagerly and graphed: outputs and the next draw."""
    for seed in seeds:
        x = make()
        torch.manual_seed(seed)
        want, want_next = fn(x), torch.rand(1, device=device)
        torch.manual_seed(seed)
        got, got_next = g(x), torch.rand(1, device=device)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        torch.testing.assert_close(got_next, want_next, rtol=0, atol=0)


def check_calls_that_draw_replay_eagers_numbers_under_the_same_seeds(device):
    """The capture draws nothing: the first replay draws what eager does."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5)).to(device)
    g = autograph.graphed(model)
    with torch.no_grad():
        _seeded_calls(model, g, lambda: torch.randn(4, 8, device=device), device)
    assert autograph.stats(g)["replays"] >= 3


def test_calls_that_draw_replay_eagers_numbers_under_the_same_seeds(standin):
    check_calls_that_draw_replay_eagers_numbers_under_the_same_seeds("cpu")


def _setters(device):
    """Calls that set the device's generator: seeding inside, and a state saved and
    restored between two draws (eager: the same numbers twice), reached by names that
    ``StateReads`` does not spy on."""
    gen = rng.generator(torch.device(device))
    seed = torch.cuda.manual_seed if device == "cuda" else torch.manual_seed

    def seeds_inside(x):
        seed(0)
        return x + torch.randn_like(x)

    def sets_the_generator_object(x):
        state = gen.get_state()
        first = torch.rand_like(x)
        gen.set_state(state)
        return first - torch.rand_like(x)

    return [seeds_inside, sets_the_generator_object]


def check_a_call_setting_the_generator_runs_eagerly(device, fn, seed_before):
    """Eager draws the same numbers again, a graph's replays would draw on (on CUDA,
    setting the seed a generator has is allowed during a capture)."""
    autograph.reset()
    g = autograph.graphed(fn)
    gen = rng.generator(torch.device(device))
    with torch.no_grad():
        if seed_before:  # the seed the call sets is the generator's already
            gen.manual_seed(0)
        for _ in range(6):
            x = torch.randn(16, device=device)
            state = gen.get_state()
            want = fn(x)
            gen.set_state(state)
            torch.testing.assert_close(g(x), want, rtol=0, atol=0)
    s = autograph.stats(g)
    assert s["replays"] == 0 and s["eager_reasons"].get("sets_rng_state", 0) >= 4, s


def _restores_a_saved_state(x):  # the CPU generator's setter by another name
    state = saved_state()
    first = torch.randn_like(x)
    restore_state(state)
    return x + first - torch.randn_like(x)  # eager: x


@pytest.mark.parametrize("which", [0, 1, 2])
@pytest.mark.parametrize("seed_before", [True, False])
def test_a_call_setting_the_generator_runs_eagerly(standin, which, seed_before):
    fn = [*_setters("cpu"), _restores_a_saved_state][which]
    check_a_call_setting_the_generator_runs_eagerly("cpu", fn, seed_before)


def check_a_custom_operator_that_draws_is_not_verified_nor_given_variants(device):
    """A custom operator's draws carry no random tag: the generator's move shows them,
    so the graph counts as drawing (no output variants, whose checks replay it once
    more, and no verification against eager, whose numbers differ)."""
    def f(x):
        return _noisy(x) * 2

    for options in ({}, {"verify_every": 1}):
        autograph.reset()
        g = autograph.graphed(f, **options)
        with torch.no_grad():
            _seeded_calls(f, g, lambda: torch.randn(4, device=device), device)
        s = autograph.stats(g)
        assert s["replays"] >= 3 and s["verify_failures"] == 0, s


def test_a_custom_operator_that_draws_is_not_verified_nor_given_variants(standin):
    check_a_custom_operator_that_draws_is_not_verified_nor_given_variants("cpu")


def test_another_threads_draws_during_a_warmup_are_not_the_calls(standin):
    """The generator moving during a warmup is no sign that the call draws: another
    thread may draw meanwhile.  The call is still captured without the generator, so
    that thread's draws keep working during captures."""
    calls = itertools.count(1)  # (a list counter would be a change replays drop: eager)

    def f(x):
        if next(calls) <= 2:  # during the warmups: another thread draws
            worker = threading.Thread(target=lambda: torch.rand(8))
            worker.start()
            worker.join()
        return x * 2

    g = autograph.graphed(f)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(4)
            torch.testing.assert_close(g(x), x * 2)
    assert standin.rng_free[0] is True and autograph.stats(g)["replays"] >= 1


def test_a_seed_set_once_elsewhere_or_a_draw_made_once_is_learned_again(standin):
    """Another thread seeding during one warmup, or a call drawing only at its first
    call (a random projection made lazily): the call does not set the generator
    itself, and is graphed after learning again."""
    state = {}

    def lazy(x):
        if "proj" not in state:
            state["proj"] = torch.randn(4, 4)
        return x @ state["proj"]

    calls = itertools.count(1)

    def seeded_elsewhere(x):
        if next(calls) == 1:  # another thread seeds meanwhile
            worker = threading.Thread(target=lambda: torch.manual_seed(123))
            worker.start()
            worker.join()
        return torch.nn.functional.dropout(x, 0.5, training=True)

    for fn in (lazy, seeded_elsewhere):
        g = autograph.graphed(fn)
        with torch.no_grad():
            for _ in range(8):  # (one more warmup: learned again)
                out = g(torch.randn(2, 4))
        if fn is lazy:
            x = torch.randn(2, 4)
            torch.testing.assert_close(g(x), x @ state["proj"])
        s = autograph.stats(g)
        assert s["replays"] >= 2 and "sets_rng_state" not in s["eager_reasons"], s
        assert out.shape == (2, 4)


def test_random_operators_that_draw_nothing_leave_the_call_graphed(standin):
    """Operators tagged random that draw nothing in this call (``RReLU`` in eval mode;
    on CUDA, a GRU with dropout 0 while training) leave the generator where it stood,
    which is no sign of a call setting it."""
    model = nn.Sequential(nn.Linear(4, 4), nn.RReLU()).eval()
    g = autograph.graphed(model)
    with torch.no_grad():
        for _ in range(5):
            x = torch.randn(2, 4)
            torch.testing.assert_close(g(x), model(x))
    s = autograph.stats(g)
    assert s["replays"] >= 2 and "sets_rng_state" not in s["eager_reasons"], s


HOST_RNG = random.Random(0)


class EpsilonGreedy(nn.Module):
    """Explores with a host generator object of its own (``self.rng.random() < eps``)."""

    def __init__(self, rng):
        super().__init__()
        self.q = nn.Linear(4, 3)
        self.rng = rng

    def forward(self, obs):
        q = self.q(obs)
        if self.rng.random() < 0.5:
            return torch.zeros_like(q[:, 0], dtype=torch.long)
        return q.argmax(-1)


def explores_through_a_global(x):
    return x * 2 if HOST_RNG.random() < 0.5 else x


def check_host_generator_objects_decide_eagerly(device="cpu"):
    """A call deciding what to run by a draw from a host generator object (a module's
    ``random.Random`` or numpy ``Generator``, a global one) runs eagerly
    (``host_random``), as one drawing from the global streams: a graph would replay the
    capture's decision and leave the generator where it was."""
    import numpy as np

    makers = [lambda: random.Random(0), lambda: np.random.default_rng(0),
              lambda: np.random.RandomState(0)]
    for make in makers:
        torch.manual_seed(0)
        model = EpsilonGreedy(make()).to(device)
        twin = copy.deepcopy(model)
        g = autograph.graphed(model)
        with torch.no_grad():
            for _ in range(12):
                obs = torch.randn(2, 4, device=device) + 3
                assert torch.equal(g(obs), twin(obs))
        s = autograph.stats(g)
        assert s["replays"] == 0 and s["eager_reasons"].get("host_random", 0) >= 1, s
    class ClassLevel(EpsilonGreedy):
        shared = random.Random(0)

        def __init__(self):
            super().__init__(None)
            self.rng = None

        def forward(self, obs):
            self.rng = self.rng or ClassLevel.shared
            return super().forward(obs)

    def explores_with_a_given_generator(x, gen):
        return x * 2 if gen.random() < 0.5 else x

    for run in ("class", "argument"):
        torch.manual_seed(0)
        if run == "class":
            ClassLevel.shared.seed(0)
            model = ClassLevel().to(device)
            g, twin, state = autograph.graphed(model), None, random.Random(0)
        else:
            g, gen, twin_gen = (autograph.graphed(explores_with_a_given_generator),
                                random.Random(0), random.Random(0))
        for _ in range(10):
            x = torch.randn(2, 4, device=device) + 3
            with torch.no_grad():
                if run == "class":
                    want = torch.zeros(2, dtype=torch.long, device=device) \
                        if state.random() < 0.5 else model.q(x).argmax(-1)
                    assert torch.equal(g(x), want)
                else:
                    want = x * 2 if twin_gen.random() < 0.5 else x
                    assert torch.equal(g(x, gen), want)
        assert autograph.stats(g)["replays"] == 0, (run, autograph.stats(g))
    g = autograph.graphed(explores_through_a_global)
    HOST_RNG.seed(0)
    twin_rng = random.Random(0)
    for _ in range(12):
        x = torch.randn(3, device=device)
        want = x * 2 if twin_rng.random() < 0.5 else x
        assert torch.equal(g(x), want)
    assert autograph.stats(g)["eager_reasons"].get("host_random", 0) >= 1


def test_host_generator_objects_decide_eagerly(standin):
    check_host_generator_objects_decide_eagerly()


class _Holder:
    """A plain object holding another (``self.h.inner.rng``)."""


class _Slotted:
    __slots__ = ("rng",)

    def __init__(self, rng):
        self.rng = rng


def _explore(x, rng):
    return x * 2 if rng.random() < 0.5 else x - 1


class Sampler:
    """A plain object whose method (graphed as ``graphed(obj.pick)``) draws from its own
    generator."""

    def __init__(self, rng):
        self.rng = rng

    def pick(self, x):
        return _explore(x, self.rng)

    def explores(self):
        return self.rng.random() < 0.5

    def pick_through_a_method(self, x):  # the generator named by another method
        return x * 2 if self.explores() else x - 1

    def pick_through_a_helper(self, x):  # a function given the object reads it
        return _explore_for(self, x)


def _explore_for(sampler, x):
    return _explore(x, sampler.rng)


def _routes(rng):
    """The same exploring call reaching ``rng`` by each route users write."""
    def defaulted(x, r=rng):
        return _explore(x, r)

    box = _Holder()
    box.gens = [{"g": rng}]

    def nested(x):
        return _explore(x, box.gens[0]["g"])

    def helper():
        return rng.random() < 0.5

    def through_helper(x):  # a helper function's closure holds it
        return x * 2 if helper() else x - 1

    slotted = _Slotted(rng)
    queue = collections.deque([rng])

    def in_slots(x):
        return _explore(x, slotted.rng)

    def in_a_deque(x):
        return _explore(x, queue[0])

    module = nn.Module()
    module.h = _Holder()
    module.h.inner = _Holder()
    module.h.inner.rng = rng
    module.forward = lambda x: _explore(x, module.h.inner.rng)
    return {"partial keyword": functools.partial(_explore, rng=rng),
            "partial positional": functools.partial(lambda r, x: _explore(x, r), rng),
            "default": defaulted, "list in a dict held by an object": nested,
            "helper's closure": through_helper, "method of a plain object": Sampler(rng).pick,
            "method calling a method": Sampler(rng).pick_through_a_method,
            "helper given the object": Sampler(rng).pick_through_a_helper,
            "object held by an object of a module": module, "slots": in_slots,
            "deque": in_a_deque}


def check_host_generators_reached_by_every_route_decide_eagerly(device="cpu"):
    """A host generator bound by a ``functools.partial`` or a default argument, held
    deeper (a list in a dict held by an object), held by a helper function the call
    names, or by the object of a graphed method, decides as eager would: the call runs
    eagerly (``host_random``) and the generator advances as eager's."""
    for name in _routes(random.Random(0)):
        autograph.reset()
        gen, twin = random.Random(5), random.Random(5)
        g, want_fn = autograph.graphed(_routes(gen)[name]), _routes(twin)[name]
        for _ in range(10):
            x = torch.randn(4, device=device)
            assert torch.equal(g(x), want_fn(x)), name
        assert gen.getstate() == twin.getstate(), name
        s = autograph.stats(g)
        assert s["replays"] == 0 and s["eager_reasons"].get("host_random", 0) >= 1, (name, s)


def test_host_generators_reached_by_every_route_decide_eagerly(standin):
    check_host_generators_reached_by_every_route_decide_eagerly()


_ELSEWHERE: list = []  # what another thread does meanwhile (here: inside the call)


class _Prefetching(nn.Linear):
    def forward(self, x):
        _ELSEWHERE[0]()  # as a prefetching thread drawing from the data's generator
        return super().forward(x)


class _Trainer:
    """A trainer whose graphed method never draws from the data's generator."""

    def __init__(self):
        self.model = _Prefetching(4, 4)
        self.loader = _Holder()
        self.loader.rng = random.Random(0)

    def step(self, x):
        return self.model(x)


def test_a_generator_the_method_never_names_is_not_watched(standin):
    """A generator held under an attribute the graphed method's code never names (the
    data loader's, advanced by a prefetching thread while the call runs) leaves the
    call graphed."""
    trainer = _Trainer()
    _ELSEWHERE[:] = [trainer.loader.rng.random]
    g = autograph.graphed(trainer.step)
    with torch.no_grad():
        for _ in range(6):
            x = torch.randn(2, 4)
            torch.testing.assert_close(g(x), nn.functional.linear(
                x, trainer.model.weight, trainer.model.bias))
    assert autograph.stats(g)["replays"] >= 2, autograph.stats(g)


class _Policy:
    rng = random.Random(5)


def _explores_by_class(x):
    return _explore(x, _Policy.rng)


def test_a_generator_held_by_a_class_the_code_names_decides_eagerly(standin):
    _Policy.rng.seed(5)
    twin = random.Random(5)
    g = autograph.graphed(_explores_by_class)
    for _ in range(10):
        x = torch.randn(4)
        assert torch.equal(g(x), _explore(x, twin))
    assert autograph.stats(g)["replays"] == 0, autograph.stats(g)


def check_a_global_numpy_draw_of_624_words_is_seen(device="cpu"):
    """A draw of exactly 624 words from numpy's global stream (``np.random.rand(312)``,
    a per-sample host mask) brings its position back where it was: the key of the
    stream is compared too, and the call runs eagerly (``host_random``)."""
    import numpy as np

    def masked(x):
        keep = torch.from_numpy(np.random.rand(312) < 0.5).to(x.device)
        return x * keep.to(x.dtype)[: x.shape[0]].view(-1, 1)

    g = autograph.graphed(masked)
    for i in range(6):
        x = torch.ones(8, 2, device=device)
        np.random.seed(i)
        got = g(x)
        np.random.seed(i)
        assert torch.equal(got, masked(x))
    s = autograph.stats(g)
    assert s["replays"] == 0 and s["eager_reasons"].get("host_random"), s
    setter = getattr(np.random, "set_bit_generator", None)
    if setter is None:
        return
    before = np.random.get_bit_generator()
    setter(np.random.PCG64(0))  # no legacy state: read as a whole
    try:
        scaled = autograph.graphed(lambda x: x * float(np.random.rand()))
        outs = [scaled(torch.ones(2, device=device)) for _ in range(6)]
        assert len({o[0].item() for o in outs}) == 6, outs
        assert autograph.stats(scaled)["replays"] == 0
    finally:
        setter(before)


def test_a_global_numpy_draw_of_624_words_is_seen(standin):
    check_a_global_numpy_draw_of_624_words_is_seen()
