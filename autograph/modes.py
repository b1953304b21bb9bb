"""The global modes and numerics flags a graph bakes in, read as one tuple per call.

A captured graph keeps the kernels chosen at capture: whether autograd recorded,
inference mode, the autocast dtype, and every flag that changes which kernels run or
how they round: TF32 for matmuls and cuDNN (through the new ``fp32_precision`` API
where torch has it, which also reflects the legacy flags and never raises on a mix of
the two), reduced-precision reductions, fp16 accumulation, deterministic algorithms,
cuDNN's enabled/deterministic/benchmark flags and the default dtype.  All of it goes
into the key, so flipping a flag selects another graph instead of replaying a stale one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

_C = torch._C
_grad_enabled = torch.is_grad_enabled
_inference_mode = torch.is_inference_mode_enabled
_autocast = torch.is_autocast_enabled
_any_autocast: Callable[[], bool] = getattr(_C, "_is_any_autocast_enabled", lambda: True)
_get_dtype = torch.get_autocast_dtype
_default_dtype = torch.get_default_dtype
_precision: Any = getattr(_C, "_get_fp32_precision_getter", None)


def _flag(name: str) -> Callable[[], Any]:
    getter = getattr(_C, name, None)
    if getter is None:
        return lambda: None
    try:
        getter()
    except RuntimeError:
        pass
    return getter  # type: ignore[no-any-return]


def _safe(getter: Callable[[], Any]) -> Callable[[], Any]:
    """A legacy getter that raises once the new API was used: read it as None then."""
    def read() -> Any:
        try:
            return getter()
        except RuntimeError:
            return None

    return read


if _precision is not None:
    def _fp32() -> tuple[Any, ...]:
        return (_precision("cuda", "matmul"), _precision("cuda", "conv"),
                _precision("cuda", "rnn"), _precision("mkldnn", "matmul"))
else:  # pragma: no cover - torch before the fp32_precision API
    _legacy = (_safe(_flag("_get_cublas_allow_tf32")), _safe(_flag("_get_cudnn_allow_tf32")),
               _safe(_flag("_get_float32_matmul_precision")))

    def _fp32() -> tuple[Any, ...]:
        return tuple(get() for get in _legacy)


_fp16_reduction = _flag("_get_cublas_allow_fp16_reduced_precision_reduction")
_bf16_reduction = _flag("_get_cublas_allow_bf16_reduced_precision_reduction")
_fp16_accumulation = _flag("_get_cublas_allow_fp16_accumulation")
_deterministic = _flag("_get_deterministic_algorithms")
_cudnn_enabled = _flag("_get_cudnn_enabled")
_cudnn_deterministic = _flag("_get_cudnn_deterministic")
_cudnn_benchmark = _flag("_get_cudnn_benchmark")


def modes(device: torch.device) -> tuple[Any, ...]:
    """What a graph on ``device`` bakes in of the global state, as one hashable tuple:
    ``(grad, inference, autocast dtype or False, numerics flags...)``."""
    kind = device.type
    return (
        _grad_enabled(), _inference_mode(),
        _any_autocast() and _autocast(kind) and _get_dtype(kind),
        _fp32(), _fp16_reduction(), _bf16_reduction(), _fp16_accumulation(),
        _deterministic(), _cudnn_enabled(), _cudnn_deterministic(), _cudnn_benchmark(),
        _default_dtype(),
    )


def grad_enabled(key_modes: tuple[Any, ...]) -> bool:
    """Whether autograd records, from a :func:`modes` tuple."""
    return bool(key_modes[0])
