"""What a call that ends up eager costs over the plain call (issue 13's cheap eager paths).

Times a ``Linear(64, 64)`` at batch 1 on the GPU (CPU without CUDA): plain, graphed under
grad mode with ``backward=False`` (autograd would record: eager), inside
``autograph.disabled()``, and after the callable gave up (keys that never repeat).  Best of
7 loops, microseconds per call.  For comparison, the same grad-mode call with training
graphs (the default ``backward=True``: a forward replay whose outputs are never
backpropagated).

    PYTHONPATH=. python tools/eager_cost.py
"""

import torch
from timing import best  # tools/timing.py (tools run as scripts)

import autograph
from autograph.dispatch import GIVE_UP_FRESH_KEYS


def main():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    plain = torch.nn.Linear(64, 64).to(device)
    graphed = autograph.graphed(torch.nn.Linear(64, 64).to(device), backward=False)
    trains = autograph.graphed(torch.nn.Linear(64, 64).to(device))
    x = torch.randn(1, 64, device=device)
    grad = best(lambda: plain(x))
    rows = [("graphed, grad mode (eager)", best(lambda: graphed(x)), grad),
            ("grad mode, backward=True", best(lambda: trains(x)), grad)]
    with autograph.disabled():
        rows.append(("graphed, inside disabled()", best(lambda: graphed(x)), grad))
    gave_up = autograph.graphed(torch.nn.Linear(64, 64).to(device))
    with torch.no_grad():
        for n in range(1, GIVE_UP_FRESH_KEYS + 2):
            gave_up(torch.randn(n, 64, device=device))
        no_grad = best(lambda: plain(x))
        rows.append(("graphed, given up (no_grad)", best(lambda: gave_up(x)), no_grad))
    print(f"plain Linear(64, 64): {grad:.2f} us in grad mode, {no_grad:.2f} us under no_grad")
    for name, us, base in rows:
        print(f"{name:<32} {us:7.2f} us  ({us - base:+.2f} over the plain call)")


if __name__ == "__main__":
    main()
