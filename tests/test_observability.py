"""Profiler ranges and logging: what a user sees in traces and on the autograph logger."""

import logging

import pytest
import torch
from torch import nn

import autograph

pytestmark = pytest.mark.usefixtures("standin")


def test_warmup_capture_replay_and_eager_are_named_in_profiler_traces():
    m = nn.Linear(4, 4)
    g = autograph.graphed(m, backward=False)
    with torch.no_grad(), torch.profiler.profile(activities=[
            torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(4):
            g(torch.randn(2, 4))
        with torch.enable_grad():
            g(torch.randn(2, 4))  # autograd would record: eager
    name = g._self_engine.stats.name  # "Linear", or "Linear#N" beside other Linears
    names = [e.name for e in prof.events()]
    for what in ("warmup", "capture", "replay", "eager"):
        assert f"autograph.{what} {name}" in names, what
    assert names.count(f"autograph.replay {name}") == 1
    assert names.count(f"autograph.warmup {name}") == 2


def test_no_ranges_without_a_profiler(monkeypatch):
    entered = []
    monkeypatch.setattr("autograph.dispatch.record_function",
                        lambda name: entered.append(name) or torch.autograd.profiler
                        .record_function(name))
    g = autograph.graphed(nn.Linear(4, 4))
    with torch.no_grad():
        for _ in range(4):
            g(torch.randn(2, 4))
    assert entered == []


def test_logging_one_debug_line_per_capture_one_warning_per_reason(caplog):
    g = autograph.graphed(nn.Linear(4, 4), backward=False)
    caplog.set_level(logging.DEBUG, logger="autograph")
    with torch.no_grad():
        for _ in range(6):
            g(torch.randn(2, 4))
    for _ in range(3):
        g(torch.randn(2, 4))  # grad mode with parameters requiring grad: eager
    records = [r for r in caplog.records if r.name == "autograph"]
    captures = [r for r in records if "captured" in r.getMessage()]
    assert len(captures) == 1 and captures[0].levelno == logging.DEBUG
    assert "(f32[2, 4])" in captures[0].getMessage()
    warnings = [r for r in records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "autograd" in warnings[0].getMessage()
    assert len(records) == 2  # nothing per replay
