"""Python state that graphs bake in never goes stale: parameters, attributes, globals."""

import collections
import copy
import dataclasses
import itertools
import threading
import types

import pytest
import torch
from torch import nn

import autograph

from .standin import Tally

pytestmark = pytest.mark.usefixtures("standin")


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.scale = 1.0
        self.use_relu = False
        self.act = nn.Identity()

    def forward(self, x):
        y = self.act(self.fc(x) * self.scale)
        return y.relu() if self.use_relu else y


def check(g, m, n=3):
    with torch.no_grad():
        for _ in range(n):
            x = torch.randn(2, 4)
            torch.testing.assert_close(g(x), m(x))


def test_in_place_weight_updates_are_seen_without_recapture():
    m = Scaled()
    g = autograph.graphed(m)
    check(g, m, 4)
    with torch.no_grad():
        m.load_state_dict({k: torch.randn_like(v) for k, v in m.state_dict().items()})
    check(g, m)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    check(g, m)
    s = autograph.stats(g)
    assert s["captures"] == 1 and s["invalidations"] == 0


@pytest.mark.parametrize(
    "change",
    [
        lambda m: setattr(m.fc.weight, "data", torch.randn(4, 4)),
        lambda m: setattr(m.fc, "weight", nn.Parameter(torch.randn(4, 4))),
        lambda m: m.fc.register_parameter("bias", nn.Parameter(torch.randn(4))),
        lambda m: setattr(m, "scale", 3.0),
        lambda m: setattr(m, "use_relu", True),
        lambda m: setattr(m, "act", nn.Tanh()),
        lambda m: m.fc.__delattr__("bias") or m.fc.register_parameter("bias", None),
    ],
    ids=["data", "new-parameter", "register", "float", "flag", "submodule", "delete"],
)
def test_state_changes_drop_graphs(change):
    m = Scaled()
    g = autograph.graphed(m)
    check(g, m, 4)
    change(m)
    check(g, m, 4)
    s = autograph.stats(g)
    assert s["invalidations"] == 1 and s["captures"] == 2


def test_dtype_change_recaptures():
    m = Scaled()
    g = autograph.graphed(m)
    check(g, m, 4)
    g.double()
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(2, 4, dtype=torch.float64)
            out = g(x)
            assert out.dtype == torch.float64
            torch.testing.assert_close(out, m(x))
    assert autograph.stats(g)["invalidations"] == 1


def test_buffer_replaced_by_apply_is_seen():
    m = nn.BatchNorm1d(4).eval()
    g = autograph.graphed(m)
    check(g, m, 4)
    m._apply(lambda t: t * 2 if t.dtype.is_floating_point else t)  # new buffer objects
    check(g, m, 4)
    assert autograph.stats(g)["invalidations"] == 1


def test_same_value_assignment_keeps_graphs():
    m = Scaled()
    g = autograph.graphed(m)
    check(g, m, 4)
    m.eval()
    m.eval()
    m.use_relu = False
    m.scale = 1.0
    check(g, m)
    # eval() flipped training once: one invalidation, then nothing more
    assert autograph.stats(g)["invalidations"] <= 1


def test_forward_that_assigns_attributes_runs_eagerly():
    class Stepper(nn.Module):
        def __init__(self):
            super().__init__()
            self.steps = 0

        def forward(self, x):
            self.steps += 1
            return x * self.steps

    m = Stepper()
    g = autograph.graphed(m)
    with torch.no_grad():
        for i in range(5):
            torch.testing.assert_close(g(torch.ones(1)), torch.tensor([i + 1.0]))
    s = autograph.stats(g)
    assert s["captures"] == 0 and s["invalidations"] == 0
    assert s["eager_reasons"].get("assigns_attribute", 0) >= 3
    assert "Stepper.steps" in s["eager_details"]["assigns_attribute"]


def test_modules_and_tensors_in_globals_and_closures_are_tracked():
    lin = nn.Linear(3, 3)
    bias = torch.randn(3)
    k = 2.0

    @autograph.graphed
    def f(x):
        return lin(x) * k + bias

    def expect(x):
        return lin(x) * k + bias

    def run():
        with torch.no_grad():
            for _ in range(3):
                x = torch.randn(1, 3)
                torch.testing.assert_close(f(x), expect(x))

    run()
    lin.weight = nn.Parameter(torch.randn(3, 3))
    run()
    bias = torch.randn(3)  # rebinds the closure cell
    run()
    k = 5.0
    run()
    lin.weight.data = torch.randn(3, 3)
    run()
    assert autograph.stats(f)["invalidations"] == 4


NAMED = torch.ones(3)


def check_named_tensors_given_other_memory_in_place_are_seen(device):
    """A tensor the code names (a global, a closure cell, a plain object's attribute)
    given other memory in place (``.data =``, ``set_``) is the same object at another
    address: a graph would keep reading the old memory, so the graphs are dropped."""
    global NAMED
    NAMED = torch.ones(3, device=device)
    scale = torch.full((3,), 2.0, device=device)

    class Holder:
        def __init__(self):
            self.shift = torch.zeros(3, device=device)

        @autograph.graphed
        def step(self, x):
            return (x + NAMED) * scale + self.shift

    holder = Holder()

    def check(calls=4):
        with torch.no_grad():
            for _ in range(calls):
                x = torch.randn(3, device=device)
                torch.testing.assert_close(holder.step(x), (x + NAMED) * scale + holder.shift)

    check()
    NAMED.data = torch.full((3,), 3.0, device=device)
    check()
    scale.set_(torch.full((3,), 5.0, device=device))
    check()
    holder.shift.data = torch.full((3,), 7.0, device=device)
    check()
    s = autograph.stats(holder.step)
    assert s["invalidations"] == 3 and s["captures"] == 4 and s["replays"] >= 8, s


def test_named_tensors_given_other_memory_in_place_are_seen(standin):
    check_named_tensors_given_other_memory_in_place_are_seen("cpu")


COUNT = torch.zeros(3)
COUNT_EAGER = torch.zeros(3)


def bump(x):
    COUNT.add_(1)
    return x * 2


def bump_eager(x):
    COUNT_EAGER.add_(1)
    return x * 2


class Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("n", torch.zeros(3))
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        self.n.add_(1)
        return self.lin(x) + x


def check_argument_sharing_written_state(where, device):
    """A call that passes (a view of) a buffer or a named global that the call writes,
    where earlier calls of the key passed a separate tensor: another key, captured with
    that argument at its own address, so it reads the write as eager does (a private
    copy made before the replay read it stale)."""
    global COUNT, COUNT_EAGER
    if where == "buffer":
        mine, eager = Counter().to(device), Counter().to(device)
        eager.load_state_dict(mine.state_dict())
        g = autograph.graphed(mine)
        state, eager_state, view = (lambda: mine.n), (lambda: eager.n), (lambda t: t)
    else:
        COUNT, COUNT_EAGER = torch.zeros(3, device=device), torch.zeros(3, device=device)
        g, eager = autograph.graphed(bump), bump_eager
        state, eager_state, view = (lambda: COUNT), (lambda: COUNT_EAGER), (lambda t: t[1:])
    separate = torch.randn(3, device=device)
    with torch.no_grad():
        for i in range(12):
            aliased = i % 3 != 0 and i > 4
            got = g(view(state() if aliased else separate))
            want = eager(view(eager_state() if aliased else separate))
            assert torch.equal(got, want), (i, got, want)
            assert torch.equal(state(), eager_state())
    s = autograph.stats(g)
    assert s["captures"] == 2 and s["replays"] >= 5, s


def check_written_state_passed_from_the_first_call(device):
    """Under ``warmup=0`` no warmup learns that the call's write to a buffer (or a global)
    reaches the argument that is that buffer: the capture finds it, runs that call
    eagerly (the capture wrote nothing) and captures it in place at the next call;
    before, the first replay's copy-back of the stale argument undid the write."""
    mine, eager = Counter().to(device), Counter().to(device)
    eager.load_state_dict(mine.state_dict())
    g = autograph.graphed(mine, warmup=0)
    with torch.no_grad():
        for i in range(6):
            got, want = g(mine.n), eager(eager.n)
            assert torch.equal(got, want), (i, got, want)
            assert torch.equal(mine.n, eager.n), (i, mine.n, eager.n)
    s = autograph.stats(g)
    assert s["replays"] >= 3, s


def test_written_state_passed_from_the_first_call_under_warmup_0(standin):
    check_written_state_passed_from_the_first_call("cpu")


def check_argument_sharing_a_hidden_tensor(device):
    """The same for a tensor the forward reaches through a plain object (no module
    state, no named global: a hidden read) and writes: passed as an argument, it reads
    the write."""
    class Holder:
        def __init__(self):
            self.t = torch.zeros(4, device=device)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.h = Holder()

        def forward(self, x, r):
            self.h.t.add_(x)
            return r * 1

    eager, mine = M(), M()
    g = autograph.graphed(mine)
    with torch.no_grad():
        for i in range(10):
            x = torch.ones(4, device=device)
            r = torch.full((4,), -1.0, device=device)
            want = eager(x, r if i < 4 else eager.h.t)
            got = g(x, r if i < 4 else mine.h.t)
            assert torch.equal(got, want), (i, got, want)
    s = autograph.stats(g)
    assert s["captures"] == 2 and s["replays"] >= 4, s


def test_an_argument_sharing_a_hidden_tensor_reads_the_write(standin):
    check_argument_sharing_a_hidden_tensor("cpu")


@pytest.mark.parametrize("where", ["buffer", "global"])
def test_an_argument_sharing_written_state_reads_the_write(standin, where):
    check_argument_sharing_written_state(where, "cpu")


GLOBAL_MODEL = nn.Linear(2, 2)


@autograph.graphed
def uses_global(x):
    return GLOBAL_MODEL(x)


def test_global_module_rebinding_is_tracked():
    global GLOBAL_MODEL
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(1, 2)
            torch.testing.assert_close(uses_global(x), GLOBAL_MODEL(x))
        GLOBAL_MODEL = nn.Linear(2, 2)
        for _ in range(3):
            x = torch.randn(1, 2)
            torch.testing.assert_close(uses_global(x), GLOBAL_MODEL(x))


def test_autograd_recording_runs_eagerly_with_eager_gradients():
    m = Scaled()
    g = autograph.graphed(m, backward=False)  # graphed for training: tests/test_backward.py
    x = torch.randn(2, 4)
    for _ in range(4):
        g(x).sum().backward()
    grads = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    for _ in range(4):
        m(x).sum().backward()
    for a, b in zip(grads, [p.grad for p in m.parameters()]):
        torch.testing.assert_close(a, b)
    s = autograph.stats(g)
    assert s["captures"] == 0
    assert any("autograd" in r for r in s["eager_reasons"])


def test_grad_mode_without_anything_requiring_grad_is_graphed():
    m = Scaled().requires_grad_(False)
    g = autograph.graphed(m)
    check(g, m, 4)  # check() runs under no_grad; now with grad mode on
    for _ in range(3):
        x = torch.randn(2, 4)
        torch.testing.assert_close(g(x), m(x))
    assert autograph.stats(g)["captures"] == 2


def test_input_requiring_grad_runs_eagerly():
    @autograph.graphed(warmup=0, backward=False)
    def f(x):
        return (x * 2).sum()

    x = torch.randn(3, requires_grad=True)
    f(x).backward()
    torch.testing.assert_close(x.grad, torch.full((3,), 2.0))
    assert autograph.stats(f)["captures"] == 0


