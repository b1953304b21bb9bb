"""A training graph is captured over stand-ins of the parameters (``training.StandIns``):
the captured autograd graph must not hold the parameters' gradient accumulators (on
CUDA they would keep the capture's stream, and every backward would accumulate there,
with an event and a wait per parameter), and the parameters must get exactly eager's
gradients however the forward reads or returns them.  The checks take a device: the
CPU tests run them through the stand-in backend, tests/gpu/test_stand_ins_cuda.py on
CUDA.
"""

import copy

import torch
from torch import nn

import autograph


def accumulator(p):
    """The gradient accumulator autograd uses for ``p`` now (made if none is alive)."""
    return p.view_as(p).grad_fn.next_functions[0][0]


def step(model, x):
    out = model(x)
    out = out[0] if isinstance(out, tuple) else out
    out.square().sum().backward()


def check_the_graph_holds_no_parameter_accumulator(device: str):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).to(device)
    g = autograph.graphed(model)
    x = torch.randn(3, 4, device=device)
    for _ in range(5):
        step(g, x)
    assert autograph.stats(g)["backward_replays"] >= 1
    # a hook on the accumulator alive now: only a later backward through that very
    # accumulator calls it; held by the captured graph, every replay's backward would
    seen = []
    for p in model.parameters():
        accumulator(p).register_prehook(lambda grads: seen.append(1))
    before = autograph.stats(g)["backward_replays"]
    step(g, x)
    assert autograph.stats(g)["backward_replays"] == before + 1
    assert seen == []


def test_the_graph_holds_no_parameter_accumulator(standin):
    check_the_graph_holds_no_parameter_accumulator("cpu")


class Holder:
    """A plain object holding a reference (not a container: its parameter keeps a
    stand-in, and the capture reads the parameter itself through it too)."""

    def __init__(self, weight):
        self.weight = weight


class Reads(nn.Module):
    """Reads its weight through the module and through a reference of its own, and
    returns a parameter itself."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.randn(4))
        self.refs = Holder(self.lin.weight)

    def forward(self, x):
        h = self.lin(x) + x @ self.refs.weight.t() * self.scale
        return h.tanh(), self.scale


def check_a_parameter_read_twice_and_returned_gets_eager_gradients(device: str):
    torch.manual_seed(0)
    model = Reads().to(device)
    twin = copy.deepcopy(model)
    g = autograph.graphed(model)
    for i in range(6):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(i)).to(device)
        for m in (g, twin):
            m.zero_grad()
            h, scale = m(x)
            (h.square().sum() + scale.sum()).backward()
            assert scale is m.scale  # the parameter itself, as eager returns it
        for p, q in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-6)
    s = autograph.stats(g)
    assert s["replays"] >= 3 and s["backward_replays"] >= 2, s


def test_a_parameter_read_twice_and_returned_gets_eager_gradients(standin):
    check_a_parameter_read_twice_and_returned_gets_eager_gradients("cpu")


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 6)
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.emb(ids).relu())


def check_tied_parameters_take_one_stand_in(device: str):
    torch.manual_seed(0)
    model = Tied().to(device)
    twin = copy.deepcopy(model)
    g = autograph.graphed(model)
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]], device=device)
    for _ in range(5):
        for m in (g, twin):
            m.zero_grad()
            m(ids).logsumexp(-1).sum().backward()
        torch.testing.assert_close(model.emb.weight.grad, twin.emb.weight.grad,
                                   rtol=1e-6, atol=1e-6)
    assert model.head.weight is model.emb.weight
    assert autograph.stats(g)["backward_replays"] >= 2


def test_tied_parameters_take_one_stand_in(standin):
    check_tied_parameters_take_one_stand_in("cpu")


def test_the_stand_ins_are_the_capturing_threads_only():
    """While a capture's forward runs over stand-ins, the capturing thread reads them
    (by attribute and through ``named_parameters``), every other thread reads the
    parameters themselves, and afterwards the module holds its own dict again."""
    import threading

    from autograph.training import StandIns

    lin = nn.Linear(4, 4)
    weight, own = lin.weight, lin._parameters

    class Watched:
        def every_module(self):
            return [lin]

    stand = StandIns(Watched())
    seen = []
    with stand.standing():
        inside = lin.weight
        named = dict(lin.named_parameters())["weight"]
        other = threading.Thread(target=lambda: seen.extend(
            [lin.weight, dict(lin.named_parameters())["weight"]]))
        other.start()
        other.join()
    assert inside is not weight and named is inside
    assert inside.data_ptr() == weight.data_ptr() and inside.requires_grad
    assert len(seen) == 2 and all(w is weight for w in seen)
    assert lin.weight is weight and lin._parameters is own


class Meta(nn.Module):
    """Fast weights (MAML, hypernetworks): ``functional_call`` swaps the submodule's
    tensors in and, on its way out, puts back what it read (the stand-ins)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x):
        w = self.net[2].weight
        return torch.func.functional_call(self.net, {"2.weight": w * 0.5}, (x,))


