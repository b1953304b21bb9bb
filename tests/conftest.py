import pytest
import torch

from autograph.capture import use_backend

from .standin import StandinBackend


@pytest.fixture
def standin():
    """Graph CPU tensors through the stand-in backend for the duration of a test."""
    backend = StandinBackend()
    undo = use_backend(backend)
    try:
        yield backend
    finally:
        undo()


@pytest.fixture(autouse=True)
def _grad_mode_restored():
    """Each test starts and ends with this thread's grad mode as it was: a test that
    resumes a ``torch.no_grad()`` block on another thread leaves it off here."""
    before = torch.is_grad_enabled()
    yield
    torch.set_grad_enabled(before)
