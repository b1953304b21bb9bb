"""Ranks that agree: two gloo processes on the CPU (the stand-in graphs their calls), and
the pieces of the agreement."""

import os
import shutil
import subprocess
import sys

import pytest
import torch

import autograph
from autograph.keys import GraphKey, TensorKey

HERE = os.path.dirname(__file__)
ROOT = os.path.dirname(HERE)


def test_key_digest_ignores_device_indexes_and_addresses():
    part = TensorKey(torch.Size([2, 3]), (3, 1), torch.float16, torch.device("cuda", 0), False)
    other = part._replace(device=torch.device("cuda", 1))
    key = GraphKey(2, (part,), (), (False, True, False, "highest"), None)
    assert key.digest() == key._replace(leaves=(other,)).digest()
    assert key.digest() == key._replace(written=(1234,)).digest()
    assert key.digest() != key._replace(modes=(True, True, False, "highest")).digest()
    assert key.digest() != key._replace(leaves=(part._replace(dtype=torch.float32),)).digest()
    assert 0 <= key.digest() < 2**62


def test_group_must_be_a_process_group():
    with pytest.raises(ValueError, match="ProcessGroup"):
        autograph.graphed(group="world")


@pytest.mark.skipif(not torch.distributed.is_available() or shutil.which("torchrun") is None,
                    reason="needs torch.distributed and torchrun")
def test_two_gloo_ranks_agree_on_every_call_and_equal_eager():
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    env.pop("AUTOGRAPH_DISABLE", None)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--standalone", os.path.join(HERE, "ranks_check.py"), "cpu"],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "all agree and equal eager" in proc.stdout
