"""tests/test_named_state.py on CUDA: tensors read by name frozen or unfrozen between
calls, a whole step's module outside its optimizer unfrozen, a capture without warmup
reading a tensor that requires grad, names rebound to containers.  Skipped without
CUDA."""

import pytest
import torch

from ..test_named_state import (
    WHERE,
    check_a_capture_without_warmup_reading_a_tensor_that_requires_grad,
    check_a_discriminator_frozen_and_unfrozen_every_step_keeps_its_graphs,
    check_a_named_tensor_unfrozen_after_capture_gets_its_gradient,
    check_a_training_graph_reading_a_named_tensor_unfrozen,
    check_a_whole_step_after_a_tensor_outside_its_optimizer_is_unfrozen,
    check_names_rebound_to_containers_arrays_and_types,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("where", WHERE)
def test_a_named_tensor_unfrozen_after_capture_gets_its_gradient(where):
    check_a_named_tensor_unfrozen_after_capture_gets_its_gradient(where, "cuda")


def test_a_training_graph_reading_a_named_tensor_unfrozen():
    check_a_training_graph_reading_a_named_tensor_unfrozen("cuda")


def test_a_whole_step_after_a_tensor_outside_its_optimizer_is_unfrozen():
    check_a_whole_step_after_a_tensor_outside_its_optimizer_is_unfrozen("cuda")


def test_a_capture_without_warmup_reading_a_tensor_that_requires_grad():
    check_a_capture_without_warmup_reading_a_tensor_that_requires_grad("cuda")


def test_names_rebound_to_containers_arrays_and_types():
    check_names_rebound_to_containers_arrays_and_types("cuda")


def test_a_discriminator_frozen_and_unfrozen_every_step_keeps_its_graphs():
    check_a_discriminator_frozen_and_unfrozen_every_step_keeps_its_graphs("cuda")