def test_functional_call_inside_the_forward_leaves_the_parameters_in_place(standin):
    torch.manual_seed(0)
    model = Meta()
    twin = copy.deepcopy(model)
    g = autograph.graphed(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, twin)]
    known = [id(p) for p in model.parameters()]
    x = torch.randn(4, 8)
    for _ in range(5):
        for m, opt in zip((g, twin), opts):
            opt.zero_grad()
            m(x).pow(2).mean().backward()
            opt.step()
        assert [id(p) for p in model.parameters()] == known
        for p, q in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)
    assert autograph.stats(g)["backward_replays"] >= 2


def test_another_thread_training_during_a_capture_trains_the_parameters(standin):
    """Thread A's first call is its capture (``warmup=0``); meanwhile thread B trains
    the same model eagerly: B's gradients reach the parameters."""
    import threading

    in_capture, b_done = threading.Event(), threading.Event()

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1, self.l2 = nn.Linear(16, 32), nn.Linear(32, 4)

        def forward(self, x):
            if standin.is_capturing(x.device) and x.shape[0] == 5:  # A's capture
                in_capture.set()
                b_done.wait(10)
            return self.l2(torch.tanh(self.l1(x)))

    torch.manual_seed(0)
    model = Net()
    twin = copy.deepcopy(model)
    g = autograph.graphed(model, warmup=0)
    xa, xb = torch.randn(5, 16), torch.randn(7, 16)
    params = list(model.parameters())
    got = []

    def thread_b():
        in_capture.wait(10)
        with autograph.disabled():  # an eager run of the model meanwhile
            g(xb).pow(2).mean().backward()
        got.extend(p.grad for p in params)
        b_done.set()

    other = threading.Thread(target=thread_b)
    other.start()
    g(xa)
    other.join()
    assert in_capture.is_set(), autograph.stats(g)
    twin(xb).pow(2).mean().backward()
    assert len(got) == 4
    for a, p in zip(got, twin.parameters()):
        assert a is not None
        torch.testing.assert_close(a, p.grad)


def test_warmups_overlapping_on_two_threads_leave_autograd_unpatched(standin):
    """Learning warmups spy on ``torch.autograd.backward``/``grad`` and
    ``Tensor.register_hook``; two overlapping on two threads (one ending after the
    other began) leave torch's own functions in place afterwards."""
    import threading
    import time

    originals = (torch.autograd.grad, torch.autograd.backward, torch.Tensor.register_hook)
    a_in, b_in = threading.Event(), threading.Event()

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(4, 4)

        def forward(self, x):
            if x.shape[0] == 2 and not a_in.is_set():  # A's first warmup: B's starts
                a_in.set()
                b_in.wait(1)
            elif x.shape[0] == 3 and not b_in.is_set():  # B's, ending after A's
                b_in.set()
                time.sleep(0.2)
            return self.l(x)

    g = autograph.graphed(Net())
    a = threading.Thread(target=lambda: g(torch.randn(2, 4)).sum().backward())
    b = threading.Thread(target=lambda: (a_in.wait(1), g(torch.randn(3, 4)).sum().backward()))
    a.start()
    b.start()
    a.join()
    b.join()
    assert (torch.autograd.grad, torch.autograd.backward,
            torch.Tensor.register_hook) == originals


