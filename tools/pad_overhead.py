"""What padding a call up to its bucket costs, against an exact-size replay.

Prints best-of-7 microseconds per call of a graphed step called at a bucket's size
(exact) and one row short of it (padded), for a one-argument function and a decode
step with three batch arguments and a cache written in place.  On a GPU it uses CUDA
graphs; without one, the CPU stand-in of the test suite (its replays re-run the
recorded operators, so only the difference between the rows means something).

    PYTHONPATH=. python tools/pad_overhead.py
"""

import torch
from timing import best  # tools/timing.py (tools run as scripts)

import autograph

BUCKET = 8


def main():
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    if not cuda:
        from autograph.capture import use_backend
        from tests.standin import StandinBackend

        use_backend(StandinBackend())
    n = 2000 if cuda else 3000

    @autograph.graphed(buckets=[BUCKET], warmup=1)
    def one(x):
        return x * 2

    cache = torch.zeros(BUCKET + 1, 4, 16, device=device)

    @autograph.graphed(buckets=[BUCKET], warmup=1, pad_values={"slots": BUCKET},
                       **({"pad_writes": {"cache": (0, BUCKET)}} if _has_pad_writes() else {}))
    def step(x, slots, pos, cache):
        cache[slots, pos] = x
        return x * 2

    def args(rows):
        return (torch.randn(rows, 16, device=device),
                torch.arange(rows, device=device), torch.zeros(rows, dtype=torch.long,
                                                                device=device))

    times: dict[str, float] = {}
    with torch.no_grad():
        calls = {}
        for rows in (BUCKET, BUCKET - 1):
            what = "exact " if rows == BUCKET else "padded"
            x1 = torch.randn(rows, 16, device=device)
            x, slots, pos = args(rows)
            for _ in range(4):
                one(x1)
                step(x, slots, pos, cache)
            calls[f"one argument, {what} ({rows} rows)"] = lambda x1=x1: one(x1)
            calls[f"decode step,  {what} ({rows} rows)"] = (
                lambda x=x, slots=slots, pos=pos: step(x, slots, pos, cache))
        for _ in range(3):  # interleaved, best of all: a shared machine is noisy
            for name, call in calls.items():
                times[name] = min(times.get(name, float("inf")), best(call, n))
    for name in sorted(times):
        print(f"{name}: {times[name]:7.2f} us")
    for f in (one, step):
        s = autograph.stats(f)
        print(f.__name__, "graphs", s["graphs"], "replays", s["replays"], "padding", s["padding"])
    fill_costs(device, n)


def fill_costs(device, n):
    """Copying 7 real rows into a bucket-8 buffer: padded rows refilled only when dirty
    (what padslots does) against refilling them on every call."""
    try:
        from autograph import padslots
    except ImportError:  # before persistent buffers
        return
    for width in (16, 4096):
        x = torch.randn(BUCKET - 1, width, device=device)
        batch = [(0, x, 0)]
        slot = padslots.PadSlots().slot(batch, BUCKET, BUCKET - 1, lambda b: [0])
        pad_rows = slot.buffers.tensors[0].narrow(0, BUCKET - 1, 1)

        def every(slot=slot, x=x, pad_rows=pad_rows):
            padslots.fill(slot, [x])
            pad_rows.fill_(0)

        lazy = min(best(lambda s=slot, b=[x]: padslots.fill(s, b), n) for _ in range(3))
        always = min(best(every, n) for _ in range(3))
        print(f"fill 7 of 8 rows of width {width}: pad rows kept {lazy:6.2f} us, "
              f"rewritten every call {always:6.2f} us")


def _has_pad_writes():
    import inspect

    return "pad_writes" in inspect.signature(autograph.graphed).parameters


if __name__ == "__main__":
    main()
