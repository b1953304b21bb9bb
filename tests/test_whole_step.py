"""A whole training step graphed (zero_grad, forward, backward, optimizer step in one
call): one plain graph, equal to eager step after step, and the optimizer's Python
state (its learning rate, its state) guarded, through the CPU stand-in."""

import copy
import functools

import pytest
import torch
from torch import nn

import autograph


def make(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def step(model, opt, x, y):
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


class Trainer:
    """A plain object whose method is the step: its model is found through its
    attributes (a parameter moved by ``.data =`` is seen)."""

    def __init__(self, model, lr=0.05):
        self.model = model
        self.opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)

    def step(self, x, y):
        return step(self.model, self.opt, x, y)


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 16, generator=g), torch.randn(4, 4, generator=g))
            for _ in range(n)]


def same_params(a, b):
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_whole_step_replays_and_equals_eager(standin):
    graphed_trainer, eager_trainer = Trainer(make()), Trainer(make())
    train = autograph.graphed(graphed_trainer.step)
    for x, y in batches(12):
        torch.testing.assert_close(train(x, y), eager_trainer.step(x, y), rtol=0, atol=0)
    same_params(graphed_trainer.model, eager_trainer.model)
    s = autograph.stats(train)
    assert s["replays"] >= 8 and s["captures"] == 1, s
    assert graphed_trainer.opt.state  # the momentum buffers the replays wrote


def test_a_new_learning_rate_is_seen(standin):
    graphed_trainer, eager_trainer = Trainer(make()), Trainer(make())
    train = autograph.graphed(graphed_trainer.step)
    for i, (x, y) in enumerate(batches(16)):
        if i in (6, 11):  # a schedule assigning a Python float
            for t in (graphed_trainer, eager_trainer):
                t.opt.param_groups[0]["lr"] *= 0.5
        torch.testing.assert_close(train(x, y), eager_trainer.step(x, y), rtol=0, atol=0)
    same_params(graphed_trainer.model, eager_trainer.model)
    s = autograph.stats(train)
    assert s["invalidations"] == 2 and s["replays"] >= 6, s


def test_a_new_optimizer_or_moved_parameters_are_seen(standin):
    graphed_trainer, eager_trainer = Trainer(make()), Trainer(make())
    train = autograph.graphed(graphed_trainer.step)
    for i, (x, y) in enumerate(batches(18)):
        if i == 6:  # a fresh optimizer: new momentum buffers
            for t in (graphed_trainer, eager_trainer):
                t.opt = torch.optim.SGD(t.model.parameters(), lr=0.02, momentum=0.5)
        if i == 12:  # parameters replaced in place of their storage
            for t in (graphed_trainer, eager_trainer):
                with torch.no_grad():
                    t.model[0].weight.data = t.model[0].weight.data.clone()
        torch.testing.assert_close(train(x, y), eager_trainer.step(x, y), rtol=0, atol=0)
    same_params(graphed_trainer.model, eager_trainer.model)
    assert autograph.stats(train)["replays"] >= 6


def test_backward_false_runs_a_whole_step_eagerly(standin):
    graphed_trainer, eager_trainer = Trainer(make()), Trainer(make())
    train = autograph.graphed(graphed_trainer.step, backward=False)
    for x, y in batches(4):
        torch.testing.assert_close(train(x, y), eager_trainer.step(x, y), rtol=0, atol=0)
    s = autograph.stats(train)
    assert s["replays"] == 0 and s["eager_reasons"].get("autograd") == 4


@pytest.mark.parametrize("keep_graph", [False, True])
def test_a_step_returning_a_tensor_that_requires_grad_is_no_whole_step(standin, keep_graph):
    """The loss returned undetached: autograd's work leaves the call, so it is a
    training graph (forward and backward graphs), not one plain graph."""
    model, reference = make(), make()
    fn = autograph.graphed(lambda x: model(x).square().mean())
    for x, _ in batches(6):
        loss = fn(x)
        ref = reference(x).square().mean()
        assert loss.requires_grad
        loss.backward(retain_graph=keep_graph)
        ref.backward(retain_graph=keep_graph)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    assert copy.copy(autograph.stats(fn))["replays"] >= 1


