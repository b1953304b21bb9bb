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
        asked = not argv or argv[0] in ("-h", "--help")
        out = sys.stdout if asked else sys.stderr
        if not asked:
            print(f"python -m autograph: unknown command {argv[0]!r} "
                  f"(choose from {', '.join(commands)})\n", file=out)
        print("usage: python -m autograph COMMAND [options]\n\ncommands:", file=out)
        for name, text in commands.items():
            print(f"  {name:<8} {text}", file=out)
        print("\n'python -m autograph COMMAND --help' describes a command's options.", file=out)
        return 0 if asked else 2
    if argv[0] == "doctor":
        from . import doctor

        return doctor.main(argv[1:])
    from . import bench

    return bench.main(argv[1:])

