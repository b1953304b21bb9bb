"""State a graphed call reads by name rather than through its arguments: tensors held by
globals, closure cells, plain objects and modules' plain attributes frozen or unfrozen
between calls, parameters outside a whole step's optimizer unfrozen, and names rebound
to containers, arrays or types.  Each gave a wrong result until the fifteenth session
(found by an exploring round on the stand-in); ``tests/gpu/test_named_state_cuda.py``
runs the same bodies on CUDA."""

import numpy as np
import pytest
import torch
from torch import nn

import autograph

WHERE = ("global", "closure", "object", "module attribute")


def _reader(where: str, w: torch.Tensor, device: str):
    """A graphed-to-be callable computing ``(x * w).exp()`` that reads ``w`` ``where``."""
    if where == "global":
        ns = {"W": w}
        exec("def f(a):\n    return (a * W).exp()", ns)  # noqa: S102 - a module's global
        return ns["f"]
    if where == "closure":
        def f(a):
            return (a * w).exp()
        return f
    if where == "object":
        holder = type("Holder", (), {})()
        holder.t = w

        def g(a):
            return (a * holder.t).exp()
        return g

    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.t = w  # a plain tensor attribute: no parameter, no buffer

        def forward(self, a):
            return (a * self.t).exp()

    return Scale().to(device)


def _all_close(want, got):
    """Each of ``got`` is a tensor (a gradient that eager gives) equal to ``want``'s."""
    for a, b in zip(want, got):
        assert b is not None
        torch.testing.assert_close(a, b)


def check_a_named_tensor_unfrozen_after_capture_gets_its_gradient(where: str, device: str):
    """Captured under grad mode while the tensor it reads requires no grad (a plain
    graph), then ``w.requires_grad_()``: the call must record autograd as eager does."""
    torch.manual_seed(0)
    w = torch.randn(4, device=device)
    f = autograph.graphed(_reader(where, w, device))
    x = torch.randn(4, device=device)
    for _ in range(4):
        torch.testing.assert_close(f(x), (x * w).exp())
    assert autograph.stats(f)["replays"] >= 1
    w.requires_grad_(True)
    y = f(x)
    assert y.requires_grad
    (grad,) = torch.autograd.grad(y.sum(), w)
    torch.testing.assert_close(grad, x * (x * w.detach()).exp())
    w.requires_grad_(False)  # frozen again: graphs again
    for _ in range(4):
        y = f(x)
        assert not y.requires_grad
        torch.testing.assert_close(y, (x * w).exp())


@pytest.mark.parametrize("where", WHERE)
def test_a_named_tensor_unfrozen_after_capture_gets_its_gradient(standin, where):
    check_a_named_tensor_unfrozen_after_capture_gets_its_gradient(where, "cpu")


def check_a_training_graph_reading_a_named_tensor_unfrozen(device: str):
    """A per-layer training graph (parameters require grad) that also reads a global
    and a module's plain tensor attribute; once those require grad, their gradients
    come as in eager mode (the call runs eagerly: graphs cannot give them)."""
    def run(graph: bool):
        torch.manual_seed(1)
        w = torch.randn(4, device=device)

        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(4, 4)
                self.c = torch.randn(4)

            def forward(self, x):
                return self.lin(x) * w * self.c

        model = Model().to(device)
        model.c = model.c.to(device)
        f = autograph.graphed(model) if graph else model
        x = torch.randn(2, 4, device=device)
        for _ in range(4):
            f(x).sum().backward()
        w.requires_grad_(True)
        model.c.requires_grad_(True)
        for _ in range(2):
            f(x).sum().backward()
        return w.grad, model.c.grad, model.lin.weight.grad, f

    want, got = run(False), run(True)
    _all_close(want[:3], got[:3])
    assert autograph.stats(got[3])["backward_replays"] >= 1


def test_a_training_graph_reading_a_named_tensor_unfrozen(standin):
    check_a_training_graph_reading_a_named_tensor_unfrozen("cpu")


def check_a_whole_step_after_a_tensor_outside_its_optimizer_is_unfrozen(device: str):
    """A whole training step graphed: a module outside the optimizer (a frozen
    embedding) and a closure tensor are unfrozen later; eager's backward then gives
    them ``.grad``, so the graph captured while they were frozen may not replay."""
    def run(graph: bool):
        torch.manual_seed(1)
        lin, emb = nn.Linear(4, 4).to(device), nn.Linear(4, 4).to(device)
        emb.requires_grad_(False)
        c = torch.randn(4, device=device)
        opt = torch.optim.SGD(lin.parameters(), lr=0.1)

        def step(x):
            opt.zero_grad()
            loss = (lin(emb(x)) * c).sum()
            loss.backward()
            opt.step()
            return loss.detach()

        f = autograph.graphed(step) if graph else step
        x = torch.randn(2, 4, device=device)
        losses = [f(x) for _ in range(4)]
        emb.requires_grad_(True)
        c.requires_grad_(True)
        losses += [f(x) for _ in range(3)]
        return losses, emb.weight.grad, c.grad, lin.weight.detach(), f

    want, got = run(False), run(True)
    torch.testing.assert_close(torch.stack(got[0]), torch.stack(want[0]))
    _all_close(want[1:4], got[1:4])
    assert autograph.stats(got[4])["replays"] >= 1


