"""Calls from several threads are correct and get separate outputs."""

import threading

import pytest
import torch
from torch import nn

import autograph

pytestmark = pytest.mark.usefixtures("standin")


def test_many_threads_one_module_several_shapes():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8))
    g = autograph.graphed(model, warmup=1)
    errors = []
    outputs = {}

    def worker(tid):
        gen = torch.Generator().manual_seed(tid)
        try:
            with torch.no_grad():
                for step in range(25):
                    x = torch.randn(1 + (tid + step) % 3, 8, generator=gen)
                    out = g(x)
                    outputs[(tid, step)] = (x, out)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    with torch.no_grad():
        for x, out in outputs.values():
            torch.testing.assert_close(out, model(x))
    ptrs = {out.data_ptr() for _, out in outputs.values()}
    assert len(ptrs) == len(outputs)  # nobody shares an output buffer
    s = autograph.stats(g)
    assert s["calls"] == 200 and s["graphs"] == 3 and s["replays"] > 150
