"""The global modes and numerics flags a graph bakes in, read as one tuple per call.

A captured graph keeps the kernels chosen at capture: whether autograd recorded,
inference mode, the autocast dtype, and every flag that changes which kernels run or
how they round: TF32 for matmuls and cuDNN (through the new ``fp32_precision`` API
where torch has it, which also reflects the legacy flags and never raises on a mix of
the two), reduced-precision reductions, fp16 accumulation, deterministic algorithms
(global and cuDNN's), the default dtype, the attention kernels
``scaled_dot_product_attention`` may pick (``sdpa_kernel``) and whether its math kernel
reduces in half precision, ``nn.MultiheadAttention``'s fast path, and the torch function
modes active (``with torch.device(...)``, a user's ``TorchFunctionMode``).  cuDNN's
``benchmark`` and ``enabled`` change speed and rounding within tolerance, not results:
they are not keyed.  All of it goes into the key, so flipping a flag selects another
graph instead of replaying a stale one.
"""

from __future__ import annotations

import functools
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


def _safe(getter: Callable[[], Any]) -> Callable[[], Any]:
    """A legacy getter that raises once the new API was used: read it as None then."""
    def read() -> Any:
        try:
            return getter()
        except RuntimeError:
            return None

    return read


def _read(name: str, *args: str) -> Callable[[], Any]:
    """A zero-argument reader of one flag (None where this torch lacks it); a legacy
    getter that raises once the new API was used reads None."""
    getter = getattr(_C, name, None)
    if getter is None:
        return lambda: None
    read = functools.partial(getter, *args) if args else getter
    try:
        read()
    except RuntimeError:
        return _safe(read)
    return read  # type: ignore[no-any-return]


if _precision is not None:
    _TF32 = (_read("_get_fp32_precision_getter", "cuda", "matmul"),
             _read("_get_fp32_precision_getter", "cuda", "conv"),
             _read("_get_fp32_precision_getter", "cuda", "rnn"))
    _CPU_PRECISION = (_read("_get_fp32_precision_getter", "mkldnn", "matmul"),)
else:  # pragma: no cover - torch before the fp32_precision API
    _TF32 = (_safe(_read("_get_cublas_allow_tf32")), _safe(_read("_get_cudnn_allow_tf32")),
             _safe(_read("_get_float32_matmul_precision")))
    _CPU_PRECISION = (_safe(_read("_get_float32_matmul_precision")),)

# Flags that change results (each a zero-argument reader): TF32, reduced-precision
# reductions and accumulation, deterministic algorithms (global and cuDNN's).
_matmul, _conv, _rnn = _TF32
_cpu_matmul = _CPU_PRECISION[0]
_fp16_reduction = _read("_get_cublas_allow_fp16_reduced_precision_reduction")
_bf16_reduction = _read("_get_cublas_allow_bf16_reduced_precision_reduction")
_fp16_accumulation = _read("_get_cublas_allow_fp16_accumulation")
_cudnn_deterministic = _read("_get_cudnn_deterministic")
_deterministic = _read("_get_deterministic_algorithms")
# which attention kernels ``scaled_dot_product_attention`` may pick (``sdpa_kernel``,
# ``torch.backends.cuda.enable_flash_sdp``): another kernel rounds otherwise, and one
# not available raises in eager mode
_flash = _read("_get_flash_sdp_enabled")
_mem_efficient = _read("_get_mem_efficient_sdp_enabled")
_math = _read("_get_math_sdp_enabled")
_cudnn_sdp = _read("_get_cudnn_sdp_enabled")
_math_reduction = _read("_get_math_sdp_allow_fp16_bf16_reduction")
_sdp_order_list = _read("_get_sdp_priority_order")  # ``sdpa_kernel(..., set_priority=True)``


def _sdp_order() -> Any:
    """The order in which attention kernels are tried (a list: as a tuple, hashable)."""
    order = _sdp_order_list()
    return tuple(order) if order is not None else None


_mha: Any = getattr(torch.backends, "mha", None)  # ``set_fastpath_enabled``: another path
_stack_len: Callable[[], int] = getattr(_C, "_len_torch_function_stack", lambda: 0)
_stack_at: Any = getattr(_C, "_get_function_stack_at", None)


