"""Training graphs on real CUDA graphs (issue 17), in the style of Transformer
Engine's tests/pytorch/test_cuda_graphs.py: the same model trained eagerly and through
autograph from the same seed, three optimizer steps of two accumulated micro-batches
each; losses, gradients, parameters and buffers compared, and the replays counted.
Skipped without CUDA.

Exactness: replays launch the kernels eager launches, so results are compared bit for
bit (``EXACT``) where the kernels are deterministic: cuDNN is put in deterministic mode
with benchmarking off for the whole file, and attention runs on the math backend (the
memory-efficient kernel's backward accumulates with atomics).  The GRU (cuDNN's RNN
kernels) is compared within ``RNN_TOL``.  Dropout > 0 draws other numbers than eager
(graph-safe RNG), so that model is checked for fresh masks and gradients that follow
them, not against eager.

Run: ``python -m pytest -q tests/gpu/test_backward_cuda.py``
"""

import contextlib
import copy

import pytest
import torch
from torch import nn

import autograph

from ..test_backward import (
    check_a_tensor_saved_by_a_node_no_output_reaches_may_change,
    check_an_argument_the_call_never_uses_takes_no_part,
    check_an_output_saved_only_by_an_unreached_node_may_be_written,
    check_double_backward,
    check_frozen_model_unfrozen,
    check_hooks_of_a_parameter_the_call_never_uses_are_not_called,
    check_hooks_of_parameters_only_unused_outputs_reach,
    check_post_hooks_after_two_calls_in_one_backward,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

EXACT = {"rtol": 0, "atol": 0}
RNN_TOL = {"rtol": 1e-5, "atol": 1e-6}
STEPS, MICRO = 3, 2


@pytest.fixture(autouse=True)
def deterministic_kernels():
    flags = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    attention = contextlib.nullcontext()
    with contextlib.suppress(ImportError):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        attention = sdpa_kernel(SDPBackend.MATH)
    try:
        with attention:
            yield
    finally:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = flags


def mlp():
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.LayerNorm(256), nn.Linear(256, 256),
                         nn.ReLU(), nn.Linear(256, 10))


def transformer(dropout=0.0):
    return nn.Sequential(nn.TransformerEncoderLayer(64, 4, 128, dropout=dropout,
                                                    batch_first=True),
                         nn.Flatten(), nn.Linear(64 * 16, 10))


def cnn():
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.Conv2d(16, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16),
                         nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))


class GRUNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.gru = nn.GRU(32, 64, batch_first=True)
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        return self.head(self.gru(x)[0][:, -1])


MODELS = {
    "mlp": (mlp, (8, 64), EXACT),
    "transformer": (transformer, (8, 16, 64), EXACT),
    "cnn_batchnorm": (cnn, (8, 3, 16, 16), EXACT),
    "gru": (GRUNet, (8, 12, 32), RNN_TOL),
}


def data(shape, n=STEPS * MICRO, seed=1):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [(torch.randn(*shape, device="cuda", generator=g),
             torch.randint(0, 10, (shape[0],), device="cuda", generator=g)) for _ in range(n)]


