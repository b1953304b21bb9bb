"""What handing an output out costs on this host, piece by piece (issues 16 and 17):
a clone (what the default mode's training graphs do per call), an alias (``reuse``),
a copy into a buffer kept from call to call, a one-node graph copying into such a
buffer, and the per-call checks of the replay path (the modes tuple against torch's
``GlobalStateGuard``).  Best of 7 loops, µs per call.  Needs CUDA for its figures
(on the CPU it times the same pieces without a device).

    PYTHONPATH=. python tools/handout.py
"""

import time

import torch
from timing import best  # tools/timing.py (tools run as scripts)

from autograph import modes


def copy_graph(out, buf):
    """A CUDA graph of one node: ``buf.copy_(out)`` (warmed up on a side stream)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        buf.copy_(out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        buf.copy_(out)
    return graph


def main():
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    out = torch.randn(1, 16, device=device)
    buf = torch.empty_like(out)
    rows = {"clone": out.clone, "detach": out.detach,
            "copy_ into a kept buffer + detach": lambda: (buf.copy_(out), buf.detach()),
            "copy_ into a kept buffer": lambda: buf.copy_(out)}
    if cuda:
        graph = copy_graph(out, buf)
        rows["copy graph replay"] = graph.replay
        rows["copy graph replay + detach"] = lambda: (graph.replay(), buf.detach())
    read = modes.reader(torch.device(device))
    rows["modes tuple"] = read
    state = getattr(getattr(torch._C, "_dynamo", None), "guards", None)
    if state is not None and hasattr(state, "GlobalStateGuard"):
        guard = state.GlobalStateGuard()
        rows["GlobalStateGuard.check"] = guard.check
    rows["grad mode"] = torch.is_grad_enabled
    for name, fn in rows.items():
        print(f"{name:<36} {best(fn, n=20000, clock=time.perf_counter):7.2f} us", flush=True)


if __name__ == "__main__":
    main()
