"""A whole training step graphed on CUDA (zero_grad, forward, backward and an optimizer
step in one call, torch's "whole network capture"): replays equal eager step after
step, gradients included, and the optimizer's Python state is guarded.  Skipped
without CUDA."""

import pytest
import torch
from torch import nn

import autograph

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
TOL = dict(rtol=1e-5, atol=1e-6)  # the replays run eager's kernels: tight


def make():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                         nn.Linear(256, 16)).cuda()


OPTIMIZERS = {
    "adamw fused capturable": lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True,
                                                          capturable=True),
    "adam foreach capturable": lambda p: torch.optim.Adam(p, lr=1e-3, foreach=True,
                                                          capturable=True),
    "sgd momentum": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9),
}


class Trainer:
    def __init__(self, optimizer):
        self.model = make()
        self.opt = OPTIMIZERS[optimizer](self.model.parameters())

    def step(self, x, y):
        self.opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(self.model(x), y)
        loss.backward()
        self.opt.step()
        return loss.detach()


def data(n, batch=8):
    g = torch.Generator(device="cuda").manual_seed(1)
    return [(torch.randn(batch, 64, device="cuda", generator=g),
             torch.randn(batch, 16, device="cuda", generator=g)) for _ in range(n)]


def assert_same(a, b):
    for p, q in zip(a.model.parameters(), b.model.parameters()):
        torch.testing.assert_close(p, q, **TOL)
        torch.testing.assert_close(p.grad, q.grad, **TOL)


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_whole_step_replays_and_equals_eager(optimizer):
    graphed_trainer, eager_trainer = Trainer(optimizer), Trainer(optimizer)
    train = autograph.graphed(graphed_trainer.step)
    for x, y in data(20):
        torch.testing.assert_close(train(x, y), eager_trainer.step(x, y), **TOL)
    assert_same(graphed_trainer, eager_trainer)
    s = autograph.stats(train)
    assert s["replays"] >= 15 and s["captures"] == 1, s


def test_a_learning_rate_schedule_is_seen():
    graphed_trainer, eager_trainer = Trainer("sgd momentum"), Trainer("sgd momentum")
    train = autograph.graphed(graphed_trainer.step)
    schedules = [torch.optim.lr_scheduler.StepLR(t.opt, step_size=8, gamma=0.5)
                 for t in (graphed_trainer, eager_trainer)]
    for x, y in data(24):
        torch.testing.assert_close(train(x, y), eager_trainer.step(x, y), **TOL)
        for schedule in schedules:
            schedule.step()
    assert_same(graphed_trainer, eager_trainer)
    s = autograph.stats(train)
    assert s["invalidations"] >= 2 and s["replays"] >= 10, s


def test_an_optimizer_that_cannot_be_captured_runs_eagerly():
    class Plain(Trainer):
        def __init__(self):
            self.model = make()
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)  # not capturable

    graphed_trainer, eager_trainer = Plain(), Plain()
    train = autograph.graphed(graphed_trainer.step)
    for x, y in data(8):
        torch.testing.assert_close(train(x, y), eager_trainer.step(x, y), **TOL)
    assert_same(graphed_trainer, eager_trainer)
    s = autograph.stats(train)
    assert s["replays"] == 0 and s["eager"] == 8, s
