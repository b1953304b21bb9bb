"""What an invalidation costs until the next replay: a graph dropped because its
parameters moved (``model.half()``, ``.data =``, ``load_state_dict(assign=True)``) is
captured again at once, without warming up; one dropped by an attribute assignment
warms up again first (``warmup=2``).

Prints, per case, the milliseconds from the invalidation to the end of the first
replayed call (the calls in between: warmups and the capture), the calls that took,
and autograph's own capture time (``capture_seconds``), median of several rounds.  On
a GPU: the GPT-2-small-shaped decode step of ``autograph bench`` (fp16, batch 1);
without one: a smaller decoder on the CPU stand-in of the test suite (its "graphs"
re-run the recorded operators, so only the comparison between the rows means
something).

    PYTHONPATH=. python tools/recapture.py
"""

import statistics
import time

import torch

import autograph
from autograph.cli.models import Decoder


def main(rounds=5):
    cuda = torch.cuda.is_available()
    if not cuda:
        from autograph.capture import use_backend
        from tests.standin import StandinBackend

        use_backend(StandinBackend())
    device = "cuda" if cuda else "cpu"
    torch.manual_seed(0)
    shape = {} if cuda else {"layers": 2, "d": 128, "heads": 4}
    model = Decoder(**shape).to(device).eval()
    if cuda:
        model = model.half()
    cache = model.new_cache(1)
    step = autograph.graphed(model, warmup=2)
    tokens = torch.zeros(1, 1, dtype=torch.long, device=device)

    def call(i):
        return step(tokens, torch.tensor([i % 64], device=device), *cache)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def moved():  # every parameter at a new address, same values
        for p in model.parameters():
            p.data = p.data.clone()

    def assigned():  # an attribute assignment: what the forward decides on may change
        model.note = getattr(model, "note", 0) + 1

    results = {}
    with torch.no_grad():
        for i in range(4):
            call(i)
        for name, invalidate in (("parameters moved", moved), ("attribute assigned", assigned)):
            times, calls, captures = [], [], []
            for r in range(rounds):
                invalidate()
                s = autograph.stats(step)
                replays, seconds = s["replays"], s["capture_seconds"]
                sync()
                start = time.perf_counter()
                n = 0
                while autograph.stats(step)["replays"] == replays:
                    call(r + n)
                    n += 1
                sync()
                times.append(time.perf_counter() - start)
                calls.append(n)
                captures.append(autograph.stats(step)["capture_seconds"] - seconds)
            results[name] = (statistics.median(times), max(calls), statistics.median(captures))
    where = "CUDA" if cuda else "CPU stand-in"
    print(f"recapture after an invalidation ({where}, decoder {shape or 'GPT-2 small fp16'}):")
    for name, (seconds, n, capture) in results.items():
        print(f"  {name:<20} {seconds * 1e3:8.1f} ms to the first replay, {n} calls "
              f"(capture itself {capture * 1e3:.1f} ms)")
    s = autograph.stats(step)
    print(f"  captures {s['captures']}, warmups {s['eager_reasons'].get('warmup', 0)}, "
          f"invalidations {s['invalidations']}")


if __name__ == "__main__":
    main()
