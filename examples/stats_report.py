"""What autograph did, and why: stats(), report() and the `autograph` logger.

A small model meets the cases a real service meets: repeated shapes (replayed), a new
shape (captured), calls that must run eagerly (a host sync inside forward), a call
under grad mode (graphed for training) and a weight replaced at run time (graphs
dropped and recaptured).
Each one is counted, and each new reason is logged once at WARNING.

Runs on a GPU (graphs) or on the CPU (autograph falls back to eager and says why).
    python examples/stats_report.py
"""

import logging

import torch
from torch import nn

import autograph


class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(32, 64)
        self.head = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor, check: bool = False) -> torch.Tensor:
        h = torch.relu(self.embed(x))
        if check and h.abs().max().item() > 1e4:  # .item() waits for the GPU: not capturable
            raise ValueError("activations exploded")
        return self.head(h)


def main() -> None:
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("autograph").setLevel(logging.DEBUG)  # DEBUG: one line per capture
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = autograph.graphed(Tagger().to(device).eval())

    with torch.no_grad():
        for _ in range(20):
            model(torch.randn(4, 32, device=device))  # warm up twice, capture, replay
        for _ in range(5):
            model(torch.randn(16, 32, device=device))  # a new shape: its own graph
        for _ in range(3):
            model(torch.randn(4, 32, device=device), check=True)  # a host sync: eager
        model.head.weight = nn.Parameter(torch.randn(8, 64, device=device))  # dropped
        for _ in range(5):
            model(torch.randn(4, 32, device=device))
    model(torch.randn(4, 32, device=device))  # grad mode: a training key (warms up first)

    print()
    autograph.report()
    s = autograph.stats(model)
    assert s["calls"] == s["replays"] + s["captures"] + s["eager"]


if __name__ == "__main__":
    main()