def test_module_with_hooks_runs_eagerly():
    m = Scaled()
    seen = []
    m.fc.register_forward_hook(lambda mod, inp, out: seen.append(out.shape))
    g = autograph.graphed(m)
    check(g, m, 4)
    s = autograph.stats(g)
    assert s["captures"] == 0 and "Linear has forward hooks" in s["eager_details"]["hooks"]
    assert len(seen) == 8


@pytest.mark.parametrize(
    "change",
    [
        lambda m: setattr(m.fc.weight, "data", torch.randn(4, 4)),
        lambda m: m.fc._parameters.__setitem__("weight", nn.Parameter(torch.randn(4, 4))),
        lambda m: torch.utils.swap_tensors(m.fc.bias, nn.Parameter(torch.randn(4))),
    ],
    ids=["data", "dict-entry", "swap-tensors"],
)
def test_parameters_moved_without_setattr_are_seen(change):
    m = Scaled()
    g = autograph.graphed(m)
    check(g, m, 4)
    change(m)
    check(g, m, 4)
    assert autograph.stats(g)["invalidations"] == 1


def test_a_collection_while_watches_are_registered_does_not_deadlock(monkeypatch):
    """A garbage collection inside the watch registry's lock can run a region module's
    weak reference callback, which closes that module's watch and takes the lock again
    on the same thread (seen as a hang of the GPU fuzz test)."""
    import threading

    from autograph import guards, notify

    model = nn.Linear(4, 4)
    with torch.no_grad(), autograph.capture_region():
        model(torch.randn(2, 4))  # a region engine whose watch dies with the module
    doomed = [model]
    del model
    real_set = guards.weakref.WeakSet

    def collecting_set(*args):
        if doomed:
            doomed.clear()  # the last reference: its callback runs right here
        return real_set(*args)

    monkeypatch.setattr(guards.weakref, "WeakSet", collecting_set)
    other = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    g = autograph.graphed(other)
    done = threading.Event()

    def call():
        with torch.no_grad():
            g(torch.randn(2, 4))
        done.set()

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(20)
    assert done.is_set(), "deadlocked: the registry lock was taken again by a callback"
    assert id(other) in notify.watched and any(notify.watched[id(other)])


def test_hooks_of_modules_a_function_or_a_plain_object_calls_run_every_call(standin):
    """A forward hook on a module that a graphed function names (a global) or that a
    graphed method's plain object holds runs in every eager call: those calls run
    eagerly (reason ``hooks``) instead of replaying without it."""
    model = nn.Linear(4, 4)
    runs = []
    model.register_forward_hook(lambda m, i, o: runs.append(1))

    def f(x):
        return model(x) * 2

    class Trainer:
        def __init__(self):
            self.model = model

        def step(self, x):
            return self.model(x) * 2

    for fn in (autograph.graphed(f), autograph.graphed(Trainer().step)):
        runs.clear()
        with torch.no_grad():
            for _ in range(6):
                fn(torch.randn(2, 4))
        assert len(runs) == 6
        s = autograph.stats(fn)
        assert s["replays"] == 0 and s["eager_reasons"].get("hooks") == 6, s


def test_hooks_of_a_graphed_forward_s_own_module_run_outside_it(standin):
    """``@graphed`` on ``forward``: the module's hooks run around the graphed forward
    (in ``Module.__call__``), so they do not stop it from replaying."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        @autograph.graphed
        def forward(self, x):
            return self.lin(x) * 2

    m = M()
    runs = []
    m.register_forward_hook(lambda mod, i, o: runs.append(1))
    with torch.no_grad():
        for _ in range(6):
            m(torch.randn(2, 4))
    assert len(runs) == 6
    assert autograph.stats(m.forward)["replays"] >= 3


def test_a_forward_hook_registered_after_capture_runs_and_its_removal_gives_graphs_back(
        standin):
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    g = autograph.graphed(m)
    x = torch.randn(3, 4)
    with torch.no_grad():
        for _ in range(4):
            torch.testing.assert_close(g(x), m(x))
        handle = m[1].register_forward_hook(lambda mod, i, o: o * 0 + 1)
        pre = m[2].register_forward_pre_hook(lambda mod, i: (i[0] * 2,))
        for _ in range(2):
            torch.testing.assert_close(g(x), m(x))
        assert autograph.stats(g)["eager_reasons"].get("hooks") == 2
        handle.remove()
        pre.remove()
        replays = autograph.stats(g)["replays"]
        for _ in range(2):
            torch.testing.assert_close(g(x), m(x))
    s = autograph.stats(g)
    assert s["replays"] == replays + 2 and s["captures"] == 1, s  # the same graph again


def test_a_global_forward_hook_registered_after_capture_runs(standin):
    from torch.nn.modules import module as mm

    m = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    g = autograph.graphed(m)
    x = torch.randn(3, 4)
    with torch.no_grad():
        for _ in range(4):
            g(x)
        handle = mm.register_module_forward_hook(lambda mod, i, o: o + 1)
        try:
            torch.testing.assert_close(g(x), m(x))
        finally:
            handle.remove()
        torch.testing.assert_close(g(x), m(x))
    s = autograph.stats(g)
    assert s["eager_reasons"].get("hooks") == 1 and s["replays"] >= 2, s


def test_a_backward_hook_registered_after_a_training_capture_runs(standin):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    ref = copy.deepcopy(m)
    g = autograph.graphed(m)
    x = torch.randn(3, 4)
    for _ in range(4):
        g(x).sum().backward()
    assert autograph.stats(g)["replays"] >= 1
    seen = []
    for mod in (m, ref):
        mod[1].register_full_backward_hook(lambda mod, gi, go: seen.append(1))
        mod.zero_grad()
    g(x).sum().backward()
    ref(x).sum().backward()
    assert len(seen) == 2
    for a, b in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


def test_graphs_come_back_only_once_every_forward_hook_is_removed(standin):
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    g = autograph.graphed(m)
    x = torch.randn(3, 4)
    with torch.no_grad():
        for _ in range(4):
            g(x)
        first = m[0].register_forward_hook(lambda mod, i, o: o + 1)
        second = m[2].register_forward_hook(lambda mod, i, o: o * 2)
        torch.testing.assert_close(g(x), m(x))
        first.remove()  # the hook the reason named: the other one still forbids graphs
        torch.testing.assert_close(g(x), m(x))
        second.remove()
        replays = autograph.stats(g)["replays"]
        torch.testing.assert_close(g(x), m(x))
    s = autograph.stats(g)
    assert s["eager_reasons"]["hooks"] == 2 and s["replays"] == replays + 1, s


def test_a_constant_made_with_torch_tensor_is_no_hidden_read(standin):
    """``torch.tensor(0.5)`` in the forward is the call's own tensor (made from Python
    values), not state read from outside: the graphs replay and stay valid."""
    @autograph.graphed(warmup=1)
    def f(x, step):
        return x * torch.tensor(0.5) + torch.tensor(step)

    with torch.no_grad():
        for i in range(8):
            x = torch.randn(3)
            torch.testing.assert_close(f(x, i % 2), x * 0.5 + i % 2)
    s = autograph.stats(f)
    assert s["replays"] >= 4 and s["invalidations"] == 0


out = None  # a global named like the attribute Headed.forward reads (self.out)


class Headed(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.out = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.out(torch.relu(self.body(x)))


def check_global_named_like_an_attribute(device="cpu"):
    """Only the globals the code loads are guarded, not every name in ``co_names``:
    a caller's global ``out`` rebound every call leaves ``self.out``'s graphs alone
    (shared with tests/gpu)."""
    global out
    model = Headed().to(device)
    g = autograph.graphed(model)
    x = torch.randn(3, 4, device=device)
    out = model(x)  # a tensor when the watch first reads the globals
    with torch.no_grad():
        for _ in range(8):
            out = g(x)
            torch.testing.assert_close(out, model(x))
    s = autograph.stats(g)
    assert s["replays"] >= 4 and s["invalidations"] == 0, s


def test_a_global_named_like_an_attribute_is_not_guarded(standin):
    check_global_named_like_an_attribute()


class Sampler:
    """A plain object (no module) with graphed methods that read its attributes."""

    def __init__(self, model):
        self.model, self.temperature, self.steps = model, 1.0, 0

    @property
    def scale(self):
        return self.temperature * 2

    @autograph.graphed
    def probs(self, x):
        return torch.softmax(self.model(x) / self.temperature, -1)

    @autograph.graphed
    def scaled(self, x):  # reads the attribute through a property
        return self.model(x) * self.scale

    @autograph.graphed
    def counted(self, x):  # assigns an attribute: each call must run it
        self.steps += 1
        return self.model(x) * self.steps

    def plain(self, x):
        return self.model(x) - self.temperature


def check_plain_object_method_reads_its_attributes(device="cpu"):
    """A graphed method of a plain object: an attribute reassigned between calls (a
    sampling temperature) selects new graphs, also when read through a property; a
    method that assigns one runs eagerly (shared with tests/gpu)."""
    torch.manual_seed(0)
    s = Sampler(nn.Linear(4, 5).to(device))
    ref = Sampler(s.model)
    bound = autograph.graphed(s.plain)
    calls = [(s.probs, Sampler.probs.__wrapped__), (s.scaled, Sampler.scaled.__wrapped__),
             (s.counted, Sampler.counted.__wrapped__), (bound, Sampler.plain)]
    x = torch.randn(2, 4, device=device)
    with torch.no_grad():
        for graphed, eager in calls:
            for i in range(10):
                if i == 6:
                    s.temperature = ref.temperature = 0.1
                torch.testing.assert_close(graphed(x), eager(ref, x))
            s.temperature = ref.temperature = 1.0
    assert s.steps == ref.steps == 10
    for graphed, _ in calls:
        st = autograph.stats(graphed)
        if graphed == s.counted:
            assert st["eager_reasons"].get("assigns_attribute"), st
        else:
            assert st["replays"] >= 2 and st["invalidations"] >= 1, st


def test_a_plain_object_method_reads_its_attributes(standin):
    check_plain_object_method_reads_its_attributes()


class Predictor:
    """A plain object whose graphed method reads a function, a dict and a namespace it
    holds, as a function reads globals."""

    def __init__(self, model):
        self.model = model
        self.act = torch.relu
        self.cfg = {"scale": 1.0}
        self.ns = types.SimpleNamespace(bias=0.0, inner=types.SimpleNamespace(k=1.0))

    @autograph.graphed
    def step(self, x):
        return self.act(self.model(x)) * self.cfg["scale"] * self.ns.inner.k + self.ns.bias

    def eager(self, x):
        return self.act(self.model(x)) * self.cfg["scale"] * self.ns.inner.k + self.ns.bias


def check_an_owners_functions_dicts_and_namespaces_are_guarded(device="cpu"):
    torch.manual_seed(0)
    p = Predictor(nn.Linear(4, 4).to(device).eval())
    changes = [lambda: setattr(p, "act", torch.tanh), lambda: setattr(p, "cfg", {"scale": 3.0}),
               lambda: setattr(p.ns, "bias", 5.0), lambda: setattr(p.ns.inner, "k", 2.0)]
    with torch.no_grad():
        for change in [None, *changes]:
            if change is not None:
                change()
            for _ in range(4):
                x = torch.randn(2, 4, device=device)
                torch.testing.assert_close(p.step(x), p.eager(x))
    st = autograph.stats(p.step)
    assert st["replays"] >= 5 and st["invalidations"] >= 4, st


def test_an_owners_functions_dicts_and_namespaces_are_guarded(standin):
    check_an_owners_functions_dicts_and_namespaces_are_guarded()


@dataclasses.dataclass
class Opts:
    scale: float = 2.0
    shift: bool = False


class Configured(nn.Module):
    """Reads its flags from plain objects, as transformers' layers read ``self.config``."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.config = types.SimpleNamespace(double=False)
        self.opts = Opts()

    def forward(self, x):
        y = self.lin(x) * self.opts.scale
        if self.opts.shift:
            y = y + 1
        return y * 2 if self.config.double else y


