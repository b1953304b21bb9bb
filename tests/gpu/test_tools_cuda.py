"""doctor, profiler ranges and parameter guards on a real GPU.  Skipped without CUDA."""

import pytest
import torch
from torch import nn

import autograph
from autograph.cli.doctor import main as doctor

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_doctor_passes_on_a_working_gpu(capsys, monkeypatch):
    monkeypatch.delenv("AUTOGRAPH_DISABLE", raising=False)
    assert doctor([]) == 0
    out = capsys.readouterr().out
    assert "tiny capture and replay:" in out and "works" in out and "sm_" in out


def test_replays_are_named_in_cuda_profiler_traces():
    g = autograph.graphed(nn.Linear(64, 64).cuda())
    x = torch.randn(8, 64, device="cuda")
    with torch.no_grad():
        for _ in range(3):
            g(x)
        with torch.profiler.profile() as prof:
            for _ in range(5):
                g(x)
            torch.cuda.synchronize()
    name = g._self_engine.stats.name
    cpu = [e for e in prof.events() if e.name == f"autograph.replay {name}"
           and e.device_type == torch.autograd.DeviceType.CPU]
    assert len(cpu) == 5  # (the GPU timeline shows the same ranges as annotations)



def test_parameters_moved_without_setattr_are_seen_on_the_gpu():
    m = nn.Linear(16, 16).cuda().eval()
    g = autograph.graphed(m)
    x = torch.randn(4, 16, device="cuda")
    with torch.no_grad():
        for _ in range(3):
            g(x)
        m.weight.data = torch.randn(16, 16, device="cuda")
        torch.testing.assert_close(g(x), m(x))
        m._parameters["bias"] = nn.Parameter(torch.randn(16, device="cuda"))
        for _ in range(3):
            torch.testing.assert_close(g(x), m(x))
    assert autograph.stats(g)["invalidations"] == 2
