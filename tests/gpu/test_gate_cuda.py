"""min_speedup with real CUDA graphs: launch-bound work keeps its graph, GPU-bound work
(a long prefill) runs eagerly.  Skipped without CUDA."""

import pytest
import torch
from torch import nn

import autograph
from autograph.cli.models import mlp
from autograph.gate import TRIALS

NOT_WORTH = autograph.EagerReason.NOT_WORTH.value

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_launch_bound_graph_is_kept_and_gpu_bound_one_is_not():
    torch.manual_seed(0)
    small = mlp(256, 4).cuda().eval()  # ~10 tiny kernels: the graph is several times faster
    big = nn.Linear(8192, 8192).cuda().eval()  # one long GEMM: nothing to save

    def step(x):
        return small(x) if x.shape[-1] == 256 else big(x)

    g = autograph.graphed(step, min_speedup=1.5)
    with torch.no_grad():
        for _ in range(3 + TRIALS + 3):
            for x in (torch.randn(1, 256, device="cuda"), torch.randn(4096, 8192, device="cuda")):
                torch.testing.assert_close(g(x), step(x), rtol=1e-3, atol=1e-3)
    s = autograph.stats(g)
    assert s["graphs"] == 1, s
    assert s["eager_reasons"][NOT_WORTH] == 3, s
    entries = g._self_dispatch.handle.engine.cache.entries.values()
    (entry,) = [e for e in entries if e.speedup is not None
                and e.speedup >= 1.5]
    assert entry.graph is not None
