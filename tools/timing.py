"""Timing shared by the tools: best-of-N microseconds per call, device synchronized."""

import time

import torch


def best(fn, n=20000, rounds=7):
    """Best per-call microseconds over ``rounds`` loops of ``n`` calls."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    times = []
    for _ in range(rounds):
        sync()
        start = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        times.append((time.perf_counter() - start) / n * 1e6)
    return min(times)