def test_gradients_dropped_outside_the_step_are_seen(standin):
    """``zero_grad(set_to_none=True)`` inside the step makes its gradients in the graph's
    pool; dropping them outside too (``model.zero_grad()``) must not leave the replays
    writing into freed memory while ``.grad`` reads None."""
    graphed_trainer, eager_trainer = Trainer(make()), Trainer(make())
    train = autograph.graphed(graphed_trainer.step)
    for i, (x, y) in enumerate(batches(14)):
        if i in (7, 10):
            for t in (graphed_trainer, eager_trainer):
                t.model.zero_grad(set_to_none=True)
        torch.testing.assert_close(train(x, y), eager_trainer.step(x, y), rtol=0, atol=0)
        for p, q in zip(graphed_trainer.model.parameters(), eager_trainer.model.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
    same_params(graphed_trainer.model, eager_trainer.model)
    s = autograph.stats(train)
    assert s["invalidations"] == 2 and s["replays"] >= 4, s


def test_a_backward_inside_that_reaches_an_argument_runs_eagerly(standin):
    """A step whose backward gives an argument its ``.grad`` (the argument requires
    grad) cannot be one graph: a static buffer would take the gradient, not the
    caller's tensor. It runs eagerly, and the caller's tensor gets its gradient."""
    model, reference = make(), make()

    def step(m, x):
        loss = m(x).square().mean()
        loss.backward()
        return loss.detach()

    fn = autograph.graphed(lambda x: step(model, x))
    for x, _ in batches(6):
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        model.zero_grad()
        reference.zero_grad()
        torch.testing.assert_close(fn(a), step(reference, b))
        torch.testing.assert_close(a.grad, b.grad)
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
    s = autograph.stats(fn)
    assert s["replays"] == 0 and s["eager_reasons"].get("backward_unsupported") == 5, s


def test_a_backward_inside_a_call_returning_a_tensor_that_requires_grad_runs_eagerly(
        standin):
    """A call that runs its own backward and also returns a tensor that requires grad:
    a training graph would run that inner backward only at its capture."""
    model, reference = make(), make()

    def step(m, x):
        m(x).square().mean().backward()
        return m(x).sum()

    fn = autograph.graphed(lambda x: step(model, x))
    for x, _ in batches(6):
        model.zero_grad()
        reference.zero_grad()
        out, want = fn(x), step(reference, x)
        out.backward()
        want.backward()
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
    s = autograph.stats(fn)
    assert s["replays"] == 0 and s["eager_reasons"].get("backward_unsupported") == 5, s


def _classifier_step(model, opt):
    def step(x, y):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return step


def check_whole_steps_see_frozen_layers_and_loaded_optimizer_state(device="cpu"):
    """A graphed whole step kept training a layer frozen after its capture (and never
    trained one unfrozen), and kept stepping the momentum it captured after
    ``optimizer.load_state_dict`` (shared with tests/gpu)."""
    torch.manual_seed(0)
    eager_model = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 3)).to(device)
    graphed_model = copy.deepcopy(eager_model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
            for m in (eager_model, graphed_model)]
    eager = _classifier_step(eager_model, opts[0])
    graphed = autograph.graphed(_classifier_step(graphed_model, opts[1]))
    for i in range(14):
        x, y = torch.randn(5, 6, device=device), torch.randint(0, 3, (5,), device=device)
        if i in (5, 8):  # freeze the first layer, then train it again
            for m in (eager_model, graphed_model):
                m[0].requires_grad_(i == 8)
        if i == 4:
            saved = copy.deepcopy((eager_model.state_dict(), opts[0].state_dict()))
        if i == 11:  # resume from the checkpoint
            for m, opt in zip((eager_model, graphed_model), opts):
                m.load_state_dict(saved[0])
                opt.load_state_dict(copy.deepcopy(saved[1]))
        eager(x, y)
        graphed(x, y)
        for a, b in zip(eager_model.parameters(), graphed_model.parameters()):
            torch.testing.assert_close(a, b)
    assert autograph.stats(graphed)["replays"] >= 2, autograph.stats(graphed)


def test_whole_steps_see_frozen_layers_and_loaded_optimizer_state(standin):
    check_whole_steps_see_frozen_layers_and_loaded_optimizer_state()


