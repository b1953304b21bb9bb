"""Options of ``autograph.graphed``, validated once when the wrapper is made."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Options:
    """How one graphed callable warms up, captures and bounds its graphs.

    warmup: eager runs of a new key before it is captured (on the capture stream), so
        lazy initialisation (cuBLAS handles, autotuning, workspaces) happens outside
        the capture.
    max_graphs: live graphs kept per callable; past it the least recently used go.
    """

    warmup: int = 2
    max_graphs: int = 32

    def __post_init__(self) -> None:
        if not isinstance(self.warmup, int) or isinstance(self.warmup, bool) or self.warmup < 0:
            raise ValueError(f"autograph: warmup must be an int >= 0, got {self.warmup!r}")
        if (
            not isinstance(self.max_graphs, int)
            or isinstance(self.max_graphs, bool)
            or self.max_graphs < 1
        ):
            raise ValueError(
                f"autograph: max_graphs must be an int >= 1, got {self.max_graphs!r}"
            )
