"""Ranks over NCCL with real CUDA graphs and captured collectives: a world of one on a
single GPU, and two ranks where two GPUs are present; programs with graphs that
captured NCCL collectives shut down, in every teardown order.  Skipped without CUDA."""

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or not torch.distributed.is_available()
    or not torch.distributed.is_nccl_available() or shutil.which("torchrun") is None,
    reason="needs CUDA, NCCL and torchrun")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
TESTS = os.path.join(ROOT, "tests")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


def torchrun(n, script, *argv, timeout=300):
    """Run ``script`` on ``n`` ranks; on timeout, kill every process it started (ranks
    stuck in a hang would otherwise hold the GPUs) and fail."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("AUTOGRAPH_DISABLE", None)
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         str(n), os.path.join(TESTS, script), *argv], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{script} {' '.join(argv)}: no exit within {timeout} s\n"
                    + out[-3000:] + err[-3000:])
    print(f"{script} {' '.join(argv)} on {n} ranks: exit {proc.returncode} after "
          f"{time.monotonic() - start:.1f} s")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_one_rank_over_nccl_captures_collectives_and_equals_eager():
    proc = torchrun(1, "ranks_check.py", "cuda", timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "1 ranks on cuda: all agree and equal eager" in proc.stdout


@two_gpus
def test_two_ranks_over_nccl_agree_and_equal_eager():
    proc = torchrun(2, "ranks_check.py", "cuda", timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "2 ranks on cuda: all agree and equal eager" in proc.stdout


@two_gpus
@pytest.mark.parametrize("order", ["destroy-first", "drop-first", "exit", "subgroup",
                                   "dead-peer"])
def test_two_ranks_with_captured_collectives_shut_down(order):
    proc = torchrun(2, "ranks_teardown.py", "cuda", order, timeout=60)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"teardown {order}: exiting" in proc.stdout
