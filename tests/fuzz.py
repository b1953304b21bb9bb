"""Differential fuzzing: random small models, random call sequences, graphed against eager.

``run(seed, device, calls)`` builds a model from the seed (a mix of linear, conv, layer
norm, batch norm, attention, activations, a Python branch on a shape, and an input
written in place), wraps it with ``autograph.graphed``, and drives it and an eager deep
copy with the same random sequence of events: calls with repeated and new shapes,
in-place weight updates, parameter replacement, train/eval switches, grad on and off,
dtype changes.  After every call the outputs, the in-place input and the module state
must agree within the dtype's tolerance.  A failure names the seed and the step, so

    python -m tests.fuzz --seed N --device cuda

replays it.
"""

from __future__ import annotations

import argparse
import copy
import random
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import autograph

TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}


class Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        y = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class Conv(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(d, d, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x.transpose(1, 2)).transpose(1, 2)


class BatchNorm(nn.Module):
    """Batch norm over (batch, time): running statistics updated in place in training."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(x.transpose(1, 2)).transpose(1, 2)


class Branch(nn.Module):
    """A Python decision on a shape: baked into each graph, so keyed by the shape."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 0.5 if x.shape[1] > 3 else x + 1.0


BLOCKS: dict[str, Callable[[int], nn.Module]] = {
    "linear": lambda d: nn.Linear(d, d),
    "conv": Conv,
    "layernorm": nn.LayerNorm,
    "batchnorm": BatchNorm,
    "attention": lambda d: Attention(d, 2),
    "gelu": lambda d: nn.GELU(),
    "relu": lambda d: nn.ReLU(),
    "tanh": lambda d: nn.Tanh(),
    "branch": lambda d: Branch(),
}


class Model(nn.Module):
    """``forward(x, state)``: the blocks on x; ``state`` (batch, d) is written in place."""

    def __init__(self, blocks: list[str], d: int, decay: float) -> None:
        super().__init__()
        self.names = blocks
        self.d = d
        self.blocks = nn.ModuleList(BLOCKS[b](d) for b in blocks)
        self.decay = decay

    def forward(self, x: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x) if isinstance(block, nn.Linear) else block(x)
        state.mul_(self.decay).add_(x.mean(1).to(state.dtype))  # an input written in place
        return x + state.unsqueeze(1).to(x.dtype)


def build(rng: random.Random, device: str) -> Model:
    names = [rng.choice(list(BLOCKS)) for _ in range(rng.randint(2, 6))]
    return Model(names, d=8 * rng.randint(1, 3), decay=rng.choice([0.5, 0.9])).to(device)


def dtypes_for(device: str) -> list[torch.dtype]:
    if device == "cuda":
        return [torch.float32, torch.float16, torch.bfloat16]
    return [torch.float32, torch.bfloat16]  # CPU kernels lack some fp16 ops


def run(seed: int, device: str, calls: int, *, warmup: int | None = None) -> dict[str, int]:
    """Fuzz one model for ``calls`` calls; raise AssertionError naming seed and step."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    model = build(rng, device).eval()
    reference = copy.deepcopy(model)
    options: dict[str, Any] = {"warmup": warmup if warmup is not None else rng.randint(0, 2)}
    if rng.random() < 0.3:  # buckets: padding is checked, and turned off where unsafe
        options["buckets"] = [1, 2, 4, 8]
    style = rng.choice(["wrapper", "wrapper", "region"])  # how the model is graphed
    if style == "region":  # capture_region: the plain module, graphed inside the block
        region = autograph.capture_region(**options)

        def fast(*args: Any, **kwargs: Any) -> Any:
            with region:
                return model(*args, **kwargs)
    else:
        fast = autograph.graphed(model, **options)
    dtype = torch.float32
    d = model.d
    states: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    shapes = [(rng.randint(1, 4), rng.randint(1, 6)) for _ in range(4)]  # a few repeat
    events = {"call": 0}
    history: list[str] = []

    def fail(step: int, what: str) -> str:
        return (f"fuzz seed {seed} on {device}, step {step}: {what}; model {model.names}; "
                f"last events {history[-6:]}; replay: python -m tests.fuzz --seed {seed} "
                f"--device {device} --calls {calls}")

    for step in range(calls):
        event = rng.choices(["call", "new-shape", "update", "replace", "mode", "grad",
                             "dtype"], weights=[70, 6, 6, 4, 5, 5, 2])[0]
        history.append(event)
        events[event] = events.get(event, 0) + 1
        if event == "update":  # an optimizer-like step: in place, same addresses
            with torch.no_grad():
                for m in (model, reference):
                    params = sorted(m.named_parameters())
                    if params:
                        params[step % len(params)][1].mul_(0.9).add_(0.01)
            continue
        if event == "replace":
            _replace_parameter(rng, model, reference)
            continue
        if event == "mode":
            training = rng.random() < 0.5
            model.train(training)
            reference.train(training)
            continue
        if event == "dtype":
            dtype = rng.choice(dtypes_for(device))
            model.to(dtype)
            reference.to(dtype)
            states.clear()
            continue
        if event == "new-shape":
            shapes.append((rng.randint(1, 5), rng.randint(1, 7)))
        b, t = rng.choice(shapes)
        x = torch.randn(b, t, d, device=device, dtype=dtype)
        if b not in states:
            s0 = torch.randn(b, d, device=device, dtype=dtype)
            states[b] = (s0.clone(), s0.clone())
        state, ref_state = states[b]
        grad = event == "grad" and rng.random() < 0.7
        with torch.set_grad_enabled(grad):
            if rng.random() < 0.2:  # keyword arguments take the general path
                got, error = _attempt(lambda a, b: fast(a, state=b), x, state)
            else:
                got, error = _attempt(fast, x, state)
            expect, ref_error = _attempt(reference, x.clone(), ref_state)
        if error or ref_error:  # e.g. training batch norm over one value: both must raise
            assert type(error) is type(ref_error) and str(error) == str(ref_error), \
                fail(step, f"graphed raised {error!r}, eager raised {ref_error!r}")
            continue
        tol = TOLERANCE[dtype]
        _close(got, expect, tol, fail(step, f"output of call {b}x{t} {dtype}"))
        _close(state, ref_state, tol, fail(step, "the input written in place"))
        for (name, a), (_, e) in zip(model.state_dict().items(),
                                     reference.state_dict().items()):
            _close(a, e, tol, fail(step, f"module state {name}"))
    stats = autograph.stats(model if style == "region" else fast)
    assert stats["calls"] == stats["replays"] + stats["captures"] + stats["eager"], stats
    return {"replays": stats["replays"], "captures": stats["captures"],
            "eager": stats["eager"], "calls": stats["calls"]}


def _attempt(fn: Callable[..., Any], *args: Any) -> tuple[Any, Exception | None]:
    try:
        return fn(*args), None
    except Exception as exc:  # noqa: BLE001 - compared with what eager raises
        return None, exc


def _replace_parameter(rng: random.Random, model: nn.Module, reference: nn.Module) -> None:
    """A new tensor for one parameter, the same in both models, by ``.data`` or by a new
    ``nn.Parameter``."""
    names = sorted(n for n, _ in model.named_parameters())
    if not names:
        return
    name = rng.choice(names)
    owner_name, _, attr = name.rpartition(".")
    fresh = torch.randn_like(model.get_parameter(name)) * 0.1
    by_data = rng.random() < 0.5
    for m in (model, reference):
        owner = m.get_submodule(owner_name) if owner_name else m
        if by_data:
            getattr(owner, attr).data = fresh.clone()
        else:
            setattr(owner, attr, nn.Parameter(fresh.clone()))


def _close(a: Any, b: Any, tol: float, message: str) -> None:
    torch.testing.assert_close(a.detach(), b.detach(), rtol=tol, atol=tol, msg=message)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seed", type=int, nargs="+", default=[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--calls", type=int, default=60)
    args = parser.parse_args()
    if args.device == "cpu":  # graph CPU tensors through the test stand-in
        from autograph.capture import use_backend

        from .standin import StandinBackend

        use_backend(StandinBackend())
    for seed in args.seed:
        print(seed, run(seed, args.device, args.calls))


if __name__ == "__main__":
    main()
