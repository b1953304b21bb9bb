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


class Reads(nn.Module):
    """Reads its weight through the module and through a reference of its own (as
    ``nn.LSTM``'s ``_flat_weights``), and returns a parameter itself."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.randn(4))
        self.refs = [self.lin.weight]

    def forward(self, x):
        h = self.lin(x) + x @ self.refs[0].t() * self.scale
        return h.tanh(), self.scale


def check_a_parameter_read_twice_and_returned_gets_eager_gradients(device: str):
    torch.manual_seed(0)
    model = Reads().to(device)
    model.refs = [model.lin.weight]
    twin = copy.deepcopy(model)
    twin.refs = [twin.lin.weight]
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
