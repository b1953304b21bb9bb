"""The runtime stands apart from the tools: importing autograph loads no CLI module."""

import subprocess
import sys


def test_public_api_imports_no_tool_module():
    code = (
        "import sys, autograph\n"
        "autograph.graphed, autograph.capture_region, autograph.stats\n"
        "tools = sorted(m for m in sys.modules if m.startswith('autograph.cli'))\n"
        "print(','.join(tools))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "", f"the runtime imported tool modules: {out}"


def test_the_tools_still_import():
    code = "import autograph.cli.bench, autograph.cli.doctor; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "ok"