def check_no_grad_calls_under_grad_mode_survive_training_steps(device="cpu"):
    """A call made under grad mode that runs its modules under ``no_grad`` inside (an
    action chosen, a Polyak update) was kept as a whole step, and its graph guarded
    every parameter's ``.grad``: each training step's new ``.grad`` dropped it, so it
    captured after every step and never replayed.  Only a call whose backward touched
    the gradients guards them."""
    torch.manual_seed(0)
    online = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3)).to(device)
    target = copy.deepcopy(online)
    twin, twin_target = copy.deepcopy(online), copy.deepcopy(online)

    def act(net, obs):
        with torch.no_grad():
            return net(obs).argmax(-1)

    def soft_update(net, tgt, tau):
        with torch.no_grad():
            for p, q in zip(net.parameters(), tgt.parameters()):
                q.mul_(1 - tau).add_(p * tau)

    g_act = autograph.graphed(lambda obs: act(online, obs))
    g_update = autograph.graphed(lambda tau: soft_update(online, target, tau))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (online, twin)]
    tau = torch.tensor(0.1, device=device)
    for _ in range(8):
        obs = torch.randn(5, 4, device=device)
        with autograph.disabled():
            want = act(twin, obs)
        assert torch.equal(g_act(obs), want)
        for net, opt in zip((online, twin), opts):
            opt.zero_grad(set_to_none=True)
            net(obs).pow(2).mean().backward()
            opt.step()
        g_update(tau)
        with autograph.disabled():
            soft_update(twin, twin_target, tau)
        for p, q in zip(target.parameters(), twin_target.parameters()):
            torch.testing.assert_close(p, q)
    for g in (g_act, g_update):
        s = autograph.stats(g)
        assert s["replays"] >= 5 and s["invalidations"] == 0, s


def test_no_grad_calls_under_grad_mode_survive_training_steps(standin):
    check_no_grad_calls_under_grad_mode_survive_training_steps()


def check_whole_steps_that_drop_their_gradients_see_outside_ones(device="cpu"):
    """A whole step that ends with ``p.grad = None`` (a hand-written SGD) captured with
    no ``.grad`` before or after it: a gradient the caller backpropagated before a later
    call (an auxiliary loss) was ignored by the replays, which start from nothing.
    A step that runs a backward guards its parameters' ``.grad``."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2).to(device)
    twin = copy.deepcopy(model)

    def step(m, x, y):
        ((m(x) - y) ** 2).mean().backward()
        with torch.no_grad():
            for p in m.parameters():
                p.add_(p.grad, alpha=-0.1)
                p.grad = None

    g = autograph.graphed(lambda x, y: step(model, x, y))
    for i in range(8):
        x, y = torch.randn(3, 4, device=device), torch.randn(3, 2, device=device)
        if i == 5:
            for m in (model, twin):
                m(x).sum().backward()
        g(x, y)
        with autograph.disabled():
            step(twin, x, y)
        for p, q in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(p, q)
            assert p.grad is None and q.grad is None
    assert autograph.stats(g)["replays"] >= 2, autograph.stats(g)


def test_whole_steps_that_drop_their_gradients_see_outside_ones(standin):
    check_whole_steps_that_drop_their_gradients_see_outside_ones()


def check_accumulating_micro_steps_captured_first_in_their_window(device="cpu"):
    """A graphed micro-step (forward and ``backward()``, accumulating over two
    micro-batches; the caller steps and zeroes with ``set_to_none=True`` after each
    pair): captured at the first micro-batch of a window, with no ``.grad`` there, its
    graph wrote a fresh gradient, and the next call replayed it where eager adds to
    the one there: the parameters diverged.  Such a graph replays only where the
    caller holds the ``.grad`` as it did (``set_to_none=False``: every call replays);
    results equal eager's either way."""
    for k, warmup, to_none in ((2, 2, True), (3, 3, True), (2, 1, True), (2, 2, False)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).to(device)
        twin = copy.deepcopy(model)
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, twin)]

        def micro(m, x, y):
            loss = ((m(x) - y) ** 2).mean()
            loss.backward()
            return loss.detach()

        g = autograph.graphed(functools.partial(micro, model), warmup=warmup)
        for i in range(4 * k * 3):
            x, y = torch.randn(3, 4, device=device), torch.randn(3, 2, device=device)
            got = g(x, y)
            with autograph.disabled():
                want = micro(twin, x, y)
            torch.testing.assert_close(got, want)
            for p, q in zip(model.parameters(), twin.parameters()):
                torch.testing.assert_close(p.grad, q.grad)
            if (i + 1) % k == 0:
                for opt in opts:
                    opt.step()
                    opt.zero_grad(set_to_none=to_none)
        for p, q in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(p, q)
        if not to_none:  # the gradients stay: the graph replays
            assert autograph.stats(g)["replays"] >= 10, autograph.stats(g)


def test_accumulating_micro_steps_captured_first_in_their_window(standin):
    check_accumulating_micro_steps_captured_first_in_their_window()