def train_alike(model, twin, inputs, loss=lambda out: out.square().sum(), min_backward=2,
                **options):
    """Train ``model`` graphed (with ``options``) and ``twin`` eagerly on ``inputs``:
    losses and every gradient equal, and the graphs replayed forward and backward."""
    g = autograph.graphed(model, **options)
    for x in inputs:
        losses = []
        for m in (g, twin):
            m.zero_grad()
            value = loss(m(x))
            value.backward()
            losses.append(value.detach())
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-5)
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            if q.grad is None:
                assert p.grad is None, name
                continue
            grad = p.grad.to_dense() if p.grad.is_sparse else p.grad
            want = q.grad.to_dense() if q.grad.is_sparse else q.grad
            torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-5, msg=name)
    s = autograph.stats(g)
    assert s["replays"] >= 2 and s["backward_replays"] + s["backward_eager"] >= min_backward, s
    return s


class ByIdentity(nn.Module):
    """Finds its parameters by identity in containers of its own: a no-decay set, masks
    keyed by the parameter and by its id (pruning, per-parameter settings)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 3)
        self.no_decay = {self.a.bias, self.b.bias}
        self.masks = {self.a.weight: torch.rand(8, 6).round()}
        self.by_id = {id(self.b.weight): torch.rand(3, 8).round()}

    def forward(self, x):
        h = nn.functional.linear(x, self.a.weight * self.masks.get(self.a.weight, 1.0),
                                 self.a.bias).tanh()
        w = self.b.weight * self.by_id.get(id(self.b.weight), 1.0)
        reg = sum(p.square().sum() for p in self.parameters() if p not in self.no_decay)
        return nn.functional.linear(h, w, self.b.bias), reg


def check_parameters_found_by_identity_are_found(device: str):
    torch.manual_seed(0)
    model = ByIdentity().to(device)
    model.masks = {model.a.weight: model.masks[model.a.weight].to(device)}
    model.by_id = {id(model.b.weight): model.by_id[id(model.b.weight)].to(device)}
    twin = copy.deepcopy(model)
    twin.no_decay = {twin.a.bias, twin.b.bias}
    twin.masks = {twin.a.weight: model.masks[model.a.weight]}
    twin.by_id = {id(twin.b.weight): model.by_id[id(model.b.weight)]}
    inputs = [torch.randn(4, 6, generator=torch.Generator().manual_seed(i)).to(device)
              for i in range(6)]
    train_alike(model, twin, inputs, loss=lambda out: out[0].square().sum() + 0.1 * out[1])


def test_parameters_found_by_identity_are_found(standin):
    check_parameters_found_by_identity_are_found("cpu")


MASKS: dict = {}  # a global keyed by a parameter's id: no container of the module's


class GlobalMask(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 5)

    def forward(self, x):
        return nn.functional.linear(x, self.lin.weight * MASKS[id(self.lin.weight)],
                                    self.lin.bias).tanh()


def check_a_capture_failing_over_stand_ins_is_made_over_the_parameters(device: str):
    torch.manual_seed(0)
    model = GlobalMask().to(device)
    twin = copy.deepcopy(model)
    mask = torch.rand(5, 5, device=device).round()
    MASKS.clear()
    MASKS.update({id(model.lin.weight): mask, id(twin.lin.weight): mask})
    inputs = [torch.randn(3, 5, generator=torch.Generator().manual_seed(i)).to(device)
              for i in range(6)]
    try:
        train_alike(model, twin, inputs)
    finally:
        MASKS.clear()


def test_a_capture_failing_over_stand_ins_is_made_over_the_parameters(standin):
    # over stand-ins the lookup raises KeyError: the caller must not see it
    check_a_capture_failing_over_stand_ins_is_made_over_the_parameters("cpu")


class SetsUpOnce(nn.Module):
    """At its first call caches a tensor filled in place (a rotary table, a mask) and,
    with ``hook``, registers a forward hook on a submodule (as transformers' output
    capturing does): with ``warmup=0`` the first call is a capture, over stand-ins,
    that fails on the assignment.  What its Python set up (a tensor no kernel filled,
    a hook) must be undone before the capture over the parameters, or the graph bakes
    that tensor in (garbage) and the hook is registered twice."""

    def __init__(self, hook=False):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = None
        self.hook = hook

    def forward(self, x):
        if self.scale is None:
            scale = torch.empty(4, device=x.device)
            scale.fill_(2.0)
            self.scale = scale
            if self.hook:
                self.lin.register_forward_hook(lambda mod, args, out: out + 1)
        return self.lin(x) * self.scale


def check_a_set_up_at_the_first_call_with_warmup_0(device: str):
    torch.manual_seed(0)
    model = SetsUpOnce().to(device)
    twin = copy.deepcopy(model)
    inputs = [torch.randn(2, 4, generator=torch.Generator().manual_seed(i)).to(device)
              for i in range(6)]
    train_alike(model, twin, inputs, warmup=0)
    # registering a hook: its calls run eagerly (module hooks), with the hook once
    model = SetsUpOnce(hook=True).to(device)
    twin = copy.deepcopy(model)
    g = autograph.graphed(model, warmup=0)
    for x in inputs:
        torch.testing.assert_close(g(x), twin(x))
    assert len(model.lin._forward_hooks) == len(twin.lin._forward_hooks) == 1


def test_a_set_up_at_the_first_call_with_warmup_0(standin):
    check_a_set_up_at_the_first_call_with_warmup_0("cpu")


class Scaled(nn.Module):
    """Reads an attribute set on its parameter (a learning-rate multiplier, Megatron's
    ``main_grad``): the stand-in carries it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.lin.weight.lr_mult = 0.25

    def forward(self, x):
        w = self.lin.weight
        return nn.functional.linear(x, w * getattr(w, "lr_mult", 1.0), self.lin.bias)


