"""A torchvision-style CNN served with shape buckets: requests arrive with a random batch
size in 1..16; each is padded up to the next bucket of [1, 2, 4, 8, 16], replayed, and
sliced back.  Five graphs serve every size.

Runs on a GPU (graphs) or on the CPU (autograph falls back to eager and says why).
    python examples/vision_buckets.py [--requests 300] [--size 64]
"""

import argparse
import time

import torch
from torch import nn

import autograph


class Block(nn.Module):
    """A ResNet basic block (conv-bn-relu, conv-bn, shortcut), random weights."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                    nn.BatchNorm2d(cout)) if stride != 1 or cin != cout
                      else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.short(x))


def resnet(classes: int = 1000) -> nn.Module:
    """A small ResNet-18-shaped network (one block per stage)."""
    return nn.Sequential(
        nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
        nn.MaxPool2d(3, 2, 1),
        Block(64, 64, 1), Block(64, 128, 2), Block(128, 256, 2), Block(256, 512, 2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, classes),
    )


def serve(model, images, order):
    return [model(images[n]) for n in order]


def speedup(eager_s, graphed_s, replays):
    """The ratio, or why there is none: without replayed graphs both runs were eager."""
    if not replays:
        return "no speedup to report: nothing was graphed here, both runs were eager"
    return f"{eager_s / graphed_s:.1f}x"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--size", type=int, default=64, help="image height and width")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = resnet().to(device).eval()  # eval: batch norm uses its running statistics
    fast = autograph.graphed(model, buckets=[1, 2, 4, 8, 16])
    images = {n: torch.randn(n, 3, args.size, args.size, device=device) for n in range(1, 17)}
    order = torch.randint(1, 17, (args.requests,), generator=torch.Generator().manual_seed(0))
    order = [int(n) for n in order]

    with torch.inference_mode():
        serve(fast, images, range(1, 17))  # warm up (the small buckets, called once or
        # twice here, finish warming up in the timed run)
        serve(fast, images, range(16, 0, -1))
        timings = {}
        for name, m in (("eager", model), ("autograph", fast)):
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            outs = serve(m, images, order)
            if device == "cuda":
                torch.cuda.synchronize()
            timings[name] = (time.perf_counter() - start) / len(order)
            if name == "eager":
                reference = outs
        for got, expect in zip(outs, reference):
            torch.testing.assert_close(got, expect, rtol=2e-3, atol=2e-3)

    s = autograph.stats(fast)
    print(f"device {device}: {len(order)} requests, batch 1..16, {s['graphs']} graphs")
    for name, seconds in timings.items():
        print(f"  {name:<10} {seconds * 1e3:7.2f} ms/request")
    print(f"  speedup    {speedup(timings['eager'], timings['autograph'], s['replays'])}; "
          f"outputs equal eager")
    if s["replays"] == 0:
        print(f"  (no graphs here: {dict(s['eager_reasons'])})")
    autograph.report(fast)


if __name__ == "__main__":
    main()