def check_steps_taking_gradients_with_autograd_grad(device="cpu"):
    """A step computing its gradients with ``torch.autograd.grad`` (no ``.grad``
    involved) while the caller's own backward and ``zero_grad(set_to_none=True)`` come
    and go around it: ``autograd.grad`` was taken for a read of ``.grad``, every
    parameter's ``.grad`` was guarded and each call recaptured.  It replays, and the
    parameters and the ``.grad`` the caller made equal eager's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).to(device)
    twin = copy.deepcopy(model)

    def stepper(m):
        def step(x):
            params = list(m.parameters())
            loss = m(x).square().mean()
            grads = torch.autograd.grad(loss, params)
            with torch.no_grad():
                for p, gr in zip(params, grads):
                    p.sub_(0.1 * gr)
            return loss.detach()
        return step

    g, eager = autograph.graphed(stepper(model)), stepper(twin)
    for _ in range(8):
        x = torch.randn(3, 4, device=device)
        for m in (model, twin):
            m(x).sum().backward()
        got = g(x)
        with autograph.disabled():
            want = eager(x)
        torch.testing.assert_close(got, want)
        for p, q in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(p, q)
            torch.testing.assert_close(p.grad, q.grad)
        for m in (model, twin):
            m.zero_grad(set_to_none=True)
    s = autograph.stats(g)
    assert s["replays"] >= 5 and s["invalidations"] == 0, s


def test_steps_taking_gradients_with_autograd_grad(standin):
    check_steps_taking_gradients_with_autograd_grad()


class SchedTrainer(Trainer):
    """A step that also steps a learning-rate scheduler: ``order`` says where and how
    (``callback``: through a list of bound methods, no attribute holding either)."""

    def __init__(self, model, order, lr=0.05):
        lr = torch.tensor(lr) if order == "tensor lr" else lr
        self.model, self.order = model, order
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        if order == "chained":  # its StepLR changes no lr before the capture
            sched = torch.optim.lr_scheduler.ChainedScheduler(
                [torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)])
        else:
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        if order == "callback":
            self.callbacks = [sched.step, opt.step]
        else:
            self.opt, self.sched = opt, sched

    def step(self, x, y):
        if self.order == "callback":
            for p in self.model.parameters():
                p.grad = None
            loss = nn.functional.mse_loss(self.model(x), y)
            loss.backward()
            for callback in self.callbacks:  # the scheduler first
                callback()
            return loss.detach()
        if self.order == "before":
            self.sched.step()
        loss = step(self.model, self.opt, x, y)
        if self.order != "before":
            self.sched.step()
        return loss


def check_whole_steps_stepping_a_scheduler_run_eagerly(order, device="cpu"):
    """A replay runs no Python: a step whose scheduler steps inside it (before or after
    the optimizer, with a float or a tensor learning rate) runs eagerly, its scheduler
    and parameters as eager's step after step."""
    graphed_trainer = SchedTrainer(make().to(device), order)
    eager_trainer = SchedTrainer(make().to(device), order)
    train = autograph.graphed(graphed_trainer.step)
    for x, y in batches(8):
        x, y = x.to(device), y.to(device)
        torch.testing.assert_close(train(x, y), eager_trainer.step(x, y))
        same_params(graphed_trainer.model, eager_trainer.model)
    s = autograph.stats(train)
    assert s["replays"] == 0 and s["eager_reasons"].get("assigns_attribute", 0) >= 4, s


@pytest.mark.parametrize("order", ["after", "before", "tensor lr", "chained", "callback"])
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_whole_steps_stepping_a_scheduler_run_eagerly(standin, order):
    check_whole_steps_stepping_a_scheduler_run_eagerly(order)


def _steps_equal(stepper, n, device, warmup, grads):
    """Run the step ``stepper`` makes for a model graphed and for its twin eagerly, ``n``
    batches: results and parameters (and with ``grads`` their ``.grad``) equal after
    every step; the graphed step's counters."""
    model, twin = make().to(device), make().to(device)
    train, eager = autograph.graphed(stepper(model), warmup=warmup), stepper(twin)
    for x, y in batches(n):
        x, y = x.to(device), y.to(device)
        torch.testing.assert_close(train(x, y), eager(x, y))
        for p, q in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(p, q)
            if grads:
                torch.testing.assert_close(p.grad, q.grad)
    return autograph.stats(train)


