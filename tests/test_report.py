"""autograph.report() and the Prometheus collector."""

import io

import pytest
import torch
from torch import nn

import autograph

pytestmark = pytest.mark.usefixtures("standin")


def traffic():
    m = nn.Linear(4, 4)
    g = autograph.graphed(m, buckets=[2, 4])
    with torch.no_grad():
        for n in (1, 2, 3, 4, 3, 3, 4, 8):
            g(torch.randn(n, 4))
    return g


def test_report_prints_a_row_per_callable_with_reasons_and_padding():
    g = traffic()
    out = io.StringIO()
    autograph.report(g, file=out)
    text = out.getvalue()
    head, rule, row, *rest = text.splitlines()
    assert "hit rate" in head and "graph MiB" in head and "padding" in head
    s = autograph.stats(g)
    cells = row.split()
    assert cells[1:6] == [str(s["calls"]), str(s["replays"]),
                          f"{100 * s['replays'] / s['calls']:.1f}%", str(s["captures"]),
                          str(s["eager"])]
    assert any("larger than the largest bucket" in line for line in rest)
    assert any(line.strip().startswith("buckets") for line in rest)
    # padding waste: rows padded per real row over the calls served by buckets
    real = sum(b["real_rows"] for b in s["buckets"].values())
    padded = sum(b["padded_rows"] for b in s["buckets"].values())
    assert cells[-1] == f"{100 * padded / real:.1f}%"


def test_report_of_everything_and_of_nothing(capsys):
    traffic()
    autograph.report()
    assert "callable" in capsys.readouterr().out
    from autograph.summary import format_report

    assert "no graphed callables" in format_report({})


def test_prometheus_collector_exposes_the_counters():
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()
    g = traffic()
    autograph.register_prometheus(registry)
    name = g._self_engine.stats.name
    s = autograph.stats(g)
    value = registry.get_sample_value
    assert value("autograph_calls_total", {"callable": name}) == s["calls"]
    assert value("autograph_replays_total", {"callable": name}) == s["replays"]
    assert value("autograph_graphs", {"callable": name}) == s["graphs"]
    reason = "bucket_miss"
    assert value("autograph_eager_total", {"callable": name, "reason": reason}) == 1
    assert value("autograph_bucket_rows_total",
                 {"callable": name, "bucket": "4", "kind": "padded"}) == 3
    text = prometheus_client.generate_latest(registry).decode()
    assert "autograph_graph_memory_bytes" in text


def test_without_prometheus_client_the_error_says_what_to_install(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_prometheus(name, *args, **kwargs):
        if name.startswith("prometheus_client"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_prometheus)
    with pytest.raises(ImportError, match=r"torch-autograph\[prometheus\]"):
        autograph.register_prometheus()


def test_importing_autograph_imports_no_optional_extra():
    import subprocess
    import sys

    code = ("import sys, autograph; "
            "print([m for m in ('prometheus_client', 'matplotlib', 'torch._dynamo') "
            "if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


def test_eager_reasons_are_a_fixed_set_whatever_the_details(standin):
    """Reasons are label values: bounded identifiers; what varies goes to the details."""
    @autograph.graphed(buckets=[2])
    def f(x, extra=None):
        return x * 2

    with torch.no_grad():
        for n in range(3, 9):  # every batch a miss with its own size
            f(torch.randn(n, 2))
        for value in (object(), {1}, object()):  # unkeyable, each its own type
            f(torch.randn(1, 2), value)
    s = autograph.stats(f)
    allowed = {r.value for r in autograph.EagerReason}
    assert set(s["eager_reasons"]) <= allowed, s["eager_reasons"]
    assert s["eager_reasons"]["bucket_miss"] == 5  # the first call learns the arguments
    assert any("set" in d for d in s["eager_details"]["unkeyable_argument"])
