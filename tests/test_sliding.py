"""Host counters (counters.py): Python ints of an object argument keyed by their phase,
stood in for at capture and advanced after each replay; transformers' sliding-window
static caches (Mistral-style generate), on the CPU stand-in.  The stand-in's replay reads
only what was captured, so a counter not advanced or a position baked in shows up as
wrong tokens."""

import pytest
import torch
from torch import nn

import autograph
from autograph import known_types
from autograph.counters import Counter

pytestmark = pytest.mark.usefixtures("standin")


class Window:
    """A toy sliding cache: a device buffer and a Python count, keyed by its phase
    (empty, filling, full) through a registered keyer."""

    def __init__(self, n=4):
        self.buf = torch.zeros(n)
        self.count = 0
        self.n = n


def _key_window(w, walked):
    walked.tensors.append(w.buf)
    walked.paths.append("Window.buf")
    lo, hi = (0, 0) if w.count == 0 else (1, w.n - 1) if w.count < w.n else (w.n, None)
    walked.counters = [Counter((), "count", lo, hi, "Window.count")]
    return ("window", w.n, lo)


known_types.register(Window, _key_window)


class Positions(nn.Module):
    """Adds the count to positions on the device (a graph reads it from a device scalar)
    and branches on the phase in Python."""

    def forward(self, x, w):
        pos = torch.arange(x.shape[0]) + w.count
        full = w.count >= w.n
        w.count += x.shape[0]
        return x * pos if full else x + pos


class Reads(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how = how

    def forward(self, x, w):
        if self.how == "int":
            out = x + int(w.count)
        elif self.how == "compare":
            out = x + 1 if w.count < 2 else x  # varies within the phase 1..3
        elif self.how == "set":
            out = x.clone()
        else:
            out = x
        w.count = 7 if self.how == "set" else w.count + 1
        return (out, w.count) if self.how == "return" else out


def _run(model, steps=10):
    w, outs = Window(), []
    with torch.no_grad():
        for _ in range(steps):
            outs.append(model(torch.ones(1), w))
            if isinstance(outs[-1], tuple):
                outs[-1] = outs[-1][0]
    return torch.cat(outs), w.count


def test_counter_keyed_by_phase_replays_and_advances_it():
    want = _run(Positions(), steps=12)
    g = autograph.graphed(Positions())
    got = _run(g, steps=12)
    assert torch.equal(got[0], want[0]) and got[1] == want[1] == 12
    s = autograph.stats(g)
    # count 0 eager; filling (1..3) and full (4..) warm up twice, capture, replay
    assert s["captures"] == 2 and s["replays"] == 5, s


@pytest.mark.parametrize("how, detail", [
    ("int", "Window.count: the call converts it to int"),
    ("compare", "Window.count: the call compares it (< 2)"),
    ("set", "Window.count: the call sets it to a value not derived from it"),
    ("return", "the call returns a host counter"),
])
def test_counter_read_otherwise_runs_eagerly_naming_it(how, detail):
    want = _run(Reads(how), steps=6)
    g = autograph.graphed(Reads(how))
    got = _run(g, steps=6)
    assert torch.equal(got[0], want[0]) and got[1] == want[1]
    s = autograph.stats(g)
    details = s["eager_details"].get("assigns_attribute", {})
    assert any(detail in d for d in details), s


transformers = pytest.importorskip("transformers")


def _mistral(window=8):
    torch.manual_seed(0)
    cfg = transformers.MistralConfig(vocab_size=1000, hidden_size=64, intermediate_size=128,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, max_position_embeddings=256,
                                     sliding_window=window)
    return transformers.MistralForCausalLM(cfg).eval()


@pytest.mark.parametrize("batch", [1, 2])
def test_mistral_generate_across_the_window_replays_exactly(batch):
    model = _mistral()
    ids = torch.randint(1, 1000, (batch, 5), generator=torch.Generator().manual_seed(batch))
    mask = torch.ones(batch, 5, dtype=torch.long)
    if batch > 1:
        mask[0, :2] = 0  # left padding
    kw = dict(attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=0,
              cache_implementation="static", disable_compile=True)
    with torch.no_grad():
        want = model.generate(ids, **kw)
        g = autograph.graphed(model)
        got = g.generate(ids, **kw)
    assert torch.equal(got, want)
    s = autograph.stats(g)
    # one prefill, then a warmup and a capture per phase (filling, full): 23 replays
    assert s["calls"] == 30 and s["replays"] >= 0.7 * s["calls"], s
    assert s["eager_reasons"].keys() == {"warmup"}, s


def test_decode_loop_positions_from_the_counter():
    """Without position_ids the model adds the layer's count to its positions: the graph
    reads it from a device scalar filled before each replay.  The mask's offset
    max(count - 7, 0) compares the count with the window less one: the last step of
    filling is a phase of its own, so the filling steps replay too (they ran eagerly,
    ``assigns_attribute``, when filling was one phase)."""
    model = _mistral()

    def run(m):
        cache = transformers.StaticCache(config=model.config, max_cache_len=64)
        ids = torch.randint(1, 1000, (1, 5), generator=torch.Generator().manual_seed(1))
        toks = []
        with torch.no_grad():
            logits = m(input_ids=ids, past_key_values=cache).logits
            for _ in range(20):
                toks.append(logits[:, -1:].argmax(-1))
                logits = m(input_ids=toks[-1], past_key_values=cache).logits
        return torch.cat(toks, 1), logits, cache.get_seq_length()

    want = run(model)
    g = autograph.graphed(model)
    got = run(g)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[2] == want[2] == 25
    s = autograph.stats(g)
    assert s["replays"] >= 14, s
    assert "assigns_attribute" not in s["eager_reasons"], s


class Trains(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(1, 1)

    def forward(self, x, w):
        pos = torch.arange(x.shape[0]) + w.count
        w.count += x.shape[0]
        return self.fc(x) * pos


def test_a_call_autograd_records_with_a_counter_runs_eagerly():
    torch.manual_seed(0)
    model = Trains()
    g = autograph.graphed(model)
    w, want_w = Window(), Window()
    for _ in range(8):
        got = g(torch.ones(1, 1), w)
        want = model(torch.ones(1, 1), want_w)
        assert torch.equal(got, want) and w.count == want_w.count
        got.sum().backward()
    s = autograph.stats(g)
    assert s["replays"] == 0, s
    details = s["eager_details"].get("backward_unsupported", {})
    assert any("host counter" in d for d in details), s