def function_modes() -> tuple[Any, ...]:
    """The torch function modes active on this thread (``with torch.device("meta")``,
    ``set_default_device``, a user's ``TorchFunctionMode``): each decides what the
    Python of a call runs (a factory's device, a rounding the mode adds), so a graph
    captured under one replays it only under the same.  A device context by its
    device, any other mode as :data:`USER_MODE` (eager); () with none (one C call)."""
    n = _stack_len()
    if not n or _stack_at is None:
        return ()
    return tuple(_mode_key(_stack_at(i)) for i in range(n))


USER_MODE = "a TorchFunctionMode is active (its Python and state are not keyed)"


def _mode_key(mode: Any) -> Any:
    """A device context by its device; any other mode (a user's, whose state decides
    what it does) as :data:`USER_MODE`, which makes the call run eagerly."""
    device = getattr(mode, "device", None)
    if type(mode).__name__ == "DeviceContext" and isinstance(device, torch.device):
        return (type(mode), device)
    return USER_MODE


def _fastpath() -> Any:
    return getattr(_mha, "_is_fastpath_enabled", None)


_top_saved_hooks: Any = getattr(getattr(_C, "_autograd", None),
                                "_top_saved_tensors_default_hooks", None)


def saved_hooks() -> bool:
    """Whether saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``,
    ``save_on_cpu``) are active on this thread: a training graph saves its tensors its
    own way, so the user's pack and unpack would not run."""
    return _top_saved_hooks is not None and _top_saved_hooks(False) is not None


def _cuda_modes() -> tuple[Any, ...]:
    autocast = _any_autocast() and _autocast("cuda") and _get_dtype("cuda")
    return (_grad_enabled(), _inference_mode(), autocast, _matmul(), _conv(), _rnn(),
            _fp16_reduction(), _bf16_reduction(), _fp16_accumulation(),
            _cudnn_deterministic(), _deterministic(), _default_dtype(),
            _flash(), _mem_efficient(), _math(), _cudnn_sdp(), _math_reduction(), _sdp_order(),
            _fastpath(), function_modes())


def _reader(kind: str) -> Callable[[], tuple[Any, ...]]:
    """The modes reader of one device type (CUDA reads its numerics flags too)."""
    if kind == "cuda":
        return _cuda_modes

    def other() -> tuple[Any, ...]:
        autocast = _any_autocast() and _autocast(kind) and _get_dtype(kind)
        return (_grad_enabled(), _inference_mode(), autocast, _cpu_matmul(), _deterministic(),
                _default_dtype(), _flash(), _math(), _math_reduction(), _fastpath(),
                function_modes())

    return other


# Names of the numerics flags that follow (grad, inference, autocast) in the tuple of
# each device type, in its order, for messages.
_SDPA_FLAGS = ("flash attention", "memory-efficient attention", "math attention",
               "cuDNN attention")
_CUDA_FLAGS = ("TF32 matmul", "TF32 conv", "TF32 rnn", "fp16 reduced-precision reduction",
               "bf16 reduced-precision reduction", "fp16 accumulation",
               "cuDNN deterministic", "deterministic algorithms", "default dtype",
               *_SDPA_FLAGS, "math attention reduced-precision reduction",
               "attention kernel priority", "MHA fast path", "torch function modes")
_OTHER_FLAGS = ("CPU matmul precision", "deterministic algorithms", "default dtype",
                "flash attention", "math attention",
                "math attention reduced-precision reduction", "MHA fast path",
                "torch function modes")


def flag_names(kind: str) -> tuple[str, ...]:
    """The names of the numerics flags in the modes of device type ``kind``, in order."""
    return _CUDA_FLAGS if kind == "cuda" else _OTHER_FLAGS


# device -> its reader: ``device.type`` builds a new string on every read, a dict
# lookup by the device does not
_readers: dict[torch.device, Callable[[], tuple[Any, ...]]] = {}


def reader(device: torch.device) -> Callable[[], tuple[Any, ...]]:
    """The function that reads ``modes(device)`` (bound once by a caller that reads
    them for one device on every call)."""
    read = _readers.get(device)
    if read is None:
        read = _readers.setdefault(device, _reader(device.type))
    return read


def modes(device: torch.device) -> tuple[Any, ...]:
    """What a graph on ``device`` bakes in of the global state, as one hashable tuple:
    ``(grad, inference, autocast dtype or False, numerics flags...)``.  Written out, not
    looped: it runs on every call."""
    read = _readers.get(device)
    if read is None:
        read = _readers.setdefault(device, _reader(device.type))
    return read()
