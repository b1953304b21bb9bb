"""Ranks over NCCL with real CUDA graphs and captured collectives: a world of one on a
single GPU, and two ranks where two GPUs are present.  Skipped without CUDA."""

import os
import shutil
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or not torch.distributed.is_available()
    or not torch.distributed.is_nccl_available() or shutil.which("torchrun") is None,
    reason="needs CUDA, NCCL and torchrun")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
CHECK = os.path.join(ROOT, "tests", "ranks_check.py")


def torchrun(n):
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("AUTOGRAPH_DISABLE", None)
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         str(n), CHECK, "cuda"], capture_output=True, text=True, timeout=300, env=env,
        cwd=ROOT)


def test_one_rank_over_nccl_captures_collectives_and_equals_eager():
    proc = torchrun(1)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "1 ranks on cuda: all agree and equal eager" in proc.stdout


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_ranks_over_nccl_agree_and_equal_eager():
    proc = torchrun(2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "2 ranks on cuda: all agree and equal eager" in proc.stdout
