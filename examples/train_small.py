"""A small classifier trained three times from the same seed: eagerly, through autograph
(forward and backward graphs, ``graphed(model)``'s default ``backward=True``), and with
the whole step graphed (``graphed(train_step)``: forward, backward and a ``capturable``
AdamW step in one graph).  Prints the runs' losses, checks they agree, and the time per
optimizer step.

Runs on a GPU (graphs) or on the CPU (autograph falls back to eager and says why).
    python examples/train_small.py [--steps 200] [--batch 32] [--width 256]
"""

import argparse
import copy
import time

import torch
from torch import nn

import autograph


def classifier(width: int, classes: int = 10) -> nn.Module:
    return nn.Sequential(nn.Linear(64, width), nn.GELU(), nn.LayerNorm(width),
                         nn.Linear(width, width), nn.GELU(), nn.Dropout(0.0),
                         nn.Linear(width, classes))


def train(model: nn.Module, data: list, device: str) -> tuple[list[float], float]:
    """AdamW over ``data``; returns the losses and the seconds per step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    if device == "cuda":
        torch.cuda.synchronize()
    return [float(v) for v in losses], (time.perf_counter() - start) / len(data)


def train_whole_step(model: nn.Module, data: list, device: str) -> tuple[list[float], float, dict]:
    """The same training with the whole step graphed; also returns its stats."""
    # capturable: the optimizer's step count stays on the device, so a graph can hold it
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=device == "cuda")

    @autograph.graphed
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    losses = []
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for x, y in data:
        losses.append(train_step(x, y))
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / len(data)
    return [float(v) for v in losses], seconds, autograph.stats(train_step)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    eager = classifier(args.width).to(device).train()
    model = copy.deepcopy(eager)
    fast = autograph.graphed(model)
    g = torch.Generator(device=device).manual_seed(1)
    data = [(torch.randn(args.batch, 64, device=device, generator=g),
             torch.randint(0, 10, (args.batch,), device=device, generator=g))
            for _ in range(args.steps)]

    whole = copy.deepcopy(eager)
    want, eager_s = train(eager, data, device)
    got, fast_s = train(fast, data, device)
    stepped, step_s, step_stats = train_whole_step(whole, data, device)
    worst = max(abs(a - b) for a, b in zip(want, got))
    worst_step = max(abs(a - b) for a, b in zip(want, stepped))
    print(f"losses: first {want[0]:.4f}, last eager {want[-1]:.4f}, "
          f"last autograph {got[-1]:.4f} (largest difference {worst:.3g}), "
          f"last whole step {stepped[-1]:.4f} (largest difference {worst_step:.3g})")
    assert worst <= 1e-4, "autograph's training diverged from eager"
    assert worst_step <= 1e-4, "the graphed whole step diverged from eager"
    s = autograph.stats(fast)
    print(f"eager {eager_s * 1e3:.3f} ms/step, autograph {fast_s * 1e3:.3f} ms/step "
          f"(forward replays {s['replays']}, backward replays {s['backward_replays']}), "
          f"whole step {step_s * 1e3:.3f} ms/step (replays {step_stats['replays']})")
    if not s["replays"] and not step_stats["replays"]:
        print("no speedup to report: nothing was graphed here, every run was eager "
              f"({', '.join(s['eager_reasons'])})")
    else:
        print(f"speedup {eager_s / fast_s:.2f}x, whole step {eager_s / step_s:.2f}x")


if __name__ == "__main__":
    main()
