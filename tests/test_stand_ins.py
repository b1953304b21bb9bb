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