@pytest.mark.parametrize("change", ["config", "dataclass", "dataclass flag", "none"])
def test_configuration_objects_are_guarded(change):
    check_configuration_objects_are_guarded(change)


def check_configuration_objects_are_guarded(change, device="cpu"):
    model = Configured().to(device)
    g = autograph.graphed(model)
    x = torch.randn(2, 4, device=device)
    with torch.no_grad():
        for _ in range(5):
            g(x)
        replays = autograph.stats(g)["replays"]
        if change == "config":
            model.config.double = True
        elif change == "dataclass":
            model.opts.scale = 3.0
        elif change == "dataclass flag":
            model.opts.shift = True
        for _ in range(5):
            torch.testing.assert_close(g(x), model(x))
    stats = autograph.stats(g)
    assert stats["invalidations"] == (change != "none")
    assert stats["replays"] >= replays + 2  # replays again (no invalidation per call)


def test_a_transformers_config_flag_is_guarded():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    g = autograph.graphed(model)
    ids = torch.randint(0, 64, (1, 8))
    with torch.no_grad():
        for _ in range(5):
            g(ids, use_cache=False)
        assert autograph.stats(g)["replays"] >= 2
        model.config.output_hidden_states = True  # read in the forward, at capture
        got, want = g(ids, use_cache=False), model(ids, use_cache=False)
    assert list(got.keys()) == list(want.keys()) == ["logits", "hidden_states"]
    for a, b in zip(got.hidden_states, want.hidden_states):
        torch.testing.assert_close(a, b)


EPSILON = 0.0
COUNT = None  # set to a numpy scalar by the test
SHIFT = 1 + 0j


def _over_epsilon(x):
    return x / EPSILON


def _times_count(x):
    return x * int(COUNT)


def _times_shift(x):
    return x * SHIFT.real


class _Signed(nn.Module):
    def __init__(self):
        super().__init__()
        self.shift = 0.0

    def forward(self, x):
        return torch.copysign(x, torch.full_like(x, self.shift))


def check_zero_signs_numpy_scalars_and_complex_values_are_guarded(device="cpu"):
    """A global or attribute changed from 0.0 to -0.0 (``x / eps`` gives infinities of
    the other sign), or holding a numpy scalar or a complex number, is guarded: the
    graphs baked in the old value (shared with tests/gpu)."""
    import numpy as np

    global EPSILON, COUNT, SHIFT
    EPSILON, COUNT, SHIFT = 0.0, np.int64(1), 1 + 0j
    x = torch.ones(2, device=device)
    module = _Signed().to(device)
    cases = [(_over_epsilon, "EPSILON", -0.0), (_times_count, "COUNT", np.int64(5)),
             (_times_shift, "SHIFT", 7 + 0j), (module, None, -0.0)]
    for fn, name, new in cases:
        g = autograph.graphed(fn)
        with torch.no_grad():
            for _ in range(4):
                torch.testing.assert_close(g(x), fn(x))
            if name is None:
                module.shift = new
            else:
                globals()[name] = new
            for _ in range(4):
                torch.testing.assert_close(g(x), fn(x))
        assert autograph.stats(g)["replays"] >= 2, autograph.stats(g)


def test_zero_signs_numpy_scalars_and_complex_values_are_guarded(standin):
    check_zero_signs_numpy_scalars_and_complex_values_are_guarded()


def _scaled(x, s, c):
    return x * float(s) + c.real


def _branch_on_conj(z):
    return z.imag * 2 if z.is_conj() else z.real * 3


def check_numpy_scalars_complex_and_conjugate_arguments_are_keyed(device="cpu"):
    """NumPy scalars and complex numbers passed as arguments are keyed by value (they
    ran eagerly, unkeyable), and a conjugate view is keyed apart from a plain tensor
    (a branch on ``z.is_conj()`` was baked in by the first one captured) (shared with
    tests/gpu)."""
    import numpy as np

    g = autograph.graphed(_scaled)
    b = autograph.graphed(_branch_on_conj)
    with torch.no_grad():
        for i in range(12):
            x = torch.randn(3, device=device)
            s, c = np.float32(0.5 + i % 2), complex(1.0, 2.0 + i % 2)
            torch.testing.assert_close(g(x, s, c), _scaled(x, s, c), rtol=0, atol=0)
            z = torch.randn(3, dtype=torch.complex64, device=device)
            z = z.conj() if i % 2 else z
            torch.testing.assert_close(b(z), _branch_on_conj(z), rtol=0, atol=0)
    assert autograph.stats(g)["replays"] >= 4, autograph.stats(g)
    assert autograph.stats(b)["replays"] >= 4, autograph.stats(b)


def test_numpy_scalars_complex_and_conjugate_arguments_are_keyed(standin):
    check_numpy_scalars_complex_and_conjugate_arguments_are_keyed()


def check_lazy_modules_initialise_then_graph(device="cpu"):
    """A module with lazy parameters (``nn.LazyLinear``) raised on its first call: the
    guard read the address of a parameter that has no memory yet.  Its first call
    initialises it eagerly, later calls graph (shared with tests/gpu)."""
    torch.manual_seed(0)
    lazy = torch.nn.Sequential(torch.nn.LazyLinear(6), torch.nn.ReLU(), torch.nn.LazyLinear(3))
    g = autograph.graphed(lazy.to(device))
    with torch.no_grad():
        for _ in range(6):
            x = torch.randn(4, 5, device=device)
            torch.testing.assert_close(g(x), lazy(x), rtol=0, atol=0)
    assert autograph.stats(g)["replays"] >= 2, autograph.stats(g)


def test_lazy_modules_initialise_then_graph(standin):
    check_lazy_modules_initialise_then_graph()


def _clip(params):
    return torch.nn.utils.clip_grad_norm_(params, 1.0)


def _trainable_norm(params):
    return sum(p.norm() for p in params if p.requires_grad)


def _freeze(x, p):
    p.requires_grad_(False)
    return x * 2


def check_gradients_and_flags_of_arguments_are_seen(device="cpu"):
    """A static buffer stood for an argument without its ``.grad`` or ``requires_grad``:
    ``clip_grad_norm_`` over parameters passed in clipped nothing, a filter on
    ``requires_grad`` kept nothing, ``requires_grad_`` inside the call never reached the
    caller (shared with tests/gpu)."""
    torch.manual_seed(0)
    clip, norm, freeze = (autograph.graphed(f) for f in (_clip, _trainable_norm, _freeze))
    params = [torch.randn(5, 3, device=device, requires_grad=True) for _ in range(3)]
    twins = [p.detach().clone().requires_grad_() for p in params]
    kept = []
    for i in range(9):
        for p, t in zip(params, twins):
            grad = torch.randn_like(p) * 3
            if i < 6 and p.grad is not None:  # gradients written in place, then new ones
                p.grad.copy_(grad)
                t.grad.copy_(grad)
            else:
                kept.append(p.grad)
                p.grad, t.grad = grad.clone(), grad.clone()
        with torch.no_grad():
            torch.testing.assert_close(clip(params), _clip(twins), rtol=0, atol=0)
            torch.testing.assert_close(norm(params), _trainable_norm(twins), rtol=0, atol=0)
            for p, t in zip(params, twins):
                torch.testing.assert_close(p.grad, t.grad, rtol=0, atol=0)
            q = torch.zeros(3, device=device, requires_grad=True)
            freeze(torch.randn(3, device=device), q)
            assert not q.requires_grad
    assert autograph.stats(clip)["replays"] >= 2, autograph.stats(clip)
    assert autograph.stats(norm)["replays"] >= 2, autograph.stats(norm)


def test_gradients_and_flags_of_arguments_are_seen(standin):
    check_gradients_and_flags_of_arguments_are_seen()


def check_an_optimizer_step_reads_the_gradients_it_is_given(device="cpu"):
    """A graphed function stepping an optimizer on gradients made outside it read the
    first capture's ``.grad`` tensors for ever: after ``zero_grad(set_to_none=True)`` and
    a backward (the old gradients kept alive elsewhere) the steps used stale
    gradients.  The ``.grad`` of each parameter is guarded (shared with tests/gpu)."""
    import copy

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3).to(device)
    twin = copy.deepcopy(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, twin)]
    kept = []

    @autograph.graphed
    def step(x):
        opts[0].step()
        return x * 2

    for set_to_none in (False, True):
        for _ in range(5):
            x = torch.randn(2, 4, device=device)
            for m, opt in zip((model, twin), opts):
                opt.zero_grad(set_to_none=set_to_none)
                m(x).pow(2).sum().backward()
            kept += [p.grad for p in model.parameters()]  # new gradients, old ones alive
            with torch.no_grad():
                step(x)
            opts[1].step()
            for a, b in zip(model.parameters(), twin.parameters()):
                torch.testing.assert_close(a, b)
    assert autograph.stats(step)["replays"] >= 2, autograph.stats(step)


def test_an_optimizer_step_reads_the_gradients_it_is_given(standin):
    check_an_optimizer_step_reads_the_gradients_it_is_given()


class _Knob:
    k = 0.0


_KNOB = _Knob()