def check_attributes_of_a_parameter_reach_the_capture(device: str):
    torch.manual_seed(0)
    model = Scaled().to(device)
    twin = copy.deepcopy(model)
    twin.lin.weight.lr_mult = 0.25  # (deepcopy leaves a parameter's attributes out)
    assert model.lin.weight.lr_mult == 0.25
    inputs = [torch.randn(2, 4, generator=torch.Generator().manual_seed(i)).to(device)
              for i in range(6)]
    train_alike(model, twin, inputs)


def test_attributes_of_a_parameter_reach_the_capture(standin):
    check_attributes_of_a_parameter_reach_the_capture("cpu")


class SparseTied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8, sparse=True)

    def forward(self, ids):
        return nn.functional.linear(self.emb(ids).tanh(), self.emb.weight).logsumexp(-1)


def check_a_sparse_gradient_added_to_a_dense_one(device: str):
    torch.manual_seed(0)
    model = SparseTied().to(device)
    twin = copy.deepcopy(model)
    inputs = [torch.randint(0, 20, (4, 3), generator=torch.Generator().manual_seed(i)).to(device)
              for i in range(6)]
    s = train_alike(model, twin, inputs, loss=lambda out: out.sum())
    assert s["backward_replays"] == 0, s  # sparse gradients: backwards run eagerly


def test_a_sparse_gradient_added_to_a_dense_one(standin):
    check_a_sparse_gradient_added_to_a_dense_one("cpu")


