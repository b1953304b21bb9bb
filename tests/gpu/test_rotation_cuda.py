"""Outputs without a host copy (rotation.py) on real CUDA graphs: the CPU suite's checks
(tests/test_rotation.py), where a call served from a variant's buffer allocates
nothing.  Outputs held across other keys' replays (graphs sharing the pool): see
tests/gpu/test_reuse_cuda.py, for both output modes."""

import pytest
import torch

from ..test_rotation import (
    check_alternating_keys,
    check_held_outputs_are_never_written,
    check_outputs_match_eager_mode,
    check_rebinding_loop,
    check_state_the_code_names_is_written_once_per_call,
)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _allocations():
    return torch.cuda.memory_stats()["allocation.all.allocated"]


def lent(call):
    before = _allocations()
    out = call()
    return out, _allocations() == before  # no clone: nothing allocated


def test_rebinding_loop_allocates_nothing():
    check_rebinding_loop("cuda", lent)


@pytest.mark.parametrize("keep", ["all", "view", "storage"])
def test_held_outputs_are_never_written(keep):
    check_held_outputs_are_never_written("cuda", keep)


def test_alternating_keys_keep_their_outputs():
    check_alternating_keys("cuda")


def test_outputs_are_inference_tensors_where_eager_gives_them():
    check_outputs_match_eager_mode("cuda")


@pytest.mark.parametrize("verify_every", [None, 2])
def test_state_the_code_names_is_written_once_per_call(verify_every):
    check_state_the_code_names_is_written_once_per_call("cuda", verify_every)