def check_a_failed_step_capture_is_not_stepped_twice(kind, device="cpu"):
    """A step whose capture fails (a host read of a device value) ran its Python once
    before its eager run: a gradient scaler's ``unscale_`` marked done, an optimizer's
    state made inside the capture (no warmup) are put back first."""
    def stepper(model):
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler(device, init_scale=1024.0)

        def train(x, y):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            if kind == "scaler":
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                scaler.step(opt)
                scaler.update()
                return loss.detach()
            loss.backward()
            opt.step()
            return loss.item()
        return train

    s = _steps_equal(stepper, 5, device, warmup=0 if kind == "item" else 2, grads=False)
    assert s["eager_reasons"].get("capture_failed"), s


@pytest.mark.parametrize("kind", ["scaler", "item"])
def test_a_failed_step_capture_is_not_stepped_twice(standin, kind):
    check_a_failed_step_capture_is_not_stepped_twice(kind)


class ScaledSGD(torch.optim.Optimizer):
    """An optimizer of the user's whose step reads its own attribute."""

    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})
        self.scale = 1.0

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] * self.scale)


def check_whole_steps_see_swapped_parameters_and_optimizer_attributes(device="cpu"):
    """A parameter swapped into a group's list, and a custom optimizer's own
    attribute, are what a captured step baked in: changed, the step captures again."""
    def stepper(model):
        opt = ScaledSGD([model[0].weight], lr=0.1)
        return opt, functools.partial(step, model, opt)

    model, twin = make().to(device), make().to(device)
    (opt, train), (eager_opt, eager) = stepper(model), stepper(twin)
    train = autograph.graphed(train)
    for i, (x, y) in enumerate(batches(14)):
        if i == 5:
            opt.param_groups[0]["params"][0] = model[2].weight
            eager_opt.param_groups[0]["params"][0] = twin[2].weight
        if i == 9:
            opt.scale = eager_opt.scale = 0.5
        x, y = x.to(device), y.to(device)
        torch.testing.assert_close(train(x, y), eager(x, y))
        same_params(model, twin)
    s = autograph.stats(train)
    assert s["replays"] >= 5 and s["invalidations"] == 2, s


def test_whole_steps_see_swapped_parameters_and_optimizer_attributes(standin):
    check_whole_steps_see_swapped_parameters_and_optimizer_attributes()


class _Decayed(torch.optim.Optimizer):
    """A user's momentum SGD whose state tensor is replaced at each step (``boxed``:
    held in a list)."""

    def __init__(self, params, lr, boxed=False):
        super().__init__(params, {"lr": lr})
        self.boxed = boxed

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                m = state["m"][0] if self.boxed and "m" in state else state.get("m")
                m = p.grad.clone() if m is None else m * 0.9 + p.grad
                state["m"] = [m] if self.boxed else m
                p.sub_(group["lr"] * m)


class _Counted(torch.optim.SGD):
    """A user's SGD whose bias correction reads a step count kept on the host."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                state["step"] = state.get("step", 0) + 1
                p.sub_(p.grad, alpha=group["lr"] / state["step"])


class _Trust(torch.optim.SGD):
    """An SGD that keeps a list of tensors in its group, made anew by every step, and a
    count that is no dict in its state."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["scales"] = [torch.ones_like(p) for p in group["params"]]
        self.state["steps"] = 0
        return super().step(closure)


def check_whole_steps_with_state_made_or_written_by_kernels(kind, device="cpu"):
    """A step captured first (``warmup=0``) that makes its optimizer's momentum runs
    eagerly once and is captured after a warmup (its graph replayed the first step's
    branch); a learning rate a kernel decays in place replays; one replaced by a new
    tensor made from it, a state tensor replaced so, or tensors made anew in a group by
    every step run eagerly (a replay would read the captured one again); a failed
    capture leaves no ``.grad`` of its own (memory no kernel wrote) on the parameters."""
    def stepper(model):
        lr = torch.tensor(0.01, device=device) if kind.startswith("lr") else 0.05
        opt = (torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
               if kind in ("momentum", "nan") else _Decayed(model.parameters(), 0.05, True)
               if kind == "state list"
               else torch.optim.AdamW(model.parameters(), lr=lr, fused=True,
                                      capturable=device != "cpu")
               if kind.startswith("lr") else _Decayed(model.parameters(), lr=0.05)
               if kind == "state replaced" else _Counted(model.parameters(), lr=0.05)
               if kind == "host count" else _Trust(model[0].parameters(), lr=0.05))
        decay = opt.param_groups[0]["lr"]  # the group's tensor
        if kind == "nan":
            opt.state["unset"] = float("nan")  # kept as it is: the same object

        def train(x, y):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            if kind == "lr decay":
                decay.mul_(0.99)
            if kind == "lr replaced":  # a new tensor, made from the one it replaces
                opt.param_groups[0]["lr"] = opt.param_groups[0]["lr"] * 0.9
            return loss.item() if kind == "failed" else loss.detach()
        return train

    s = _steps_equal(stepper, 8, device, warmup=0 if kind in ("momentum", "failed") else 2,
                     grads=True)
    if kind in ("momentum", "lr decay", "nan"):
        assert s["replays"] >= 4, s
    else:  # eager, and why
        assert s["replays"] == 0 and (s["eager_reasons"].get("capture_failed") if kind ==
                                      "failed" else s["eager_reasons"]["assigns_attribute"]), s


