"""tests/test_stand_ins.py on CUDA, and what the stand-ins are for: a replayed training
step makes no cross-stream event or wait (the parameters' gradient accumulators are
made on the caller's stream, as in eager mode).  Skipped without CUDA."""

import pytest
import torch
from torch import nn

import autograph

from ..test_stand_ins import (
    check_a_capture_failing_over_stand_ins_is_made_over_the_parameters,
    check_a_forward_reading_grad_sees_each_steps,
    check_a_parameter_read_twice_and_returned_gets_eager_gradients,
    check_a_saved_flat_parameter_written_raises_as_in_eager,
    check_a_set_up_at_the_first_call_with_warmup_0,
    check_a_sparse_gradient_added_to_a_dense_one,
    check_attributes_of_a_parameter_reach_the_capture,
    check_parameters_found_by_identity_are_found,
    check_the_graph_holds_no_parameter_accumulator,
    check_tied_parameters_take_one_stand_in,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_the_graph_holds_no_parameter_accumulator():
    check_the_graph_holds_no_parameter_accumulator("cuda")


def test_a_parameter_read_twice_and_returned_gets_eager_gradients():
    check_a_parameter_read_twice_and_returned_gets_eager_gradients("cuda")


def test_tied_parameters_take_one_stand_in():
    check_tied_parameters_take_one_stand_in("cuda")


def test_parameters_found_by_identity_are_found():
    check_parameters_found_by_identity_are_found("cuda")


def test_a_capture_failing_over_stand_ins_is_made_over_the_parameters():
    check_a_capture_failing_over_stand_ins_is_made_over_the_parameters("cuda")


def test_attributes_of_a_parameter_reach_the_capture():
    check_attributes_of_a_parameter_reach_the_capture("cuda")


def test_a_sparse_gradient_added_to_a_dense_one():
    check_a_sparse_gradient_added_to_a_dense_one("cuda")


def test_a_forward_reading_grad_sees_each_steps():
    check_a_forward_reading_grad_sees_each_steps("cuda")


def test_a_saved_flat_parameter_written_raises_as_in_eager():
    check_a_saved_flat_parameter_written_raises_as_in_eager("cuda")


def test_a_replayed_training_step_waits_on_no_other_stream():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).cuda()
    g = autograph.graphed(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(2, 16, device="cuda")

    def train_step():
        opt.zero_grad(set_to_none=True)
        g(x).square().sum().backward()
        opt.step()

    for _ in range(6):
        train_step()
    before = autograph.stats(g)["backward_replays"]
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(3):
            train_step()
        torch.cuda.synchronize()
    assert autograph.stats(g)["backward_replays"] == before + 3
    waits = [e for e in prof.key_averages() if e.key == "cudaStreamWaitEvent"]
    assert sum(e.count for e in waits) == 0, [(e.key, e.count) for e in waits]


def test_a_set_up_at_the_first_call_with_warmup_0():
    check_a_set_up_at_the_first_call_with_warmup_0("cuda")
