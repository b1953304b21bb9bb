"""The command line: bench and doctor on a machine without CUDA, and the bench's tables."""

import pytest
import torch

from autograph.cli import main
from autograph.cli.bench import Result, format_table, plot


def test_bench_without_cuda_says_so_and_exits_0(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench"]) == 0
    assert "no CUDA device" in capsys.readouterr().out


def test_doctor_without_cuda_explains_eager_and_fails(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("AUTOGRAPH_DISABLE", raising=False)
    assert main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "eagerly" in out and "torch:" in out and "plan fingerprint" in out


def test_doctor_reports_the_kill_switch(capsys, monkeypatch):
    monkeypatch.setenv("AUTOGRAPH_DISABLE", "1")
    assert main(["doctor"]) == 1
    assert "kill switch is set" in capsys.readouterr().out


def test_unknown_command_is_an_error(capsys):
    assert main(["nope"]) == 2
    assert main([]) == 0


RESULTS = [
    Result("decode B=1", 1, "eager", 5000.0, 40.0),
    Result("decode B=1", 1, "hand-graph", 1000.0, 300.0),
    Result("decode B=1", 1, "autograph", 1010.0, 350.0),
    Result("decode B=1", 1, "torch.compile", 3000.0, 20000.0, "inductor skipped CUDA graphs"),
    Result("decode B=1", 1, "make_graphed_callables", None, None, "failed: RuntimeError: x"),
    Result("decode B=8", 8, "eager", 6000.0, 40.0),
    Result("decode B=8", 8, "autograph", 1200.0, 350.0),
]


def test_table_shows_ratios_first_calls_and_notes():
    table = format_table(RESULTS)
    line = next(ln for ln in table.splitlines() if "B=1" in ln and "autograph" in ln)
    assert "4.95x" in line and "1.010x" in line and "10.0" in line and "350.0" in line
    assert "inductor skipped" in table and "failed: RuntimeError" in table
    # a method without a time, and a workload without a hand-written graph, print dashes
    assert next(ln for ln in table.splitlines() if "make_graphed" in ln).split()[3] == "-"


def test_plot_draws_decode_latency_per_batch(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "bench.png"
    plot(RESULTS, str(path), "test")
    assert path.stat().st_size > 1000