KINDS = ["momentum", "lr decay", "nan", "lr replaced", "state replaced", "state list",
         "host count", "trust", "failed"]


@pytest.mark.parametrize("kind", KINDS)
def test_whole_steps_with_state_made_or_written_by_kernels(standin, kind):
    check_whole_steps_with_state_made_or_written_by_kernels(kind)


@pytest.mark.parametrize("fused", [False, True])
def test_verified_whole_steps_keep_replaying(standin, fused):
    """``verify_every`` on a whole step: the check's eager run left its own new
    ``.grad`` tensors on the parameters, so the step's guard dropped the graphs after
    every verification; a fused optimizer's state (written without a version bump) was
    stepped by the check's eager run too."""
    counts = []
    for every in (None, 3):
        trainer, twin = Trainer(make()), Trainer(make())
        if fused:
            for t in (trainer, twin):
                t.opt = torch.optim.SGD(t.model.parameters(), lr=0.05, momentum=0.9,
                                        fused=True)
        train = autograph.graphed(trainer.step, verify_every=every)
        for x, y in batches(20):
            torch.testing.assert_close(train(x, y), twin.step(x, y))
        same_params(trainer.model, twin.model)
        s = autograph.stats(train)
        counts.append((s["replays"], s["captures"], s["invalidations"]))
        assert every is None or s["verifications"] >= 5, s
    assert counts[0] == counts[1] and counts[0][0] >= 10, counts


def check_a_gradient_dropped_outside_an_accumulating_step(device="cpu"):
    """A step that adds to a closure tensor's ``.grad`` (it zeroes none itself), whose
    ``.grad`` the caller drops once: captured then, the graph assigned the gradient
    where every later call adds to it. That capture runs eagerly, and the key warms up
    and captures again with the gradient there."""
    def stepper(w):
        def train(x, y):
            loss = ((x @ w - y) ** 2).mean()
            loss.backward()
            with torch.no_grad():
                w.sub_(0.1 * w.grad)
            return loss.detach()
        return train

    torch.manual_seed(0)
    w = torch.randn(4, 2, device=device, requires_grad=True)
    twin = w.detach().clone().requires_grad_()
    g, eager = autograph.graphed(stepper(w)), stepper(twin)
    for i in range(12):
        x, y = torch.randn(3, 4, device=device), torch.randn(3, 2, device=device)
        if i == 5:
            w.grad = twin.grad = None
        torch.testing.assert_close(g(x, y), eager(x, y))
        torch.testing.assert_close(w, twin)
        torch.testing.assert_close(w.grad, twin.grad)
    assert autograph.stats(g)["replays"] >= 4, autograph.stats(g)


def test_a_gradient_dropped_outside_an_accumulating_step(standin):
    check_a_gradient_dropped_outside_an_accumulating_step()


def test_a_step_whose_gradients_are_dropped_outside_gives_up(standin):
    """``model.zero_grad()`` (``set_to_none``) outside a whole step: every capture made
    the ``.grad`` anew (eager once, a warmup, another capture, without end). The second
    time the key runs eagerly for good, with its reason."""
    trainer, twin = Trainer(make()), Trainer(make())

    def outer_step(t, x, y):  # a step that zeroes nothing itself
        loss = nn.functional.mse_loss(t.model(x), y)
        loss.backward()
        t.opt.step()
        return loss.detach()

    train = autograph.graphed(functools.partial(outer_step, trainer))
    for x, y in batches(12):
        trainer.model.zero_grad()
        twin.model.zero_grad()
        torch.testing.assert_close(train(x, y), outer_step(twin, x, y))
        same_params(trainer.model, twin.model)
    s = autograph.stats(train)
    assert s["captures"] == 0 and s["eager_reasons"].get("assigns_attribute", 0) >= 5, s