def train(model, batches, *, amp=False):
    """Three AdamW steps of two micro-batches each (with GradScaler under ``amp``);
    returns the losses and each step's gradients."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cuda", enabled=amp)
    losses, grads = [], []
    it = iter(batches)
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        for _ in range(MICRO):
            x, y = next(it)
            with torch.autocast("cuda", dtype=torch.float16, enabled=amp):
                loss = nn.functional.cross_entropy(model(x), y) / MICRO
            scaler.scale(loss).backward()
            losses.append(loss.detach())
        grads.append([p.grad.detach().clone() for p in model.parameters()])
        scaler.step(opt)
        scaler.update()
    return losses, grads


def compare(make, shape, tol, amp=False):
    torch.manual_seed(0)
    eager = make().cuda().train()
    model = copy.deepcopy(eager)
    g = autograph.graphed(model)  # warmup=2: calls 1-2 eager, 3 captured, 4-6 replayed
    batches = data(shape)
    want = train(eager, batches, amp=amp)
    got = train(g, batches, amp=amp)
    for a, b in zip(want[0], got[0]):
        torch.testing.assert_close(b, a, **tol)
    for step_a, step_b in zip(want[1], got[1]):
        for a, b in zip(step_a, step_b):
            torch.testing.assert_close(b, a, **tol)
    for (name, a), b in zip(eager.state_dict().items(), model.state_dict().values()):
        torch.testing.assert_close(b, a, **tol, msg=lambda m, n=name: f"{n}: {m}")
    return autograph.stats(g)


@pytest.mark.parametrize("name", list(MODELS))
def test_training_equals_eager(name):
    make, shape, tol = MODELS[name]
    s = compare(make, shape, tol)
    # 6 calls: 2 warmups, the capture, 3 replays; the capture's backward runs the
    # captured autograd graph eagerly, the next call captures the backward graph
    assert (s["eager"], s["captures"], s["replays"]) == (2, 1, 3), s
    # calls 4 and 5 replay the backward graph, whose gradients become .grad (step 3's
    # zero_grad drops the first), so call 6's backward finds them held and runs eagerly
    # (a next call would capture the spare backward graph)
    assert (s["backward_eager"], s["backward_captures"], s["backward_replays"]) == (2, 1, 2), s


@pytest.mark.parametrize("name", ["mlp", "transformer", "cnn_batchnorm"])
def test_amp_with_grad_scaler_equals_eager(name):
    make, shape, tol = MODELS[name]
    s = compare(make, shape, tol, amp=True)
    assert s["replays"] == 3 and s["backward_replays"] == 2, s  # as in the test above


def test_transformer_with_dropout_draws_fresh_masks():
    torch.manual_seed(0)
    model = transformer(dropout=0.5).cuda().train()
    g = autograph.graphed(model)
    losses, _ = train(g, data((8, 16, 64)))
    assert all(torch.isfinite(loss) for loss in losses)
    x = torch.randn(8, 16, 64, device="cuda")
    a, b = g(x), g(x)  # a is held: b runs eagerly; both draw their own masks
    assert not torch.equal(a, b)
    s = autograph.stats(g)
    assert s["replays"] >= 4 and s["backward_replays"] == 2  # as in test_training_equals_eager


def test_dropout_gradients_follow_each_replays_mask():
    drop = nn.Dropout(0.5)
    g = autograph.graphed(drop, warmup=1)
    x = torch.ones(4096, device="cuda", requires_grad=True)
    masks = []
    for _ in range(5):
        x.grad = None
        y = g(x)
        y.sum().backward()
        torch.testing.assert_close(x.grad, (y != 0).float() * 2.0, **EXACT)
        masks.append(y != 0)
    assert not torch.equal(masks[-1], masks[-2])
    assert autograph.stats(g)["backward_replays"] == 3  # calls 3-5 (1 warmup, 2 capture)


def test_old_output_backward_after_new_forward_is_right():
    torch.manual_seed(0)
    eager = mlp().cuda()
    g = autograph.graphed(copy.deepcopy(eager), warmup=1)
    xs = [torch.randn(8, 64, device="cuda") for _ in range(3)]
    for _ in range(3):  # warmup, capture, the backward graph's capture
        g(xs[0]).sum().backward()
    for model in (eager, g):
        model.zero_grad()
        a, b = model(xs[1]), model(xs[2])  # graphed: b's replay spills a's saved state
        # dense incoming gradients: an expanded one (``b.sum()``) makes eager's GEMMs
        # take another path than the backward graph's copy of it (last bits differ)
        (a.square().sum() + b.square().sum()).backward()
    for p, q in zip(eager.parameters(), g.parameters()):
        torch.testing.assert_close(q.grad, p.grad, **EXACT)
    s = autograph.stats(g)
    assert s["eager_reasons"] == {"warmup": 1} and s["backward_spills"] >= 1, s


@pytest.mark.parametrize("name", ["mlp", "transformer"])
@pytest.mark.parametrize("order", ["forward", "reverse", "mixed"])
def test_spilled_outputs_backpropagated_in_any_order_equal_eager(name, order):
    torch.manual_seed(0)
    eager = (mlp() if name == "mlp" else transformer()).cuda()
    g = autograph.graphed(copy.deepcopy(eager), warmup=1)
    shape = (8, 64) if name == "mlp" else (4, 16, 64)
    xs = [torch.randn(*shape, device="cuda") for _ in range(6)]
    for i in range(6):  # warmup, capture, the backward graph's capture, then its
        if i == 3:  # gradients adopted as .grad, held at the next backward (eager),
            g.zero_grad()  # and the spare backward graph's capture
        g(xs[0]).sum().backward()
    assert autograph.stats(g)["backward_captures"] == 2
    idx = {"forward": [0, 1, 2, 3, 4, 5], "reverse": [5, 4, 3, 2, 1, 0],
           "mixed": [3, 0, 5, 1, 4, 2]}[order]
    for model in (eager, g):
        model.zero_grad()
        outs = [model(x) for x in xs]  # each replay spills the call before
        for k, i in enumerate(idx):
            retain = k == 1
            (outs[i].square().mean() * (k + 1)).backward(retain_graph=retain)
        outs[idx[1]].square().mean().backward()  # the retained one, again
    for p, q in zip(eager.parameters(), g.parameters()):
        torch.testing.assert_close(q.grad, p.grad, **EXACT)
    s = autograph.stats(g)
    assert "backward_pending" not in s["eager_reasons"], s
    assert s["backward_spills"] >= 5 and s["backward_replays"] >= 7, s


def test_grad_mode_inference_loop_keeping_outputs_replays():
    torch.manual_seed(0)
    model = mlp().cuda()
    g = autograph.graphed(model, warmup=1)
    xs = [torch.randn(8, 64, device="cuda") for _ in range(10)]
    kept = [g(x) for x in xs]
    with torch.no_grad():
        want = [model(x) for x in xs]
    for a, b in zip(kept, want):
        torch.testing.assert_close(a, b, **EXACT)
    s = autograph.stats(g)
    assert s["replays"] == 8 and s["eager_reasons"] == {"warmup": 1}, s
    assert s["backward_captures"] == 0


@pytest.mark.parametrize("norm", [False, True])
def test_double_backward_of_a_physics_informed_loss_equals_eager(norm):
    check_double_backward(norm, "cuda", batch=32)


def test_a_frozen_model_unfrozen_records_again():
    check_frozen_model_unfrozen("cuda")


def test_a_tensor_saved_by_a_node_no_output_reaches_may_change():
    check_a_tensor_saved_by_a_node_no_output_reaches_may_change("cuda")


def test_hooks_of_a_parameter_the_call_never_uses_are_not_called():
    check_hooks_of_a_parameter_the_call_never_uses_are_not_called("cuda")


def test_an_argument_the_call_never_uses_takes_no_part():
    check_an_argument_the_call_never_uses_takes_no_part("cuda")


def test_an_output_saved_only_by_an_unreached_node_may_be_written():
    check_an_output_saved_only_by_an_unreached_node_may_be_written("cuda")


def test_hooks_of_parameters_only_unused_outputs_reach():
    check_hooks_of_parameters_only_unused_outputs_reach("cuda")


def test_post_hooks_after_two_calls_in_one_backward():
    check_post_hooks_after_two_calls_in_one_backward("cuda")
