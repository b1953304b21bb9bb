"""``python -m autograph doctor``: will autograph work on this machine?

Prints the versions and the GPU, whether the kill switch is set, the environment
fingerprint that capture plans are checked against, and the result of a tiny capture
and replay.  Exits 0 only when graphs will be captured and replayed here.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import traceback

import torch

from autograph import __version__, graphed, stats
from autograph.plan import environment
from autograph.switch import ENV_VAR, is_disabled


def check_capture() -> str | None:
    """Capture and replay a tiny model; None if it works, else what went wrong."""
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8)).cuda().eval()
    fast = graphed(model, warmup=1)
    try:
        with torch.no_grad():
            for _ in range(4):
                x = torch.randn(2, 64, device="cuda")
                torch.testing.assert_close(fast(x), model(x), rtol=1e-4, atol=1e-4)
    except AssertionError as exc:
        return f"a replayed graph differs from eager: {str(exc).splitlines()[0]}"
    except Exception:  # noqa: BLE001 - report whatever happened
        return "the test call raised:\n" + traceback.format_exc(limit=3)
    s = stats(fast)
    if s["replays"] < 2:
        return f"the tiny model was not replayed: {dict(s['eager_reasons'])}"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m autograph doctor", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="exit status: 0 when graphs will be used here, 1 when every call will run "
               "eagerly (and why)")
    parser.parse_args(argv)
    rows = [
        ("autograph", __version__),
        ("torch", torch.__version__),
        ("python", f"{platform.python_version()} ({sys.platform})"),
        ("CUDA runtime (torch built with)", str(torch.version.cuda or "none: a CPU build")),
    ]
    problems: list[str] = []
    env = environment()
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        rows += [
            ("driver", env["driver"]),
            ("GPU", f"{props.name}, compute capability {props.major}.{props.minor}, "
                    f"{props.total_memory / 2**30:.0f} GiB"),
            ("GPUs visible", str(torch.cuda.device_count())),
        ]
    else:
        problems.append("no CUDA device is available to torch: autograph will run every call "
                        "eagerly (correct, but without graphs).")
    disabled = is_disabled()
    rows.append(("kill switch", f"{ENV_VAR}={os.environ.get(ENV_VAR)!r}: every call runs eagerly"
                 if disabled else f"off ({ENV_VAR} unset)"))
    if disabled:
        problems.append(f"the kill switch is set ({ENV_VAR}): unset it to capture graphs.")
    if torch.cuda.is_available() and not disabled:
        error = check_capture()
        rows.append(("tiny capture and replay", "works" if error is None else "FAILED"))
        if error is not None:
            problems.append(f"capturing and replaying a tiny model failed: {error}")
    for name, value in rows:
        print(f"{name + ':':<33} {value}")
    print("plan fingerprint:")
    for name, value in env.items():
        print(f"  {name + ':':<14} {value}")
    if problems:
        print("\nautograph will not use CUDA graphs here:")
        for problem in problems:
            print(f"  - {problem}")
        return 1
    print("\nautograph will capture and replay CUDA graphs here.")
    return 0
