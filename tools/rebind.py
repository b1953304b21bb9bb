"""Rebinding a graph to moved parameters (issue 16): is CUDA's graph exec update faster
than a recapture, and exact?

When parameters are replaced by tensors of the same shape (a checkpoint loaded by
assignment, ``model.half()`` round trips, swapped adapters), a graph must stop reading
the old addresses.  autograph captures again.  The alternative measured here: capture
the new graph without instantiating it (``CUDAGraph(keep_graph=True)``) and update the
old instantiated graph to it (``cuGraphExecUpdate``, driver API, through the raw
handles torch exposes), saving the instantiation.  It cannot save the capture itself:
the new addresses are only known by running the Python again under capture.

Prints the median milliseconds of each phase on the GPT-2-small-shaped decode step
(fp16, batch 1) and whether the updated graph's output equals eager's with the new
parameters.  Needs CUDA (and torch's ``keep_graph``/``raw_cuda_graph*``).

    PYTHONPATH=. python tools/rebind.py
"""

import ctypes
import statistics
import time

import torch

from autograph.cli.models import Decoder


def _handle(h):
    """An int from what ``raw_cuda_graph*`` returns (an int, or a capsule)."""
    if isinstance(h, int):
        return h
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    return get(h, None)


def _exec_update():
    cuda = ctypes.CDLL("libcuda.so.1")
    fn = cuda.cuGraphExecUpdate_v2
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    info = ctypes.create_string_buffer(64)  # CUgraphExecUpdateResultInfo
    return lambda exec_, graph: fn(exec_, graph, info)


def _capture(fn, pool, stream, keep):
    g = torch.cuda.CUDAGraph(keep_graph=keep) if keep else torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.cuda.graph(g, pool=pool, stream=stream):
        out = fn()
    torch.cuda.synchronize()
    return g, out, time.perf_counter() - start


def main(rounds=5):
    torch.manual_seed(0)
    model = Decoder().cuda().half().eval()
    k, v = model.new_cache(1)
    tokens = torch.zeros(1, 1, dtype=torch.long, device="cuda")
    pos = torch.tensor([3], device="cuda")

    def step():
        return model(tokens, pos, k, v)

    update = _exec_update()
    pool = torch.cuda.graph_pool_handle()
    stream = torch.cuda.Stream()
    times = {"capture + instantiate": [], "capture only": [], "instantiate": [],
             "exec update": []}
    exact, codes = [], []
    with torch.no_grad():
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(stream)
        held = []
        for _ in range(rounds):
            a, _, t = _capture(step, pool, stream, keep=False)
            times["capture + instantiate"].append(t)
            b, _, t = _capture(step, pool, stream, keep=True)
            times["capture only"].append(t)
            start = time.perf_counter()
            b.instantiate()
            torch.cuda.synchronize()
            times["instantiate"].append(time.perf_counter() - start)
            for p in model.parameters():  # every parameter at a new address
                p.data = p.data.clone()
            c, out_c, _ = _capture(step, pool, stream, keep=True)
            start = time.perf_counter()
            code = update(_handle(a.raw_cuda_graph_exec()), _handle(c.raw_cuda_graph()))
            torch.cuda.synchronize()
            times["exec update"].append(time.perf_counter() - start)
            codes.append(code)
            if code == 0:
                for p in model.parameters():
                    p.data.mul_(1.01)  # new values at the new addresses
                a.replay()  # the old instantiated graph, now on c's addresses
                torch.cuda.synchronize()
                exact.append(bool(torch.equal(out_c, step())))
            held += [a, b, c]
    print("rebinding by graph exec update (decode step, GPT-2 small fp16, batch 1, CUDA):")
    for name, ts in times.items():
        print(f"  {name:<22} {statistics.median(ts) * 1e3:8.2f} ms")
    print(f"  cuGraphExecUpdate results {codes}; updated graph equal to eager: {exact}")


if __name__ == "__main__":
    main()
