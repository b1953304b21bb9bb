"""Capture plans: what the graphed callables of a process saw, in a file that a later
process can check against its own model and machine before it trusts it.

A plan holds, per graphed callable, the keys of its graphs (argument shapes, strides,
dtypes and devices, non-tensor values, modes) and its bucket hit counts, under an
environment fingerprint: the GPU's name and architecture, the driver version, the CUDA
runtime, torch and autograph versions, and per callable a fingerprint of its model
(structure, parameter and buffer names, shapes and dtypes, and a checksum of their
contents).  A plan from another model, GPU, driver or version is never trusted:
:func:`differences` names the fields that differ.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import tempfile
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

FORMAT = "autograph-plan"
VERSION = 2


class PlanError(ValueError):
    """A plan file that cannot be read: missing, corrupt, truncated or of another format."""


# -- fingerprints ---------------------------------------------------------------------
def environment() -> dict[str, str]:
    """The machine and software a graph depends on."""
    from . import __version__

    env = {
        "gpu_name": "none",
        "gpu_arch": "none",
        "driver": _driver_version(),
        "cuda_runtime": str(torch.version.cuda or "none"),
        "torch": torch.__version__,
        "autograph": __version__,
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        env["gpu_name"] = props.name
        env["gpu_arch"] = f"sm_{props.major}{props.minor}"
    return env


def _driver_version() -> str:
    try:
        with open("/proc/driver/nvidia/version", encoding="utf-8") as f:
            for word in f.read().split():
                if word.count(".") >= 1 and word.replace(".", "").isdigit():
                    return word
    except OSError:
        pass
    return "none"


def model_fingerprint(modules: Iterable[nn.Module]) -> dict[str, str]:
    """Structure, tensor layout and content checksums of the given module trees."""
    structure, layout, content = hashlib.sha256(), hashlib.sha256(), hashlib.sha256()
    for root in modules:
        for name, module in root.named_modules():
            cls = type(module)
            structure.update(f"{name}:{cls.__module__}.{cls.__qualname__}\n".encode())
        tensors = [*root.named_parameters(), *root.named_buffers()]
        for name, t in tensors:
            layout.update(f"{name}:{tuple(t.shape)}:{t.dtype}\n".encode())
            content.update(f"{name}:{_checksum(t)}\n".encode())
    return {
        "structure": structure.hexdigest()[:16],
        "tensors": layout.hexdigest()[:16],
        "content": content.hexdigest()[:16],
    }


def _checksum(t: torch.Tensor, chunk: int = 1 << 24) -> int:
    """An exact, order-independent checksum of a tensor's bytes, computed on its device:
    the sum of every byte times a weight that depends on its position."""
    data = t.detach().contiguous().reshape(-1).view(torch.uint8)
    total = 0
    for start in range(0, data.numel(), chunk):
        part = data[start : start + chunk].to(torch.int64)
        weights = torch.arange(start, start + part.numel(), device=part.device) % 251 + 1
        total += int((part * weights).sum())
    return total


def parse_dtype(name: str) -> torch.dtype:
    """The dtype a plan names (``"torch.float16"``); :class:`PlanError` if none is."""
    value = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise PlanError(f"autograph plan: unknown dtype {name!r}")
    return value


# -- writing and reading ------------------------------------------------------------
def save(path: str | os.PathLike[str], callables: dict[str, Any]) -> None:
    """Write a plan atomically: a reader sees the old file or the whole new one."""
    document = {"format": FORMAT, "version": VERSION, "environment": environment(),
                "callables": callables}
    text = json.dumps(document, indent=1, sort_keys=True)
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(
            errno.ENOENT, f"autograph: cannot save the plan to {os.fspath(path)!r}: its folder "
            f"{folder!r} does not exist", os.fspath(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix=".autograph-plan-", dir=folder)
    except OSError as exc:
        raise type(exc)(exc.errno, f"autograph: cannot save the plan to {os.fspath(path)!r}: "
                        f"{exc.strerror}", os.fspath(path)) from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and validate a plan; :class:`PlanError` says what is wrong with it."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise PlanError(f"autograph plan {os.fspath(path)!r} cannot be read: {exc}") from None
    try:
        document = json.loads(text)
    except ValueError as exc:
        raise PlanError(
            f"autograph plan {os.fspath(path)!r} is corrupt or truncated: {exc}"
        ) from None
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise PlanError(f"{os.fspath(path)!r} is not an autograph plan")
    if document.get("version") != VERSION:
        raise PlanError(
            f"autograph plan {os.fspath(path)!r} has version {document.get('version')!r}; "
            f"this autograph reads version {VERSION}"
        )
    if not isinstance(document.get("environment"), dict) or not isinstance(
        document.get("callables"), dict
    ):
        raise PlanError(f"autograph plan {os.fspath(path)!r} is missing its sections")
    return document


def differences(expected: dict[str, Any], actual: dict[str, Any]) -> list[str]:
    """The fields whose values differ between two fingerprints, as ``field: a != b``."""
    out = []
    for field in sorted(set(expected) | set(actual)):
        a, b = expected.get(field), actual.get(field)
        if a != b:
            out.append(f"{field}: {a!r} != {b!r}")
    return out


def describe(engines: Iterable[Any]) -> dict[str, Any]:
    """The plan section of each engine: its model fingerprint, the keys of its graphs
    (most recently used last), the argument positions it writes in place, and its
    bucket hit counts."""
    out: dict[str, Any] = {}
    for engine in engines:
        keys, inplace = [], []
        for key, positions in engine.cache.graph_keys():
            as_json = key.to_json()
            if as_json is not None:
                keys.append(as_json)
                inplace.append(list(positions))
        out[engine.stats.name] = {
            "model": model_fingerprint(engine.watch.modules()),
            "keys": keys,
            "inplace": inplace,
            "bucket_hits": {str(size): b["hits"] for size, b in engine.stats.buckets.items()},
        }
    return out
