"""Timing shared by the tools: best-of-N microseconds per call, device synchronized."""

import time

import torch


def best(fn, n=20000, rounds=7, clock=time.perf_counter):
    """Best per-call microseconds over ``rounds`` loops of ``n`` calls (``clock``:
    ``time.thread_time`` counts this thread's CPU time only, steadier on a loaded
    machine)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    times = []
    for _ in range(rounds):
        sync()
        start = clock()
        for _ in range(n):
            fn()
        sync()
        times.append((clock() - start) / n * 1e6)
    return min(times)