def test_a_whole_step_after_a_tensor_outside_its_optimizer_is_unfrozen(standin):
    check_a_whole_step_after_a_tensor_outside_its_optimizer_is_unfrozen("cpu")


def check_a_capture_without_warmup_reading_a_tensor_that_requires_grad(device: str):
    """``warmup=0``: no warmup finds that the call reads a global requiring grad; the
    capture must not hand out an output whose autograd history the replays overwrite
    (eager: gradients reach the global)."""
    torch.manual_seed(0)
    w = torch.randn(4, device=device, requires_grad=True)
    f = autograph.graphed(_reader("global", w, device), warmup=0)
    x = torch.randn(4, device=device)
    for _ in range(3):
        y = f(x)
        (grad,) = torch.autograd.grad(y.sum(), w)
        torch.testing.assert_close(grad, x * (x * w.detach()).exp())
    assert autograph.stats(f)["eager_reasons"].get("backward_unsupported") == 3


def test_a_capture_without_warmup_reading_a_tensor_that_requires_grad(standin):
    check_a_capture_without_warmup_reading_a_tensor_that_requires_grad("cpu")


def check_names_rebound_to_containers_arrays_and_types(device: str):
    """A global or closure name rebound between calls to another dict, list, numpy
    array, memory format or type: the graphs baked in the old one's values."""
    ns: dict = {"torch": torch, "np": np}
    exec(  # noqa: S102 - globals of a module of the user's
        "def f(x):\n"
        "    y = x * CFG['scale'] * SCALES[0] * float(ARR[0])\n"
        "    y = y.contiguous(memory_format=FORMAT)\n"
        "    return y.to(KIND(1) and torch.float32) * (2 if KIND is float else 1)\n", ns)
    ns.update(CFG={"scale": 2.0}, SCALES=[1.0], ARR=np.array([1.0]),
              FORMAT=torch.contiguous_format, KIND=int)
    cell = {"scale": 2.0}

    def closure(x):
        return x * cell["scale"]

    f, g = autograph.graphed(ns["f"]), autograph.graphed(closure)
    x = torch.ones(3, device=device)
    with torch.no_grad():
        for _ in range(4):
            torch.testing.assert_close(f(x), ns["f"](x))
            torch.testing.assert_close(g(x), closure(x))
        assert autograph.stats(f)["replays"] >= 1 and autograph.stats(g)["replays"] >= 1
        for name, value in (("CFG", {"scale": 3.0}), ("SCALES", [5.0]),
                            ("ARR", np.array([7.0])), ("KIND", float)):
            ns[name] = value
            for _ in range(4):
                torch.testing.assert_close(f(x), ns["f"](x))
        cell = {"scale": 3.0}  # noqa: F841 - the closure's cell rebound
        for _ in range(4):
            torch.testing.assert_close(g(x), 3.0 * x)


def test_names_rebound_to_containers_arrays_and_types(standin):
    check_names_rebound_to_containers_arrays_and_types("cpu")


def check_a_discriminator_frozen_and_unfrozen_every_step_keeps_its_graphs(device: str):
    """A GAN step: the discriminator trained, then frozen (``requires_grad_(False)``)
    for the generator's update, every step.  Gradients equal eager's, and both of its
    states keep their graphs (a check of the flags that dropped every graph at every
    switch left it without replays)."""
    def run(graph: bool):
        torch.manual_seed(0)
        gen = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4)).to(device)
        disc = nn.Sequential(nn.Linear(4, 8), nn.LeakyReLU(0.2), nn.Linear(8, 1)).to(device)
        g, d = (autograph.graphed(gen), autograph.graphed(disc)) if graph else (gen, disc)
        og = torch.optim.SGD(gen.parameters(), lr=0.1)
        od = torch.optim.SGD(disc.parameters(), lr=0.1)
        for _ in range(8):
            z, real = torch.randn(16, 4, device=device), torch.randn(16, 4, device=device)
            disc.requires_grad_(True)
            od.zero_grad()
            (d(real).mean() - d(g(z).detach()).mean()).backward()
            od.step()
            disc.requires_grad_(False)
            og.zero_grad()
            (-d(g(z)).mean()).backward()
            og.step()
        return [p.detach() for p in (*gen.parameters(), *disc.parameters())], d

    (want, _), (got, d) = run(False), run(True)
    for a, b in zip(want, got):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    s = autograph.stats(d)
    assert s["replays"] >= 12 and s["invalidations"] == 0, s


def test_a_discriminator_frozen_and_unfrozen_every_step_keeps_its_graphs(standin):
    check_a_discriminator_frozen_and_unfrozen_every_step_keeps_its_graphs("cpu")


def test_a_global_rebuilt_before_every_call_is_warned_of(standin, caplog):
    """``CFG = {...}`` rebuilt before each call drops the graphs every time (correct,
    eager); after a few in a row without a replay the log says so, once."""
    ns: dict = {}
    exec("def f(x):\n    return x * CFG['scale']", ns)  # noqa: S102 - a module's global
    f = autograph.graphed(ns["f"])
    x = torch.ones(3)
    with torch.no_grad(), caplog.at_level("WARNING", logger="autograph"):
        for i in range(20):
            ns["CFG"] = {"scale": float(i)}
            torch.testing.assert_close(f(x), x * float(i))
    warned = [r for r in caplog.records if "without a replay" in r.getMessage()]
    assert len(warned) == 1 and autograph.stats(f)["replays"] == 0
