"""The command line, ``python -m autograph bench`` and ``python -m autograph doctor``.

The runtime never imports this subpackage (nor the benchmark models in it)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {
        "bench": "autograph against eager, a hand-written graph, torch.compile and "
                 "make_graphed_callables",
        "doctor": "will autograph work here? versions, GPU, kill switch, a tiny capture",
    }
    if not argv or argv[0] not in commands:
        print("usage: python -m autograph COMMAND [options]\n\ncommands:")
        for name, text in commands.items():
            print(f"  {name:<8} {text}")
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    if argv[0] == "doctor":
        from . import doctor

        return doctor.main(argv[1:])
    from . import bench

    return bench.main(argv[1:])

