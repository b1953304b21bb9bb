"""The command line: bench and doctor on a machine without CUDA, and the bench's tables."""

import json

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
    err = capsys.readouterr().err
    assert "unknown command 'nope'" in err and "bench" in err and "doctor" in err
    assert main([]) == 0
    assert "usage" in capsys.readouterr().out


def test_bench_json_without_cuda_is_valid_json(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "--json", "-"]) == 0
    captured = capsys.readouterr()
    data = json.loads(captured.out)  # standard output is the JSON alone
    assert data["cuda"] is False and "no CUDA device" in data["reason"]
    assert data["results"] == [] and "torch" in data["environment"]
    assert "no CUDA device" in captured.err
    path = tmp_path / "out.json"
    assert main(["bench", "--json", str(path)]) == 0
    assert json.loads(path.read_text())["cuda"] is False


@pytest.mark.parametrize("args", [["--iters", "-5"], ["--batch", "0"], ["--rounds", "0"],
                                  ["--batch", "1", "x"], ["--width", "100", "--heads", "12"]])
def test_bench_rejects_bad_numbers(args, capsys):
    with pytest.raises(SystemExit) as info:
        main(["bench", *args])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "at least 1" in err or "not an integer" in err or "multiple" in err


def test_help_shows_defaults_and_doctor_help_does_not_run_doctor(capsys):
    with pytest.raises(SystemExit) as info:
        main(["bench", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "(default 200" in out and "(default 15)" in out
    with pytest.raises(SystemExit) as info:
        main(["doctor", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "usage: python -m autograph doctor" in out and "plan fingerprint:" not in out


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


def test_training_bench_pins_a_crash_to_the_methods_it_needs(monkeypatch):
    """When the process timing every method at a batch size dies, each method runs
    again beside eager alone: the rows say which ran, which died, and why."""
    from autograph.cli import bench_train as bt

    calls = []

    def fake(batch, steps, rounds, methods):
        calls.append(list(methods))
        if "torch.compile" in methods:
            return None, 1  # this method (with the others, or beside eager) crashes
        return [bt.TrainRow(batch, m, 1.0 if m == "eager" else 0.5, 1.0, 0.0, "AdamW")
                for m in methods], 0

    monkeypatch.setattr(bt, "_in_process", fake)
    methods = ["eager", "autograph", "torch.compile"]
    rows = bt.bench_train([1, 32], 10, 2, methods)
    assert calls[0] == methods and calls[1] == ["eager", "autograph"]
    assert calls[2] == ["eager", "torch.compile"]
    by = {(r.batch, r.method): r for r in rows}
    assert [r.method for r in rows[:3]] == methods and len(rows) == 6
    assert by[(1, "autograph")].ms_per_step == 0.5
    assert "beside eager alone" in by[(1, "autograph")].note
    assert by[(1, "eager")].ms_per_step == 1.0  # from the pair that ran
    assert by[(1, "torch.compile")].ms_per_step is None
    assert "failed: exited with 1" in by[(1, "torch.compile")].note
    assert "all methods in one process exited with 1" in by[(1, "torch.compile")].note
    assert "timed beside" in bt.format_train(rows)


def test_bench_json_into_a_missing_folder_is_refused_before_the_run(capsys, tmp_path):
    """``--json`` into a folder that does not exist failed with a traceback after the
    run (its results lost); it is refused at once."""
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--json", str(tmp_path / "missing" / "out.json")])
    assert exc.value.code == 2
    assert "folder does not exist" in capsys.readouterr().err
