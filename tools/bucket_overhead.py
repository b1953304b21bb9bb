"""Host microseconds the bucketing layer adds to a call, on a null-replay backend.

A 4-layer 256-wide MLP (as in ``python -m autograph bench``) graphed plainly and with
``buckets=[8]``, called at batch 8 (plain, exact) and 7 (padded), on the CPU stand-in
with a graph whose replay does nothing: what remains is autograph's own Python (the
outputs are not the model's values).  ``--profile`` prints a cProfile of each call.

    PYTHONPATH=. python tools/bucket_overhead.py [--profile]
"""

import cProfile
import pstats
import sys

import torch
from timing import best  # tools/timing.py (tools run as scripts)

import autograph
from autograph.capture import use_backend

sys.path.insert(0, ".")
from tests.standin import NullBackend  # noqa: E402


def main():
    use_backend(NullBackend())
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [torch.nn.Linear(256, 256), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers).eval()
    plain = autograph.graphed(model)
    bucketed = autograph.graphed(model, buckets=[8])
    x8, x7 = torch.randn(8, 256), torch.randn(7, 256)
    calls = {"plain graphed (8 rows)": lambda: plain(x8),
             "bucketed exact (8 rows)": lambda: bucketed(x8),
             "bucketed padded (7 rows)": lambda: bucketed(x7)}
    times: dict[str, float] = {}
    with torch.no_grad():
        for call in calls.values():
            for _ in range(6):
                call()
        for _ in range(3):
            for name, call in calls.items():
                times[name] = min(times.get(name, float("inf")), best(call, 3000))
        if "--profile" in sys.argv:
            for name, call in calls.items():
                print("==", name)
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(3000):
                    call()
                prof.disable()
                pstats.Stats(prof).sort_stats("tottime").print_stats(14)
    base = times["plain graphed (8 rows)"]
    exact = times["bucketed exact (8 rows)"]
    for name, t in times.items():
        print(f"{name:<26} {t:6.2f} us  ({t - base:+.2f} over plain, {t - exact:+.2f} over exact)")
    s = autograph.stats(bucketed)
    print("bucketed: graphs", s["graphs"], "replays", s["replays"], "padding", s["padding"])


if __name__ == "__main__":
    main()
