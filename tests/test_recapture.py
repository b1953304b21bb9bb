"""After an invalidation that keeps what warming up learned (parameters or buffers at
new addresses, or replaced by tensors of their shape and dtype), a key that held a
graph is captured again on its next call without warming up; after an attribute
assignment it warms up again."""

import torch
from torch import nn

import autograph


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.lin = nn.Linear(16, 16)
        self.scale = 2.0

    def forward(self, ids):
        return self.lin(self.emb(ids)).float() * self.scale


def _counts(g):
    s = autograph.stats(g)
    return s["captures"], s["eager_reasons"].get("warmup", 0), s["invalidations"]


def _run(g, m, n=4):
    for _ in range(n):
        ids = torch.randint(0, 50, (3, 5))
        torch.testing.assert_close(g(ids), m(ids), rtol=1e-3, atol=1e-3)


def test_half_recaptures_without_warmup(standin):
    torch.manual_seed(0)
    m = Net().eval()
    g = autograph.graphed(m, warmup=2)
    with torch.no_grad():
        _run(g, m)
        assert _counts(g) == (1, 2, 0)
        m.half()  # every parameter at a new address, in another dtype
        _run(g, m)
    assert _counts(g) == (2, 2, 1)  # one capture more, no warmup more
    assert autograph.stats(g)["replays"] == 4


def test_back_to_the_first_dtype_recaptures_without_warmup(standin):
    """``.to(bfloat16)`` then ``.float()``, the inputs following: the float key, dropped
    at the first invalidation, is still known at the second (it warmed up again)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).eval()
    g = autograph.graphed(m, warmup=2)
    x = torch.randn(2, 8)
    with torch.no_grad():
        for dtype in (torch.float32, torch.bfloat16, torch.float32):
            m.to(dtype)
            for _ in range(3):
                torch.testing.assert_close(g(x.to(dtype)), m(x.to(dtype)))
    assert _counts(g) == (3, 4, 2)  # the float key's second time: captured at once
    assert autograph.stats(g)["replays"] == 2


def test_replaced_parameters_recapture_without_warmup(standin):
    torch.manual_seed(0)
    m = Net().eval()
    g = autograph.graphed(m, warmup=2)
    with torch.no_grad():
        _run(g, m)
        m.lin.weight.data = torch.randn(16, 16)  # .data =
        _run(g, m)
        assert _counts(g) == (2, 2, 1)
        state = {k: torch.randn_like(v) for k, v in m.state_dict().items()}
        m.load_state_dict(state, assign=True)  # assigned: same shapes and dtypes
        _run(g, m)
        assert _counts(g) == (3, 2, 2)
        m.lin.weight = nn.Parameter(torch.randn(16, 16))
        _run(g, m)
    assert _counts(g) == (4, 2, 3)


def test_an_attribute_assignment_warms_up_again(standin):
    torch.manual_seed(0)
    m = Net().eval()
    g = autograph.graphed(m, warmup=2)
    with torch.no_grad():
        _run(g, m)
        m.scale = 3.0  # what the forward decides on: learn it again
        _run(g, m)
        assert _counts(g) == (2, 4, 1)
        m.lin.weight.data = torch.randn(16, 16)
        m.lin = nn.Linear(16, 16)  # a swapped submodule, with a moved parameter too
        _run(g, m)
    assert _counts(g) == (3, 6, 2)


def test_a_failed_direct_capture_warms_up_first(standin):
    torch.manual_seed(0)
    m = Net().eval()
    g = autograph.graphed(m, warmup=1)
    with torch.no_grad():
        _run(g, m)
        m.half()
        standin.fail_next = RuntimeError("CUDA error: operation not permitted when "
                                         "stream is capturing")
        _run(g, m)
    captures, warmups, _ = _counts(g)
    assert captures == 2 and warmups == 2  # the failed capture became a warmup
    assert "capture_failed" not in autograph.stats(g)["eager_reasons"]


def test_reset_forgets_the_known_keys(standin):
    m = Net().eval()
    g = autograph.graphed(m, warmup=1)
    with torch.no_grad():
        _run(g, m)
        autograph.reset(g)
        _run(g, m)
    assert _counts(g)[:2] == (2, 2)


def check_an_lstm_graphs_again_after_its_parameters_are_replaced(device="cpu"):
    """A key known before an invalidation is captured again without warming up; an
    RNN's forward sets its flat weights up once after its parameters were replaced,
    which that capture saw as an assignment: the key ran eagerly for good."""
    torch.manual_seed(0)
    lstm = nn.LSTM(8, 8, batch_first=True).to(device).eval()
    g = autograph.graphed(lstm)
    with torch.no_grad():
        for _ in range(4):
            g(torch.randn(2, 5, 8, device=device))
        g.load_state_dict({k: v * 0.5 for k, v in lstm.state_dict().items()}, assign=True)
        before = autograph.stats(g)["replays"]
        for _ in range(8):
            x = torch.randn(2, 5, 8, device=device)
            out = g(x)[0]
            with autograph.disabled():
                torch.testing.assert_close(out, lstm(x)[0])
    assert autograph.stats(g)["replays"] - before >= 4, autograph.stats(g)


def test_an_lstm_graphs_again_after_its_parameters_are_replaced(standin):
    check_an_lstm_graphs_again_after_its_parameters_are_replaced()