def check_a_forward_reading_grad_sees_each_steps(device: str):
    """A forward reading a parameter's ``.grad`` (set anew every step by
    ``zero_grad(set_to_none=True)``, the old ones kept by the caller) reads the one it
    has now, as eager does."""

    class GradRead(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 6)

        def forward(self, x):
            g = self.lin.weight.grad
            extra = torch.zeros((), device=x.device) if g is None else g.abs().sum()
            return self.lin(x).tanh().sum() + extra

    torch.manual_seed(0)
    model = GradRead().to(device)
    twin = copy.deepcopy(model)
    g = autograph.graphed(model)
    kept = []
    for step in range(4):
        kept.append(model.lin.weight.grad)
        for m in (model, twin):
            m.zero_grad(set_to_none=True)
        for k in range(3):
            x = torch.randn(4, 6, generator=torch.Generator().manual_seed(3 * step + k)).to(device)
            a, b = g(x), twin(x)
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)
            a.backward()
            b.backward()
    torch.testing.assert_close(model.lin.weight.grad, twin.lin.weight.grad)


def test_a_forward_reading_grad_sees_each_steps(standin):
    check_a_forward_reading_grad_sees_each_steps("cpu")


def flat_parameters(model):
    """The parameters made views of one flat buffer (contiguous-parameter setups)."""
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    at = 0
    for p in model.parameters():
        p.data = flat[at:at + p.numel()].view_as(p)
        at += p.numel()
    model.register_buffer("flat", flat)  # the buffer too, as such setups keep it
    return model


def check_a_saved_flat_parameter_written_raises_as_in_eager(device: str):
    torch.manual_seed(0)
    model = flat_parameters(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2)).to(device))
    twin = flat_parameters(copy.deepcopy(model))
    g = autograph.graphed(model)
    x = torch.randn(4, 8, device=device)
    raised = []
    for _ in range(5):
        row = []
        for m in (g, twin):
            y = m(x).square().sum()
            with torch.no_grad():
                m[2].weight.mul_(1.0)  # a weight addmm saved, written in place
            try:
                y.backward()
                row.append(False)
            except RuntimeError as exc:
                assert "inplace" in str(exc)
                row.append(True)
        raised.append(row)
    assert raised == [[True, True]] * 5, raised
    assert autograph.stats(g)["replays"] >= 2
    for _ in range(3):  # the buffer's bias end written: no saved parameter's counter
        for m in (g, twin):
            y = m(x).square().sum()
            with torch.no_grad():
                (model if m is g else twin).flat[-1:].mul_(1.0)
            y.backward()


def test_a_saved_flat_parameter_written_raises_as_in_eager(standin):
    check_a_saved_flat_parameter_written_raises_as_in_eager("cpu")


def test_parametrize_cached_around_a_training_call(standin):
    """``parametrize.cached()`` around the call and a loss term reading the weight
    outside it: the cache holds no weight computed from a stand-in."""
    from torch.nn.utils import parametrize

    class Symmetric(nn.Module):
        def forward(self, w):
            return (w + w.T) / 2

    def make():
        m = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 1))
        parametrize.register_parametrization(m[0], "weight", Symmetric())
        return m

    torch.manual_seed(0)
    model = make()
    twin = copy.deepcopy(model)
    g = autograph.graphed(model)
    x = torch.randn(4, 6)
    for _ in range(6):
        for m, call in ((model, g), (twin, twin)):
            m.zero_grad()
            with parametrize.cached():
                loss = call(x).square().sum() + 0.1 * m[0].weight.square().sum()
            loss.backward()
        for p, q in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5)


def test_too_many_held_values_to_look_through_take_no_stand_ins(standin):
    """A module holding more than ``MAX_ITEMS`` values in its containers (a token table)
    next to a parameter found by identity: nothing is looked through, and no parameter
    takes a stand-in (the identity lookup stays right)."""
    from autograph import training

    torch.manual_seed(0)
    model = ByIdentity()
    model.table = list(range(training.MAX_ITEMS + 1))
    assert training._known_by_identity([model]) is None
    twin = copy.deepcopy(model)
    twin.no_decay = {twin.a.bias, twin.b.bias}
    twin.masks = {twin.a.weight: model.masks[model.a.weight]}
    twin.by_id = {id(twin.b.weight): model.by_id[id(model.b.weight)]}
    inputs = [torch.randn(4, 6, generator=torch.Generator().manual_seed(i)) for i in range(5)]
    train_alike(model, twin, inputs, loss=lambda out: out[0].square().sum() + 0.1 * out[1])
