"""Ranks that agree: two gloo processes on the CPU (the stand-in graphs their calls), and
the pieces of the agreement; programs with ranks shut down in every teardown order."""

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


needs_torchrun = pytest.mark.skipif(
    not torch.distributed.is_available() or shutil.which("torchrun") is None,
    reason="needs torch.distributed and torchrun")


def torchrun(script, *argv, timeout=300):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    env.pop("AUTOGRAPH_DISABLE", None)
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--standalone", os.path.join(HERE, script), *argv],
        capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT,
    )


@needs_torchrun
@pytest.mark.parametrize("channel", ["shm", "gloo"])
def test_two_gloo_ranks_agree_on_every_call_and_equal_eager(channel, monkeypatch):
    monkeypatch.setenv("AUTOGRAPH_RANKS_CHANNEL", channel)
    proc = torchrun("ranks_check.py", "cpu")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "all agree and equal eager" in proc.stdout


@needs_torchrun
@pytest.mark.parametrize("order", ["destroy-first", "drop-first", "exit", "subgroup",
                                   "dead-peer"])
def test_two_gloo_ranks_shut_down_in_every_teardown_order(order):
    proc = torchrun("ranks_teardown.py", "cpu", order, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"teardown {order}: exiting" in proc.stdout


@pytest.fixture
def world_of_one():
    """A gloo world of one in this process, destroyed (through autograph's wrapper)
    unless the test did."""
    dist = torch.distributed
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_destroying_the_group_drops_the_graphs_first_and_later_calls_run_eagerly(
        standin, world_of_one):
    dist = torch.distributed

    @autograph.graphed(group=world_of_one)
    def double(x):
        return x * 2

    @autograph.graphed
    def alone(x):  # no group: its graphs may hold a collective of the group too
        return x + 1

    x = torch.ones(3)
    for _ in range(4):
        double(x), alone(x)
    assert autograph.stats(double)["graphs"] == autograph.stats(alone)["graphs"] == 1
    dist.destroy_process_group()
    assert autograph.stats(double)["graphs"] == autograph.stats(alone)["graphs"] == 0
    replays = autograph.stats(double)["replays"]
    torch.testing.assert_close(double(x), x * 2)  # no group: eagerly, with the reason
    s = autograph.stats(double)
    assert s["replays"] == replays and s["graphs"] == 0
    assert "its process group was destroyed" in str(s["eager_details"])


def test_destroy_process_group_is_wrapped_once_and_keeps_its_name():
    dist = torch.distributed
    if not dist.is_available():
        pytest.skip("needs torch.distributed")
    from autograph import shutdown

    assert dist.destroy_process_group is dist.distributed_c10d.destroy_process_group
    assert dist.destroy_process_group.__name__ == "destroy_process_group"
    assert dist.destroy_process_group.__wrapped__ is shutdown._original_destroy
    shutdown.install()
    assert dist.destroy_process_group.__wrapped__ is shutdown._original_destroy
