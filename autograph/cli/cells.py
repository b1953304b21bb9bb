"""Table cells shared by the benchmark's tables: a number or a dash, a ratio or a dash."""

from __future__ import annotations


def num(value: float | None, spec: str) -> str:
    """``value`` formatted by ``spec`` (e.g. ``"9.1f"``), or a dash as wide."""
    width = int(spec.split(".")[0])
    return f"{value:{spec}}" if value is not None else f"{'-':>{width}}"


def ratio(a: float | None, b: float | None, digits: int = 2) -> str:
    """``a / b`` as ``"1.23x"``, or a dash where either is missing or zero."""
    return f"{a / b:.{digits}f}x" if a and b else "-"
