import pytest

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