def check_function_arguments_are_keyed_by_code_and_values(device="cpu"):
    """A function, partial or callable object passed as an argument: a lambda made per
    call (whose freed predecessor's id it may take) is keyed by its code and the
    values it closes over, a partial by its parts, a callable object by its
    attributes: each call gets eager's result; equal ones replay."""
    import functools

    def apply(x, fn):
        return fn(x)

    class Scale:
        def __init__(self, s):
            self.s = s

        def __call__(self, t):
            return t * self.s

    def make(s):
        return lambda t: t * s

    x = torch.ones(2, device=device)
    scale = Scale(1.0)
    makers = [make, lambda s: functools.partial(torch.mul, other=s)]
    for maker in makers:
        g = autograph.graphed(apply)
        with torch.no_grad():
            for i in range(12):
                value = float(i // 4)  # equal values for four calls in a row
                torch.testing.assert_close(g(x, maker(value)), x * value)
        assert autograph.stats(g)["replays"] >= 3, autograph.stats(g)
    g = autograph.graphed(apply)
    with torch.no_grad():
        for i in range(12):
            scale.s = float(i // 4)
            torch.testing.assert_close(g(x, scale), x * scale.s)
    assert autograph.stats(g)["replays"] >= 3, autograph.stats(g)
    # what a lambda made per call reads: a global object's attribute, a class value
    g = autograph.graphed(apply)
    with torch.no_grad():
        for i in range(12):
            _Knob.k = _KNOB.s = float(i // 4)
            for fn in (lambda t: t * _KNOB.s, lambda t: t * _Knob.k):
                torch.testing.assert_close(g(x, fn), x * _KNOB.s)
    assert autograph.stats(g)["replays"] >= 3, autograph.stats(g)


def test_function_arguments_are_keyed_by_code_and_values(standin):
    check_function_arguments_are_keyed_by_code_and_values()


class _ScriptedScale(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)
        self.scale = 2.0

    def forward(self, x):
        return self.norm(self.lin(x)) * self.scale


class _ScriptedCounter(nn.Module):
    steps: int

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.steps = 0

    def forward(self, x):
        self.steps += 1
        return self.lin(x) * float(self.steps)


def check_scripted_modules_attributes_and_modes_are_seen(device="cpu"):
    """A ``torch.jit.script`` module keeps its attributes and ``training`` in its C++
    object, past ``nn.Module.__setattr__``: an attribute assigned between calls and
    ``eval()`` on it or its scripted submodule are seen, and a scripted forward that
    assigns its own attribute runs eagerly (shared with tests/gpu)."""
    torch.manual_seed(0)
    scripted = torch.jit.script(_ScriptedScale()).to(device)
    g = autograph.graphed(scripted)
    x = torch.randn(3, 4, device=device)

    def same_as_eager():
        got = g(x)
        with autograph.disabled():
            want = scripted(x)
        torch.testing.assert_close(got, want)

    with torch.no_grad():
        for change in (lambda: None, lambda: setattr(scripted, "scale", 5.0),
                       lambda: scripted.norm.eval(), lambda: scripted.train()):
            change()
            for _ in range(4):
                same_as_eager()
    assert autograph.stats(g)["replays"] >= 4, autograph.stats(g)
    counter = torch.jit.script(_ScriptedCounter()).to(device)
    h = autograph.graphed(counter)
    with torch.no_grad():
        for i in range(5):
            torch.testing.assert_close(h(x), counter.lin(x) * float(i + 1))
    assert autograph.stats(h)["eager_reasons"].get("assigns_attribute"), autograph.stats(h)


def test_scripted_modules_attributes_and_modes_are_seen(standin):
    check_scripted_modules_attributes_and_modes_are_seen()


class _WithScripted(nn.Module):
    def __init__(self):
        super().__init__()
        self.sub = torch.jit.script(nn.Linear(4, 4))
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(torch.relu(self.sub(x)))


def check_a_scripted_submodule_trains(device="cpu"):
    """A module holding a ``torch.jit.script`` submodule (whose parameter dict has no
    ``get``), called under grad mode, replays with eager's outputs and gradients
    (a second seeded instance: a deepcopy of a scripted module has non-leaf
    parameters)."""
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(_WithScripted().to(device))
    model, twin = models
    g = autograph.graphed(model)
    for _ in range(5):
        x = torch.randn(3, 4, device=device)
        got, want = g(x), twin(x)
        torch.testing.assert_close(got, want)
        got.square().sum().backward()
        want.square().sum().backward()
        for p, q in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
    assert autograph.stats(g)["replays"] >= 2, autograph.stats(g)


def test_a_scripted_submodule_trains(standin):
    check_a_scripted_submodule_trains()


def test_non_leaf_arguments_raise_no_warning(standin):
    """Reading a non-leaf argument's ``.grad`` warns (an error under ``-W error``): a
    graphed head on a backbone's output, under grad mode, must not read it."""
    import warnings

    backbone, head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)
    g = autograph.graphed(head)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(5):
            x = torch.randn(3, 4)
            torch.testing.assert_close(g(backbone(x)), head(backbone(x)))
    assert autograph.stats(g)["replays"] >= 1, autograph.stats(g)


class _Calibrating(torch.nn.Module):
    """Recalibrates a plain attribute whenever the batch size changes."""

    def __init__(self):
        super().__init__()
        self.n, self.scale = None, 1.0

    def forward(self, x):
        if self.n != x.shape[0]:
            self.n = x.shape[0]
            self.scale = 1.0 / float(x.abs().max())
        return x * self.scale


class _Growing(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Identity()])

    def forward(self, x):
        self.blocks.insert(0, torch.nn.Identity())
        return x * len(self.blocks)


def _reads_its_grad(w, x):
    return x * w + w.grad if w.grad is not None else x * w


def test_attributes_set_by_other_keys_and_containers_changed_in_place(standin):
    """A warmup of one key that left a module attribute changed (a recalibration per
    batch size) left the graphs of other keys replaying the old value; a forward
    growing a ``ModuleList`` with ``insert`` was taken for no change (a set-and-reset
    check compared the list's dict with itself)."""
    import copy

    for make, sizes in ((_Calibrating, [4] * 4 + [5] * 4 + [4] * 3), (_Growing, [3] * 6)):
        m = make()
        twin, g = copy.deepcopy(m), autograph.graphed(m)
        with torch.no_grad():
            for n in sizes:
                x = torch.randn(n, 3)
                torch.testing.assert_close(g(x), twin(x))
        if make is _Calibrating:  # a graph's results were among those compared
            assert autograph.stats(g)["captures"] >= 1, autograph.stats(g)


def test_later_gradients_numpy_floats_in_objects_negative_views_and_attributes(standin):
    """A ``.grad`` None at capture and set later was not seen (the code names
    ``.grad``); ``np.float64(-0.0)`` inside an object argument shared 0.0's key; a
    negative view next to another argument failed every replay (batched copies refuse
    it); a tensor argument with a Python attribute (``_is_hf_initialized``) ran
    eagerly."""
    import numpy as np

    g = autograph.graphed(_reads_its_grad)
    w = torch.randn(3, requires_grad=True)
    with torch.no_grad():
        for i in range(7):
            if i == 4:
                w.grad = torch.ones(3)
            x = torch.randn(3)
            torch.testing.assert_close(g(w, x), _reads_its_grad(w, x))

    class Cfg:
        def __init__(self, sign):
            self.sign = sign

    signed = autograph.graphed(lambda t, cfg: torch.copysign(t, torch.tensor(cfg.sign)))
    t = torch.rand(3) + 1
    for i in range(7):
        s = np.float64(0.0) if i < 4 else np.float64(-0.0)
        torch.testing.assert_close(signed(t, Cfg(s)), torch.copysign(t, torch.tensor(s)))

    h = autograph.graphed(lambda x, y: x * 2 + y)
    tagged = autograph.graphed(lambda x: x * 2)
    for _ in range(6):
        x = torch.randn(4, 3, dtype=torch.cfloat).conj().imag
        y = torch.randn(4, 3)
        torch.testing.assert_close(h(x, y), x * 2 + y)
        y._is_hf_initialized = True
        torch.testing.assert_close(tagged(y), y * 2)
    for fn in (h, tagged):
        assert autograph.stats(fn)["replays"] >= 2, autograph.stats(fn)


def test_slices_and_ranges_are_keyed(standin):
    """A ``slice`` or ``range`` argument (``f(x, slice(0, 4))``) ran every call
    eagerly (unkeyable): they are keyed by their parts."""
    g = autograph.graphed(lambda x, s, r: x[s] * len(r))
    for i in range(12):
        x, s, r = torch.randn(6), slice(0, 2 + i % 2), range(i % 2 + 1)
        torch.testing.assert_close(g(x, s, r), x[s] * len(r))
    assert autograph.stats(g)["replays"] >= 4, autograph.stats(g)


class _Appending(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.cache = torch.zeros(1)

    def forward(self, x):
        self.cache = torch.cat([self.cache, x])
        return x * 2


def test_eager_calls_keep_no_assigned_values_alive(standin):
    """The values a running call's assignments replaced are noted for warmups (to undo
    a failed capture's); an eager call's were kept by the watch until the next
    warmup (an old cache tensor held for ever by a key that runs eagerly)."""
    from autograph.lookup import _engines_of

    m = _Appending()
    g = autograph.graphed(m)
    with torch.no_grad():
        for _ in range(8):
            g(torch.randn(2))
    (engine,) = _engines_of(g)
    assert engine.watch.assignments == []
    assert autograph.stats(g)["eager_reasons"].get("assigns_attribute")


def check_swapped_parameters_after_training_calls(device):
    """``torch.utils.swap_tensors`` (``.to()`` and ``load_state_dict`` under
    ``set_swap_module_params_on_conversion``) refuses a tensor with a weak reference: a
    graphed call under grad mode kept one to a parameter, and ``.double()`` raised."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).to(device)
        twin = copy.deepcopy(model)
        g = autograph.graphed(model)
        for _ in range(2):  # its warmups (a training graph holds the parameters, which
            x = torch.randn(3, 8, device=device)  # swap_tensors refuses too)
            g(x).sum().backward()
            twin(x).sum().backward()
        model.load_state_dict(twin.state_dict())
        model.double()
        twin.double()
        with torch.no_grad():
            for _ in range(5):
                x = torch.randn(3, 8, device=device, dtype=torch.float64)
                torch.testing.assert_close(g(x), twin(x))
        assert autograph.stats(g)["replays"] >= 2
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)


def test_swapped_parameters_after_training_calls(standin):
    check_swapped_parameters_after_training_calls("cpu")


@dataclasses.dataclass(slots=True)
class _SlottedCfg:
    temperature: float = 1.0


class _SlottedSetting:
    __slots__ = ("t",)

    def __init__(self):
        self.t = 1.0


SLOTTED_CFG = _SlottedCfg()
SLOTTED_SETTING = _SlottedSetting()


@dataclasses.dataclass
class _MixedCfg(_SlottedCfg):  # a slotted base, a __dict__ of its own
    gain: float = 1.0


class _Configured(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.cfg = _SlottedCfg()  # slotted: no __dict__
        self._cfg = dataclasses.make_dataclass("PrivateCfg", [("shift", float, 0.0)])()
        self.mixed = _MixedCfg()

    def forward(self, x):
        y = self.fc(x) / self.cfg.temperature + self._cfg.shift
        return y * self.mixed.temperature * self.mixed.gain


def _scale_of(module):  # a helper the forward calls: reads ``module.opts``
    return module.opts.scale


class _HelperReads(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.opts = dataclasses.make_dataclass("Opts", [("scale", float, 1.0)])()

    def forward(self, x):
        return self.fc(x) * _scale_of(self)


def check_slotted_and_private_configs_are_seen(device="cpu"):
    """A ``@dataclass(slots=True)`` config a module holds, one under a private name
    (``self._cfg``), one with a slotted base and a ``__dict__``, and slotted objects
    named as globals, and one a helper function reads, changed between calls, give the
    new value (the graphs replayed the old one)."""
    m = _Configured().to(device)
    g = autograph.graphed(m)

    def f(x):
        return x / SLOTTED_CFG.temperature * SLOTTED_SETTING.t

    gf = autograph.graphed(f)
    changes = {4: lambda: setattr(m.cfg, "temperature", 0.5),
               7: lambda: setattr(m._cfg, "shift", 3.0),
               10: lambda: setattr(SLOTTED_CFG, "temperature", 0.25),
               13: lambda: setattr(SLOTTED_SETTING, "t", 3.0),
               16: lambda: setattr(m.mixed, "temperature", 2.0),  # its slot
               19: lambda: setattr(m.mixed, "gain", 3.0)}
    try:
        with torch.no_grad():
            for i in range(22):
                changes.get(i, lambda: None)()
                x = torch.randn(2, 4, device=device)
                want = (m.fc(x) / m.cfg.temperature + m._cfg.shift) * m.mixed.temperature \
                    * m.mixed.gain
                torch.testing.assert_close(g(x), want)
                torch.testing.assert_close(gf(x), f(x))
    finally:
        SLOTTED_CFG.temperature, SLOTTED_SETTING.t = 1.0, 1.0
    assert autograph.stats(g)["replays"] >= 8, autograph.stats(g)
    assert autograph.stats(gf)["replays"] > 0
    h = _HelperReads().to(device)  # a dataclass a helper function reads
    gh = autograph.graphed(h)
    with torch.no_grad():
        for i in range(8):
            if i == 5:
                h.opts.scale = 3.0
            x = torch.randn(2, 4, device=device)
            torch.testing.assert_close(gh(x), h.fc(x) * h.opts.scale)
    assert autograph.stats(gh)["replays"] > 0


def test_slotted_and_private_configs_are_seen():
    check_slotted_and_private_configs_are_seen()


class _Schedule:
    def __init__(self):
        self.step = 0

    def __iter__(self):
        return self

    def __next__(self):
        self.step += 1
        return min(self.step / 5, 1.0)


class _Stepping(nn.Module):
    """Advances a counter on an object it holds: a warmup schedule, alternating
    branches, a tensor kept on the object."""

    def __init__(self, holder):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.state = holder
        self.counter = itertools.count()
        self.turns = itertools.cycle([1, -1, 2])
        self.sched = _Schedule()  # an iterator of the user's class: by its attributes
        self.hist = [0] * 300  # a large list changed in its middle
        self.lazy = types.SimpleNamespace(scale=None)
        self.log = types.SimpleNamespace(history=[0.0] * 300)  # a large list inside

    def forward(self, x, which):
        if self.lazy.scale is None:  # set once: learned again, then graphed
            self.lazy.scale = 2.0
        y = self.fc(x) * self.lazy.scale
        if which == "step":
            self.state.step += 1
            return y * min(self.state.step / 10, 1.0)
        if which == "count":
            return y if next(self.counter) % 2 == 0 else -y
        if which == "cycle":
            return y * next(self.turns)
        if which == "sched":
            return y * next(self.sched)
        if which == "middle":
            self.hist[100] += 1
            return y * self.hist[100]
        if which == "history":
            self.log.history.append(y.sum())
            return y - 1
        if which == "keep":
            self.state.last = y
            return y + 1
        return y


def check_objects_a_module_holds_changed_by_the_call(device="cpu"):
    """A call that changes an attribute of a plain object its module holds (a step
    counter on a ``SimpleNamespace`` or a slotted dataclass, an ``itertools.count`` or
    ``cycle``, a generator or an iterator of the user's class advanced, a tensor stored
    there, a large list appended to or changed in its middle) runs eagerly
    (with ``warmup=0`` too: the capture's change is put back before the eager run): a
    replay would freeze the counter and leave the graph's own tensor there.  One set
    once (a lazy set-up) is graphed."""
    @dataclasses.dataclass(slots=True)
    class Slotted:
        step: int = 0
        last: object = None

    class Generating(nn.Module):  # a generator: its frame does not show where it is
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.gen = (v for v in [0.5] * 3 + [2.0] * 50)

        def forward(self, x):
            return self.fc(x) * next(self.gen)

    m, ref = Generating().to(device), Generating().to(device)
    ref.load_state_dict(m.state_dict())
    g = autograph.graphed(m)
    with torch.no_grad():
        for _ in range(8):
            x = torch.randn(2, 4, device=device)
            torch.testing.assert_close(g(x), ref(x))
    idle = threading.Event()  # another thread alive: an object is put back still
    other = threading.Thread(target=idle.wait, daemon=True)
    other.start()
    try:
        _objects_changed_by_the_call(device, Slotted)
    finally:
        idle.set()
        other.join()


def _objects_changed_by_the_call(device, Slotted):
    for holder, warmup in ((types.SimpleNamespace(step=0, last=None), {}),
                           (Slotted(), {}), (types.SimpleNamespace(step=0, last=None),
                                             {"warmup": 0})):
        m = _Stepping(holder).to(device)
        ref = _Stepping(copy.deepcopy(holder)).to(device)  # (a generator: no deepcopy)
        ref.load_state_dict(m.state_dict())
        g = autograph.graphed(m, **warmup)  # (0: the capture's change put back)
        with torch.no_grad():
            for which in ("step", "count", "cycle", "sched", "middle", "keep", "history",
                          "plain"):
                if warmup and which in ("count", "cycle", "middle"):
                    continue  # an iterator the capture advanced is not put back, nor a
                    # container's items other than tensors while other threads run
                for _ in range(6):
                    x = torch.randn(2, 4, device=device)
                    torch.testing.assert_close(g(x, which), ref(x, which))
                    assert m.state.step == ref.state.step
                    if which == "keep":
                        torch.testing.assert_close(m.state.last, ref.state.last)
                    assert len(m.log.history) == len(ref.log.history)
        torch.testing.assert_close(torch.stack(m.log.history[300:]),
                                   torch.stack(ref.log.history[300:]))
        s = autograph.stats(g)
        assert s["replays"] > 0, s  # the "plain" calls
        assert s["eager_reasons"].get("assigns_attribute", 0) > 0, s


def test_objects_a_module_holds_changed_by_the_call():
    check_objects_a_module_holds_changed_by_the_call()


class _Counted(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.bn = nn.Linear(6, 6), nn.BatchNorm1d(6)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        self.count.add_(1)
        return self.bn(self.lin(x)) + self.count


def check_a_traced_module_that_fails_under_a_mode_runs(device="cpu"):
    """A ``torch.jit.trace``d module (batch norm in training mode, a buffer counted up)
    whose TorchScript interpreter raises on its first run under a dispatch mode, as
    autograph's warmup records: it raised on every call; now the warmup runs it again
    unrecorded and learns at the next one (results and buffers as eager's)."""
    traced = []
    for _ in range(2):
        torch.manual_seed(0)
        traced.append(torch.jit.trace(_Counted().to(device), torch.randn(4, 6, device=device),
                                      check_trace=False))
    model, twin = traced
    g = autograph.graphed(model)
    with torch.no_grad():
        for _ in range(6):
            x = torch.randn(4, 6, device=device)
            torch.testing.assert_close(g(x), twin(x))
            torch.testing.assert_close(model.bn.running_mean, twin.bn.running_mean)
            torch.testing.assert_close(model.count, twin.count)
    assert autograph.stats(g)["replays"] > 0, autograph.stats(g)


class _WithScriptedLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn, self.lin = nn.BatchNorm1d(4), torch.jit.script(nn.Linear(4, 4))

    def forward(self, x):
        return self.lin(self.bn(x))


def test_a_call_raising_in_a_module_with_torchscript_runs_once(standin):
    """A call that raises a user's error (a bad shape) in a module holding TorchScript
    runs once, as in eager mode (it ran again unrecorded: batch norm counted twice)."""
    m, twin = _WithScriptedLinear(), _WithScriptedLinear()
    g = autograph.graphed(m)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(3, 4)
            g(x)
            twin(x)
        for fn in (g, twin):
            with pytest.raises(RuntimeError):
                fn(torch.randn(3, 5))
    assert int(m.bn.num_batches_tracked) == int(twin.bn.num_batches_tracked) == 5
    torch.testing.assert_close(m.bn.running_mean, twin.bn.running_mean)


def test_a_traced_module_that_fails_under_a_mode_runs(standin):
    check_a_traced_module_that_fails_under_a_mode_runs()


def check_an_exported_program_module_replays(device="cpu"):
    """``torch.export.export(m, ...).module()`` carries torch's own forward hooks (an
    input check, an enter and exit pair): it ran eagerly for them; a replay may skip
    them (the key it serves passed the check).  A user's hook added later still makes
    the calls eager."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2)).to(device)
    exported = torch.export.export(m, (torch.randn(3, 4, device=device),)).module()
    g = autograph.graphed(exported)
    with torch.no_grad():
        for _ in range(5):
            x = torch.randn(3, 4, device=device)
            torch.testing.assert_close(g(x), m(x))
    assert autograph.stats(g)["replays"] >= 2, autograph.stats(g)
    seen = Tally()
    exported.register_forward_hook(lambda *a: seen.tick())
    with torch.no_grad():
        for _ in range(3):
            g(torch.randn(3, 4, device=device))
    assert seen.n == 3


def test_an_exported_program_module_replays():
    check_an_exported_program_module_replays()


class _SlotBase:
    __slots__ = ("x", "y")


class _RaisingSlot(_SlotBase):
    __slots__ = ()

    @property
    def x(self):  # over the base's slot
        raise RuntimeError("no x here")


class _RaisingDict:
    @property
    def __dict__(self):
        raise RuntimeError("no dict")


class _HoldsOdd(nn.Module):
    def __init__(self, odd):
        super().__init__()
        self.fc, self.odd, self.cfg = nn.Linear(4, 4), odd, odd

    def forward(self, x):
        return self.fc(x) * 2


def test_odd_objects_a_module_holds_raise_nothing():
    """Objects whose attribute reads raise (a property over a slot, a ``__dict__``
    property) held by a module: autograph's reads of them raised the user's error."""
    for odd in (_RaisingSlot(), _RaisingDict()):
        m = _HoldsOdd(odd)
        g = autograph.graphed(m)
        with torch.no_grad():
            for _ in range(5):
                x = torch.randn(2, 4)
                torch.testing.assert_close(g(x), m.fc(x) * 2)
        assert autograph.stats(g)["replays"] > 0


class _Vocab:
    def __init__(self):
        self.vocab = {f"t{i}": i for i in range(60_000)}  # a tokenizer's: large


class _TrainsWithState(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.turns = itertools.cycle([1.0, 0.5, 0.25])
        self.tokenizer = _Vocab()
        self.untouched = iter(range(1000))  # held, never advanced: no change
        self.frozen = _FrozenMemo()

    def forward(self, x, which):
        if which == "cycle":
            return self.fc(x) * next(self.turns)
        if which == "memo":
            object.__setattr__(self.frozen, "calls", self.frozen.calls + 1)
        return self.fc(x)


@dataclasses.dataclass(frozen=True)
class _FrozenMemo:
    calls: int = 0


class _Logs(nn.Module):
    def __init__(self):
        super().__init__()
        self.history = []

    def forward(self, x):
        self.history.append(int(x.shape[0]))
        return x * 2


class _BigAndLogs(nn.Module):
    def __init__(self):
        super().__init__()
        self.big, self.logs = _TrainsWithState(), _Logs()

    def forward(self, x):
        return self.logs(self.big(x, "plain"))


def check_held_state_in_training_calls_and_big_objects(device="cpu"):
    """Training calls (grad on) advancing an iterator a module holds run eagerly from
    their learning warmup (the change was first seen at the capture, which cannot put
    an iterator back: one step ahead for good); a large object in one module does not
    hide another module's list (the budget ran out on a tokenizer's vocabulary); an
    iterator held and never advanced replays; a frozen dataclass changed with
    ``object.__setattr__`` at a capture is put back (it raised)."""
    for warmup in (2, 0):
        torch.manual_seed(0)
        m, ref = _TrainsWithState().to(device), _TrainsWithState().to(device)
        ref.load_state_dict(m.state_dict())
        g = autograph.graphed(m, warmup=warmup)
        for which in ("cycle", "plain", "memo"):
            if warmup == 0 and which == "cycle":
                continue  # (an iterator a capture advanced is not put back)
            for _ in range(5):
                x = torch.randn(2, 4, device=device)
                a, b = g(x, which), ref(x, which)
                torch.testing.assert_close(a, b)
                a.sum().backward()
                b.sum().backward()
                torch.testing.assert_close(m.fc.weight.grad, ref.fc.weight.grad)
                assert m.frozen.calls == ref.frozen.calls
        assert autograph.stats(g)["replays"] > 0  # "plain": the untouched iterator
        if warmup == 0 and threading.active_count() > 1:
            continue  # (a capture's append of a non-tensor stays while threads run)
        both = _BigAndLogs().to(device)
        glog = autograph.graphed(both, warmup=warmup)
        with torch.no_grad():
            for _ in range(5):
                glog(torch.randn(2, 4, device=device))
        assert both.logs.history == [2] * 5, both.logs.history


def test_held_state_in_training_calls_and_big_objects():
    check_held_state_in_training_calls_and_big_objects()


def test_frozen_scripted_modules_and_keys_never_repeating_under_warmup_0(standin):
    """A ``torch.jit.freeze``d module has no ``training`` attribute (reading it raised);
    with ``warmup=0`` every new key is captured at once, which is no sign that keys
    repeat: such a callable still gives up."""
    frozen = torch.jit.freeze(torch.jit.script(nn.Linear(4, 4).eval()))
    g = autograph.graphed(frozen)
    with torch.no_grad():
        for _ in range(4):
            g(torch.randn(2, 4))
    f = autograph.graphed(lambda x: x * 2, warmup=0)
    with torch.no_grad():
        for n in range(1, 80):
            f(torch.randn(n))
    assert "given_up" in autograph.stats(f)["eager_reasons"], autograph.stats(f)


class _Adapted(nn.Module):
    """A LoRA layer as PEFT writes it: the adapters merged into the base weight are
    listed in ``merged_adapters`` (``merge()`` appends, in place), per-adapter scales
    sit in a dict (``set_scale`` writes one in place), the active ones in a list."""

    def __init__(self):
        super().__init__()
        self.base = nn.Linear(4, 4)
        self.lora_a, self.lora_b = nn.Linear(4, 2, bias=False), nn.Linear(2, 4, bias=False)
        self.merged_adapters: list[str] = []
        self.scaling = {"default": 1.0}
        self.active = ["default"]
        self.nested = {"ranks": [2]}

    def delta(self):
        return self.lora_b.weight @ self.lora_a.weight * self.scaling["default"]

    def forward(self, x):
        y = self.base(x)
        if self.merged_adapters or not self.active:
            return y
        return y + self.lora_b(self.lora_a(x)) * self.scaling["default"] * self.nested["ranks"][0]


def check_containers_a_module_holds_changed_in_place_between_calls(device="cpu"):
    """Merging an adapter (``merged_adapters.append`` next to an in-place weight
    update), a scale set in a dict, an active list emptied and a nested list changed,
    each in place between calls, give eager's results (the graphs replayed the adapter
    path twice, or the old scale); the graphs come back after each change."""
    m = _Adapted().to(device)
    twin, g = copy.deepcopy(m), autograph.graphed(m)

    def merge(mod):
        mod.base.weight += mod.delta()
        mod.merged_adapters.append("default")

    def unmerge(mod):
        mod.base.weight -= mod.delta()
        mod.merged_adapters.pop()

    changes = {5: merge, 10: unmerge, 15: lambda mod: mod.scaling.update(default=0.5),
               20: lambda mod: mod.nested["ranks"].__setitem__(0, 4),
               25: lambda mod: mod.active.clear()}
    replays = []
    with torch.no_grad():
        for i in range(30):
            if i in changes:
                changes[i](m)
                changes[i](twin)
            x = torch.randn(2, 4, device=device)
            torch.testing.assert_close(g(x), twin(x))
            replays.append(autograph.stats(g)["replays"])
    for i in (9, 14, 19, 24, 29):  # each change's graphs replayed before the next
        assert replays[i] - replays[i - 3] >= 2, replays
    # a list no code of the module names (a loss history the loop appends to) is not
    # compared: appending to it drops no graph
    m.loss_history = []  # (a new attribute: the graphs go once, at the next call)
    with torch.no_grad():
        for _ in range(3):
            g(torch.randn(2, 4, device=device))
    before = autograph.stats(g)
    with torch.no_grad():
        for _ in range(8):
            x = torch.randn(2, 4, device=device)
            torch.testing.assert_close(g(x), twin(x))
            m.loss_history.append(0.5)
    after = autograph.stats(g)
    assert after["invalidations"] == before["invalidations"], after
    assert after["replays"] - before["replays"] >= 6, after


def test_containers_a_module_holds_changed_in_place_between_calls(standin):
    check_containers_a_module_holds_changed_in_place_between_calls()


class _Switched(nn.Module):
    """Flags a caller switches between calls: PEFT's ``disable_adapter()`` sets a bool
    on every adapter layer and back, a policy-and-reference loop (DPO) does so every
    step; a mode name; a step count."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.inner = nn.Linear(4, 4)
        self.inner.disabled = False
        self.mode = "sum"
        self.count = 0

    def forward(self, x):
        y = self.fc(x)
        if not self.inner.disabled:
            y = y + self.inner(x)
        y = y * 2 if self.mode == "double" else (y - 1 if self.mode is None else y)
        return y + self.count


def check_flags_switched_between_calls_select_graphs(device="cpu"):
    """A bool, string or None attribute switched back and forth between calls selects
    graphs as ``train()``/``eval()`` do (each switch dropped every graph, so a loop
    switching every step never replayed); its first switch drops them once.  A number
    set between calls still drops them (``model.count = i`` would make a key per step)."""
    m = _Switched().to(device)
    twin, g = copy.deepcopy(m), autograph.graphed(m)
    modes = ["sum", "double", None]
    with torch.no_grad():
        for i in range(36):
            for mod in (m, twin):
                mod.inner.disabled = i % 2 == 1
                mod.mode = modes[(i // 2) % 3]
            x = torch.randn(2, 4, device=device)
            torch.testing.assert_close(g(x), twin(x))
        s = autograph.stats(g)
        assert s["replays"] >= 12 and s["invalidations"] == 2, s  # the first switch of each
        for i in range(8):
            for mod in (m, twin):
                mod.count = i // 4  # two values, four calls each
            x = torch.randn(2, 4, device=device)
            torch.testing.assert_close(g(x), twin(x))
    assert autograph.stats(g)["invalidations"] == 3, autograph.stats(g)
    # a string set to a new value per request (an id): past MAX_FLAG_VALUES values it
    # drops the graphs per value again, rather than keep a graph per request
    with torch.no_grad():
        for i in range(60):
            for mod in (m, twin):
                mod.mode = f"request {i // 3}"
            x = torch.randn(2, 4, device=device)
            torch.testing.assert_close(g(x), twin(x))
    assert autograph.stats(g)["graphs"] <= 3, autograph.stats(g)  # (it kept 21)


def test_flags_switched_between_calls_select_graphs(standin):
    check_flags_switched_between_calls_select_graphs()


class _Adapters(nn.Module):
    """PEFT's LoRA layer keeps its active adapters as a list, a new one at each
    ``set_adapter`` (``self._active_adapter = ["b"]``), the same one set again per step
    in TRL's loops."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self._active_adapter = "a"

    def forward(self, x):
        y = self.fc(x)
        for name in self._active_adapter:
            y = y + getattr(self, name)(x)
        return y


def check_list_flags_switched_between_calls_select_graphs(device="cpu"):
    """A short list of strings set between calls (PEFT's ``set_adapter``) dropped every
    graph at each assignment, an equal one too: no replay in a loop switching adapters
    or setting the same one per step.  It selects graphs as a string flag does, and one
    changed in place (``append``) is seen."""
    m = _Adapters().to(device)
    twin, g = copy.deepcopy(m), autograph.graphed(m)
    with torch.no_grad():
        for i in range(24):
            for mod in (m, twin):
                mod._active_adapter = ["a"] if i < 8 or i % 2 else ["b"]
                if i == 20:
                    mod._active_adapter.append("a")  # in place: read per call
                if i == 22:
                    mod._active_adapter[0] = "b"
            x = torch.randn(2, 4, device=device)
            torch.testing.assert_close(g(x), twin(x))
    s = autograph.stats(g)
    assert s["replays"] >= 12 and s["invalidations"] <= 1, s
    with torch.no_grad():  # grown past a flag's length in place, then changed: seen
        for i in range(12):
            for mod in (m, twin):
                if i == 2:
                    mod._active_adapter.extend(["a"] * 8)
                if i == 8:
                    mod._active_adapter[0] = "a" if mod._active_adapter[0] == "b" else "b"
            x = torch.randn(2, 4, device=device)
            torch.testing.assert_close(g(x), twin(x))


def test_list_flags_switched_between_calls_select_graphs(standin):
    check_list_flags_switched_between_calls_select_graphs()


def _member(device):
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 3)).to(device)


ENSEMBLE_TUPLE: tuple[nn.Module, ...] = ()
ENSEMBLE_LIST: list[nn.Module] = []
ENSEMBLE_TWINS: list[nn.Module] = []


def _average_tuple(x):
    return sum(m(x) for m in ENSEMBLE_TUPLE) / len(ENSEMBLE_TUPLE)


def _average_list(x):
    return sum(m(x) for m in ENSEMBLE_LIST) / len(ENSEMBLE_LIST)


def _average_twins(x):
    return sum(m(x) for m in ENSEMBLE_TWINS) / len(ENSEMBLE_TWINS)


ENSEMBLE_PAIRS: list[tuple[nn.Module, nn.Module]] = []


def _pairs(x):
    return sum(b(a(x)) for a, b in ENSEMBLE_PAIRS)


def check_nested_and_rebound_ensembles_are_watched(device="cpu"):
    """Modules in tuples inside a global list (``[(encoder, head)]``) were not watched
    (an attribute set on one kept the old graph), and a global list of modules rebound
    to another list kept replaying the first list's graph."""
    global ENSEMBLE_PAIRS, ENSEMBLE_LIST
    torch.manual_seed(0)
    a, b, c = (nn.Linear(4, 4).to(device) for _ in range(3))
    ENSEMBLE_PAIRS = [(a, b)]
    ENSEMBLE_LIST = [a, b]
    g, h = autograph.graphed(_pairs), autograph.graphed(_average_list)
    with torch.no_grad():
        for i in range(12):
            if i == 4:
                b.weight = nn.Parameter(b.weight * 2)  # (a new parameter object)
            if i == 8:
                ENSEMBLE_LIST = [a, c]
            x = torch.randn(2, 4, device=device)
            torch.testing.assert_close(g(x), b(a(x)))
            torch.testing.assert_close(h(x), sum(m(x) for m in ENSEMBLE_LIST) / 2)
    assert autograph.stats(g)["replays"] >= 2 and autograph.stats(h)["replays"] >= 2


def test_nested_and_rebound_ensembles_are_watched(standin):
    check_nested_and_rebound_ensembles_are_watched()


class _Trainer:
    def __init__(self, models):
        self.models = models

    def predict(self, x):
        return sum(m(x) for m in self.models)


def check_modules_held_in_tuples_and_lists_are_watched(device="cpu"):
    """An ensemble held in a global tuple or list, or in a list on a plain object whose
    method is graphed: a member switched to ``eval()`` after the capture kept replaying
    the training-mode graph (batch statistics), and under grad mode every call ran
    eagerly (its parameters unwatched, the key was not one for training).  The members
    are watched as the modules a function names are."""
    torch.manual_seed(0)
    for kind in ("tuple", "list", "trainer"):
        members = [_member(device) for _ in range(2)]
        twins = copy.deepcopy(members)
        global ENSEMBLE_TUPLE, ENSEMBLE_LIST, ENSEMBLE_TWINS
        if kind == "trainer":
            g, eager = autograph.graphed(_Trainer(members).predict), _Trainer(twins).predict
        else:
            ENSEMBLE_TWINS = twins
            if kind == "tuple":
                ENSEMBLE_TUPLE = tuple(members)
                g = autograph.graphed(_average_tuple)
            else:
                ENSEMBLE_LIST = members
                g = autograph.graphed(_average_list)
            eager = _average_twins
        with torch.no_grad():
            for i in range(8):
                if i == 4:
                    for m in members + twins:
                        m.eval()
                x = torch.randn(4, 8, device=device)
                torch.testing.assert_close(g(x), eager(x))
        for m in members + twins:
            m.train()
        for _ in range(6):  # grad mode: trained graphs, gradients as eager's
            x = torch.randn(4, 8, device=device)
            for ms, f in ((twins, eager), (members, g)):
                for m in ms:
                    m.zero_grad()
                f(x).sum().backward()
            for a, b in zip(twins[0].parameters(), members[0].parameters()):
                torch.testing.assert_close(b.grad, a.grad)
        s = autograph.stats(g)
        assert s["replays"] >= 4 and s["backward_replays"] >= 1, (kind, s)
        assert "autograd" not in s["eager_reasons"], (kind, s)


def test_modules_held_in_tuples_and_lists_are_watched(standin):
    check_modules_held_in_tuples_and_lists_are_watched()


class _Child(nn.Module):
    def __init__(self):
        super().__init__()
        self.active = [1.0]
        self.counts = collections.Counter(a=1)

    def factor(self):
        return self.active[0] * self.counts["a"]

    def forward(self, x):
        return x


class _Parent(nn.Module):
    """Reads its child's list through the child's method, a defaultdict of its own, and
    counts its large batches in a dict of its own (the call's own change)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.c = _Child()
        self.scales = collections.defaultdict(float, w=1.0)
        self.stats = {"big": 0}

    def forward(self, x):
        if x.shape[0] > 2:
            self.stats["big"] += 1
        return self.fc(x) * self.c.factor() * self.scales["w"] * (1 + self.stats["big"])


def check_containers_read_through_children_and_counted_by_the_call(device="cpu"):
    """A child's list read through the child's method the parent calls, a
    ``defaultdict`` and a ``Counter`` changed in place were not compared (stale
    replays).  A dict the forward counts into for one key (run eagerly) and reads for
    every key: the other keys' graphs are dropped at each count (taking the count as
    the call's own left them replaying the old one)."""
    m = _Parent().to(device)
    twin, g = copy.deepcopy(m), autograph.graphed(m)
    changes = {6: lambda mod: mod.c.active.__setitem__(0, 2.0),
               12: lambda mod: mod.scales.__setitem__("w", 3.0),
               18: lambda mod: mod.c.counts.update(a=1)}
    with torch.no_grad():
        for i in range(24):
            if i in changes:
                changes[i](m)
                changes[i](twin)
            x = torch.randn(2, 4, device=device)
            torch.testing.assert_close(g(x), twin(x))
        replays = autograph.stats(g)["replays"]
        assert replays >= 8, autograph.stats(g)
        for i in range(12):  # the big key counts: the small key's graph sees each count
            x = torch.randn(3 if i in (3, 7) else 2, 4, device=device)
            torch.testing.assert_close(g(x), twin(x))
    assert autograph.stats(g)["replays"] - replays >= 4, autograph.stats(g)


def test_containers_read_through_children_and_counted_by_the_call(standin):
    check_containers_read_through_children_and_counted_by_the_call()


GLOBAL_SCALE = 1.0


class _Tracker(nn.Module):
    def __init__(self):
        super().__init__()
        self.history: list[float] = []

    def mean(self):
        return sum(self.history) / max(len(self.history), 1)


class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.mode = {"scale": 1.0}
        self.tracker = _Tracker()

    def forward(self, x):
        h = self.fc(x) * self.mode["scale"] * GLOBAL_SCALE
        return h - h.mean()


def _agree_with_eager(g, m, device, calls=4):
    """``calls`` calls of ``g`` under ``no_grad``, each equal to ``m`` run eagerly."""
    with torch.no_grad():
        for _ in range(calls):
            x = torch.randn(2, 4, device=device)
            with autograph.disabled():
                want = m(x)
            torch.testing.assert_close(g(x), want)


def check_changes_on_eager_paths_are_not_taken_as_the_calls_own(device="cpu"):
    """A change made by a forward pre-hook (its call ran eagerly for the hook), or by
    the user before a call that took an eager path checking no guard (grad mode with
    ``backward=False``), was taken as the call's own and the old graphs kept replaying."""
    global GLOBAL_SCALE
    m = _Scaled().to(device)
    g = autograph.graphed(m, backward=False)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(2, 4, device=device)
            torch.testing.assert_close(g(x), m(x))
        handle = m.register_forward_pre_hook(lambda mod, args: mod.mode.update(scale=3.0))
        g(torch.randn(2, 4, device=device))
        handle.remove()
    _agree_with_eager(g, m, device)
    try:
        GLOBAL_SCALE = 2.0
        g(torch.randn(2, 4, device=device))  # grad on, backward=False: eager
        _agree_with_eager(g, m, device)
    finally:
        GLOBAL_SCALE = 1.0
    assert autograph.stats(g)["invalidations"] == 2, autograph.stats(g)


def test_changes_on_eager_paths_are_not_taken_as_the_calls_own(standin):
    check_changes_on_eager_paths_are_not_taken_as_the_calls_own()


SIZE_SCALE = 1.0


class _SetsForBig(nn.Module):
    """Sets a global and a module attribute when the batch is large; reads both, and
    a child's dict through the child's ``get``."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.scale = 1.0
        self.table = _Table()

    def forward(self, x):
        global SIZE_SCALE
        if x.shape[0] > 2:
            SIZE_SCALE = 2.0
            self.scale = 3.0
        return self.fc(x) * SIZE_SCALE * self.scale * self.table.get("a")


class _Table(nn.Module):
    def __init__(self):
        super().__init__()
        self.scales = {"a": 1.0}

    def get(self, k):
        return self.scales[k]


def check_changes_of_captures_and_eager_paths_drop_other_keys_graphs(device="cpu"):
    """A large batch's call setting a global or a module attribute that the small
    batches' graph baked in: under ``warmup=0`` (its capture fails, the call runs
    again eagerly) or on an eager path (grad mode with ``backward=False``) the small
    graph kept replaying the old values.  A child's dict read through its ``get`` (a
    name dicts have too) changed between calls is seen."""
    global SIZE_SCALE
    for kind in ("warmup=0", "grad"):
        SIZE_SCALE = 1.0
        m = _SetsForBig().to(device)
        g = autograph.graphed(m, warmup=0 if kind == "warmup=0" else 2, backward=False)
        try:
            _agree_with_eager(g, m, device)
            big = torch.randn(3, 4, device=device)
            if kind == "grad":
                g(big)
            else:
                with torch.no_grad():
                    g(big)
            for change in (None, "table"):
                if change:
                    m.table.scales["a"] = 5.0
                _agree_with_eager(g, m, device)
        finally:
            SIZE_SCALE = 1.0
        assert autograph.stats(g)["replays"] >= 2, (kind, autograph.stats(g))


def test_changes_of_captures_and_eager_paths_drop_other_keys_graphs(standin):
    check_changes_of_captures_and_eager_paths_drop_other_keys_graphs()


def _train_alike(g, twin, steps, device):
    """``steps`` language-model steps of ``g`` and ``twin`` on the same batches: their
    gradients equal."""
    for _ in range(steps):
        ids = torch.randint(0, 64, (2, 8), device=device)
        grads = []
        for m in (g, twin):
            m.zero_grad(set_to_none=True)
            m(ids, labels=ids, use_cache=False).loss.backward()
            grads.append([p.grad for p in m.parameters()])
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b)


def check_gradient_checkpointing_models_replay(device="cpu"):
    """``gradient_checkpointing_enable()`` puts transformers' hook on the input
    embeddings that marks their output as requiring grad: every call of the model then
    ran eagerly (``hooks``), ``no_grad`` evaluation too.  Evaluation now replays past
    it; training calls with checkpointing run eagerly: transformers takes a capture for
    tracing and builds other masks, so on CUDA checkpointing's recomputation of a
    captured forward, run outside the capture, failed its check in the first backward.
    ``gradient_checkpointing_disable()`` leaves the hook: training replays past it
    where the embedding's weight requires grad (its output does already), and runs
    eagerly where it is frozen (the hook marks the output then)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(device)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert any(model.get_input_embeddings()._forward_hooks.values())
    twin = copy.deepcopy(model)
    g = autograph.graphed(model)
    model.eval()
    twin.eval()
    with torch.no_grad():
        for _ in range(5):
            ids = torch.randint(0, 64, (2, 8), device=device)
            torch.testing.assert_close(g(ids, use_cache=False).logits,
                                       twin(ids, use_cache=False).logits)
    assert autograph.stats(g)["replays"] >= 2, autograph.stats(g)
    model.train()
    twin.train()
    _train_alike(g, twin, 5, device)  # checkpointing in transformers: eagerly
    details = autograph.stats(g)["eager_details"]["backward_unsupported"]
    assert any("checkpointing in transformers" in k for k in details), details
    for m in (model, twin):
        m.gradient_checkpointing_disable()
    hooked = any(model.get_input_embeddings()._forward_hooks.values())
    before = autograph.stats(g)["replays"]
    _train_alike(g, twin, 6, device)  # the hook left behind changes nothing: replays
    assert autograph.stats(g)["replays"] >= before + 3, autograph.stats(g)
    if hooked:  # a frozen embedding's output is marked by it: eagerly
        for m in (model, twin):
            m.get_input_embeddings().weight.requires_grad_(False)
        _train_alike(g, twin, 3, device)
        assert autograph.stats(g)["eager_reasons"].get("hooks", 0) >= 3, autograph.stats(g)


def test_gradient_checkpointing_models_replay(standin):
    check_gradient_checkpointing_models_replay()


def _scaled_by_its_grad(w, x, s=1.0):
    return _reads_its_grad(w, x) * s


def check_grad_read_by_a_partial_or_a_helper(device="cpu"):
    """A function reading ``w.grad`` graphed through ``functools.partial``, or called
    from the graphed function (a helper it names): the ``.grad`` read was missed (only
    the graphed function's own code was looked at), so a gradient set after the capture
    was not seen (stale results)."""
    import functools

    for f in (functools.partial(_reads_its_grad), functools.partial(_scaled_by_its_grad,
                                                                     s=2.0)):
        g = autograph.graphed(f)
        w = torch.randn(3, device=device, requires_grad=True)
        with torch.no_grad():
            for i in range(8):
                if i == 4:
                    w.grad = torch.ones(3, device=device)
                x = torch.randn(3, device=device)
                torch.testing.assert_close(g(w, x), f(w, x))
        assert autograph.stats(g)["replays"] >= 2, autograph.stats(g)


def test_grad_read_by_a_partial_or_a_helper(standin):
    check_grad_read_by_a_partial_or_a_helper()


class _Temperature(float):
    pass


def test_float_subclass_arguments_are_keyed_by_type_and_bits(standin):
    """A subclass of ``float`` (``Temperature(0.7)``) was unkeyable (every call eager,
    where an ``int`` subclass replays); it is keyed by its type and bits."""
    g = autograph.graphed(lambda x, t: torch.copysign(x, torch.tensor(t)) / abs(t or 1.0))
    for i in range(10):
        t = _Temperature(0.7 if i < 5 else -0.0)
        x = torch.rand(3) + 1
        torch.testing.assert_close(g(x, t), torch.copysign(x, torch.tensor(t)) / abs(t or 1.0))
    assert autograph.stats(g)["replays"] >= 4, autograph.stats(g)


def check_output_flags_switched_in_a_transformers_config(device="cpu"):
    """``config.output_hidden_states = True`` (or ``output_attentions``) set after a
    graph was captured: the next call was captured without a warmup, transformers
    installed its output-capturing hooks during that capture, which then failed; the
    attribute flag it set was undone but the hooks stayed, the eager run installed them
    again, and every later output (eager ones too) held each hidden state twice.  A
    failed capture removes the module hooks its Python registered."""
    pytest.importorskip("transformers")
    from .gpu.models import decoder

    model = decoder("llama", hidden=32, vocab=96, device=device)
    twin, g = copy.deepcopy(model), autograph.graphed(model)
    x = torch.randint(1, 96, (2, 7), device=device)
    with torch.no_grad():
        for _ in range(4):
            torch.testing.assert_close(g(x).logits, twin(x).logits)
        for name in ("output_hidden_states",):
            setattr(model.config, name, True)
            setattr(twin.config, name, True)
            for _ in range(8):
                got, want = g(x), twin(x)
                for field in ("hidden_states", "attentions"):
                    a, b = getattr(got, field), getattr(want, field)
                    assert (a is None) == (b is None) and len(a or ()) == len(b or ())
                    for t, u in zip(a or (), b or ()):
                        torch.testing.assert_close(t, u)
    layer = model.model.layers[0]
    assert len(layer._forward_hooks) == len(twin.model.layers[0]._forward_hooks)
    assert autograph.stats(g)["replays"] >= 4, autograph.stats(g)


def test_output_flags_switched_in_a_transformers_config(standin):
    check_output_flags_switched_in_a_transformers_config()


def test_dropped_wrappers_leave_no_watch_entries(standin):
    """A wrapper made per request and dropped without ``close`` left an empty set of
    watches per module id in ``notify.watched`` (ids reused: a slow growth)."""
    import gc

    from autograph import notify

    def serve():
        g = autograph.graphed(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
        with torch.no_grad():
            g(torch.randn(2, 4))

    for _ in range(200):
        serve()
    gc.collect()
    serve()
    assert sum(1 for ws in notify.watched.values() if not ws) <= 3


class _Moded(nn.Module):
    """A module with a property whose setter stores the mode (transformers'
    ``kernels_mode``, set by every ``eval()``)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self._mode = "a"

    @property
    def mode(self):
        return self._mode

    @mode.setter
    def mode(self, value):
        self._mode = value

    def forward(self, x):
        return self.lin(x) * (2.0 if self.mode == "b" else 1.0)


def test_a_property_set_to_the_value_it_holds_keeps_the_graphs(standin):
    """Setting a property to what it reads before every call (``SentenceTransformer``
    calls ``eval()`` per ``encode``) dropped every graph at every call; a new value
    still changes the result."""
    m = _Moded()
    g = autograph.graphed(m)
    x = torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(6):
            m.mode = "a"
            torch.testing.assert_close(g(x), m.lin(x))
        s = autograph.stats(g)
        assert s["invalidations"] == 0 and s["replays"] == 3, s
        m.mode = "b"
        for _ in range(4):
            torch.testing.assert_close(g(x), 2.0 * m.lin(x))


class HostScale(nn.Module):
    """A 0-dim scale kept as a plain attribute: it stays on the host after ``.cuda()``,
    and is an inference tensor when the model is built under ``inference_mode``."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.scale = torch.tensor(8 ** -0.5)

    def forward(self, x):
        return self.proj(x) * self.scale


def check_a_host_inference_tensor_read_by_a_graph(device="cpu"):
    with torch.inference_mode():
        model = HostScale().to(device).eval()
    g = autograph.graphed(model)
    with torch.inference_mode():
        for i in range(14):
            if i == 5:  # written in place: seen by its value (no version counter)
                model.scale.fill_(2.0)
            if i == 8:  # a NaN equals a NaN: the graphs stay
                model.scale.fill_(float("nan"))
            x = torch.randn(2, 8, device=device)
            torch.testing.assert_close(g(x), model.proj(x) * model.scale.item(),
                                       equal_nan=True)
    assert autograph.stats(g)["replays"] >= 4, autograph.stats(g)


def test_a_host_inference_tensor_read_by_a_graph(standin, monkeypatch):
    # the stand-in graphs CPU tensors: the scale is a host tensor of a device graph
    # only when the guard is told the graph's device is another one, as on CUDA
    from autograph import guards

    original = guards.Watch.guard_hidden
    monkeypatch.setattr(guards.Watch, "guard_hidden", lambda self, tensors, device:
                        original(self, tensors, torch.device("meta")))
    check_a_host_inference_tensor_read_by_a_graph()


class CachesOnce(nn.Module):
    """Caches a table at its first call (Phi-3's long-rope frequencies, a mask)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.table = None

    def forward(self, x):
        if self.table is None:
            self.table = torch.arange(4, device=x.device, dtype=x.dtype) + 1
        return self.fc(x) * self.table


def check_a_set_up_at_the_first_call_is_learned_with_warmup_0(device="cpu"):
    """With ``warmup=0`` the first call is a capture; one that sets something up (an
    attribute assigned once) is undone and the call warms up, learning it, instead of
    giving the key up for good: the later calls replay."""
    model = CachesOnce().to(device)
    twin = copy.deepcopy(model)
    g = autograph.graphed(model, warmup=0)
    with torch.no_grad():
        for _ in range(6):
            x = torch.randn(2, 4, device=device)
            torch.testing.assert_close(g(x), twin(x))
    s = autograph.stats(g)
    assert s["replays"] >= 4 and s["eager_reasons"] == {"warmup": 1}, s


def test_a_set_up_at_the_first_call_is_learned_with_warmup_0(standin):
    check_a_set_up_at_the_first_call_is_learned_with_warmup_0()


class BuildsHead(nn.Module):
    """Builds a submodule at its first call (a head sized by the first input)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.head = None

    def forward(self, x):
        if self.head is None:
            self.head = nn.Linear(4, 3).to(x.device)
        return self.head(self.fc(x).relu())


def check_a_submodule_built_at_the_first_call_trains_graphed(device="cpu"):
    """The head's parameters are watched from the next call on: training replays, with
    eager's gradients (they were unknown to the watch, and every call ran eagerly)."""
    torch.manual_seed(0)
    model = BuildsHead().to(device)
    g = autograph.graphed(model)
    x = torch.randn(2, 4, device=device)
    g(x)  # the head, built
    twin = copy.deepcopy(model)
    for _ in range(6):
        x = torch.randn(2, 4, device=device)
        for m in (g, twin):
            m(x).square().sum().backward()
        for p, q in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
    s = autograph.stats(g)
    assert s["replays"] >= 3 and s["backward_replays"] >= 3, s


def test_a_submodule_built_at_the_first_call_trains_graphed(standin):
    check_a_submodule_built_at_the_first_call_trains_graphed()


SPARSE_ADJ = None  # read by name


class SparseAdjacency(nn.Module):
    """Holds a sparse adjacency (LightGCN-style) as a buffer, a plain attribute, one
    built at its first call, or reads it from a global."""

    def __init__(self, adj, how):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.how, self.made = how, adj
        if how == "buffer":
            self.register_buffer("adj", adj)
        elif how == "attribute":
            self.adj = adj
        elif how == "first call":
            self.adj = None

    def forward(self, x):
        if self.how == "global":
            adj = SPARSE_ADJ
        else:
            if self.adj is None:
                self.adj = self.made
            adj = self.adj
        return torch.sparse.mm(adj, self.lin(x))


@pytest.mark.parametrize("layout", ["coo", "csr"])
@pytest.mark.parametrize("how", ["buffer", "attribute", "first call", "global"])
def test_sparse_state_runs_eagerly_with_a_reason(standin, how, layout):
    check_sparse_state_runs_eagerly_with_a_reason(how, layout)


def check_sparse_state_runs_eagerly_with_a_reason(how, layout, device="cpu"):
    """A sparse tensor the call reads but is not given (no storage to guard, key or
    capture) made every call raise where eager mode runs: such calls run eagerly, with
    their reason."""
    global SPARSE_ADJ
    idx = torch.tensor([[0, 1, 2, 3], [1, 2, 3, 0]])
    adj = torch.sparse_coo_tensor(idx, torch.rand(4), (4, 4)).coalesce().to(device)
    adj = adj if layout == "coo" else adj.to_sparse_csr()
    SPARSE_ADJ = adj
    try:
        model = SparseAdjacency(adj, how).to(device)
        g = autograph.graphed(model)
        for grad in (False, True):
            with torch.set_grad_enabled(grad):
                for _ in range(4):
                    x = torch.randn(4, 4, device=device)
                    torch.testing.assert_close(g(x), torch.sparse.mm(adj, model.lin(x)))
        s = autograph.stats(g)
        assert s["replays"] == 0 and s["eager_reasons"].get("unkeyable_argument", 0) >= 6, s
        assert any("sparse" in d for d in s["eager_details"]["unkeyable_argument"])
    finally:
        SPARSE_ADJ = None


class Densifies(nn.Module):
    """Makes its sparse adjacency dense at its first call."""

    def __init__(self, adj):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.adj = adj

    def forward(self, x):
        if self.adj.is_sparse:
            self.adj = self.adj.to_dense()
        return self.adj @ self.lin(x)


def check_a_sparse_tensor_made_dense_is_graphed(device="cpu"):
    """A sparse attribute the call replaces with a dense one: graphed from then on (the
    calls stayed eager for good, with the sparse tensor's reason)."""
    idx = torch.tensor([[0, 1, 2, 3], [1, 2, 3, 0]])
    adj = torch.sparse_coo_tensor(idx, torch.rand(4), (4, 4)).coalesce().to(device)
    model = Densifies(adj).to(device)
    g = autograph.graphed(model)
    with torch.no_grad():
        for _ in range(6):
            x = torch.randn(4, 4, device=device)
            torch.testing.assert_close(g(x), adj.to_dense() @ model.lin(x))
    assert autograph.stats(g)["replays"] >= 2


def test_a_sparse_tensor_made_dense_is_graphed(standin):
    check_a_sparse_tensor_made_dense_is_graphed()
