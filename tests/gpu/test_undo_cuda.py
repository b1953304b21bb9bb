"""tests/test_undo.py on CUDA: a failed capture's set-ups (tables cached in globals,
class attributes, a method's object or a dict; counters; hooks) taken back.  Skipped
without CUDA."""

import pytest
import torch

from ..test_undo import (
    MAKERS,
    _fresh_tables,  # noqa: F401 - the autouse fixture
    check_a_counter_and_a_log_count_once,
    check_a_hook_registered_on_a_parameter_during_the_capture,
    check_a_table_cached_at_the_first_call,
    check_hooks_registered_at_the_first_call,
    check_set_ups_of_a_capture_that_fails,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("make", MAKERS, ids=lambda m: m.__name__)
def test_a_table_cached_at_the_first_call(make, train):
    check_a_table_cached_at_the_first_call("cuda", make, train)


@pytest.mark.parametrize("train", [False, True])
def test_a_counter_and_a_log_count_once(train):
    check_a_counter_and_a_log_count_once("cuda", train)


def test_hooks_registered_at_the_first_call():
    check_hooks_registered_at_the_first_call("cuda")


def test_set_ups_of_a_capture_that_fails():
    check_set_ups_of_a_capture_that_fails("cuda")


def test_a_hook_registered_on_a_parameter_during_the_capture():
    check_a_hook_registered_on_a_parameter_during_the_capture("cuda")
