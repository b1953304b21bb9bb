"""Object arguments and named tensors on CUDA: an argument that is an object's tensor
or shares state the call writes, an output that is an object's tensor, and a named
tensor given other memory in place.  Each was a
wrong or surprising result until 2026-12-02 (docs/usage.md named the first two as open
limits); the bodies are the CPU tests' (tests/test_objects.py, tests/test_guards.py).
Skipped without CUDA."""

import pytest
import torch

from ..test_guards import (
    check_argument_sharing_written_state,
    check_named_tensors_given_other_memory_in_place_are_seen,
)
from ..test_objects import (
    check_argument_that_is_an_objects_tensor,
    check_output_that_is_an_objects_tensor,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("view", ["whole", "slice", "other tensor's storage"])
def test_an_argument_that_is_an_objects_tensor_reads_the_objects_write(view):
    check_argument_that_is_an_objects_tensor(view, "cuda")


@pytest.mark.parametrize("outputs", ["clone", "reuse"])
def test_an_output_that_is_an_objects_tensor_is_that_tensor(outputs):
    check_output_that_is_an_objects_tensor(outputs, "cuda")


def test_named_tensors_given_other_memory_in_place_are_seen():
    check_named_tensors_given_other_memory_in_place_are_seen("cuda")


@pytest.mark.parametrize("where", ["buffer", "global"])
def test_an_argument_sharing_written_state_reads_the_write(where):
    check_argument_sharing_written_state(where, "cuda")
