"""Faster keyers for known object types (transformers' caches).

A keyer returns the same kind of structure the general walk (``walk.walk``) gives and
appends the object's tensors to the :class:`~autograph.walk.Walked`, without the
recursion.  transformers' keyers are registered when ``transformers.cache_utils`` is
already imported: autograph never imports transformers itself.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

from .counters import Counter
from .walk import Walked, walk

_Tensor = torch.Tensor
# attribute types a StaticCache layer is keyed by without the general walk: a value of
# these types is equal to another only when it is the same value (no float: NaN, -0.0)
_PLAIN_KINDS = frozenset({torch.Tensor, bool, int, str, type(None), torch.dtype, torch.device})

Keyer = Callable[[Any, Walked], Any]
KEYERS: dict[type, Keyer] = {}
_checked: set[str] = set()


def register(cls: type, keyer: Keyer) -> None:
    """Key instances of ``cls`` (exactly that type) with ``keyer(obj, walked)``, which
    returns the structure and appends the object's tensors to ``walked`` (with paths)."""
    KEYERS[cls] = keyer


def keyer_for(cls: type) -> Keyer | None:
    keyer = KEYERS.get(cls)
    if keyer is None and "transformers.cache_utils" not in _checked:
        if "transformers.cache_utils" in sys.modules:
            _checked.add("transformers.cache_utils")
            _register_transformers(sys.modules["transformers.cache_utils"])
            keyer = KEYERS.get(cls)
    return keyer


def _register_transformers(cache_utils: Any) -> None:
    """A fast keyer for transformers' ``StaticCache`` of ``StaticLayer`` and
    ``StaticSlidingWindowLayer`` layers (the layouts ``generate(cache_implementation=
    "static")`` makes): the same key the general walk gives, built without recursion,
    except that a sliding layer's ``cumulative_length_int`` is keyed by its phase (see
    :func:`_phase`) and listed as a host counter (``counters``)."""
    static_cache = getattr(cache_utils, "StaticCache", None)
    static_layer = getattr(cache_utils, "StaticLayer", None)
    if static_cache is None or static_layer is None:
        return
    sliding = getattr(cache_utils, "StaticSlidingWindowLayer", None)
    layer_types = (static_layer,) if sliding is None else (static_layer, sliding)

    def key_static(cache: Any, walked: Walked) -> Any:
        d = cache.__dict__
        layers = d.get("layers")
        if type(layers) is not list or any(type(layer) not in layer_types for layer in layers):
            counter = [0]
            return walk(cache, walked, type(cache).__name__, 0, counter)
        append_t, append_p = walked.tensors.append, walked.paths.append
        parts = []
        for i, layer in enumerate(layers):
            ld = layer.__dict__
            kinds = tuple(map(type, ld.values()))
            if not _PLAIN_KINDS.issuperset(kinds):  # a float, a container: the walk
                counter = [0]
                parts.append(walk(layer, walked, f"StaticCache.layers[{i}]", 1, counter))
                continue
            # names, types and values, a tensor's value None (its key comes from finish())
            values: list[Any] = []
            for name, v in ld.items():
                if type(v) is _Tensor:
                    append_t(v)
                    append_p((i, name))
                    values.append(None)
                elif name == _COUNTER and type(layer) is sliding:
                    values.append(_phase(walked, i, v, ld.get("max_cache_len")))
                else:
                    values.append(v)
            parts.append((tuple(ld), kinds, tuple(values)))
        rest = []
        for name, v in d.items():
            if name == "layers":
                continue
            counter = [0]
            rest.append((name, walk(v, walked, f"StaticCache.{name}", 1, counter)))
        return ("static_cache", tuple(parts), tuple(rest))

    register(static_cache, key_static)


_COUNTER = "cumulative_length_int"


def _phase(walked: Walked, i: int, value: int, window: Any) -> Any:
    """A sliding layer's token count by its phase: 0 (empty), filling (1 to the window
    less one) or full (the window or more), which is what ``update()`` branches on for
    a call of a given number of new tokens.  The capture checks that every branch the
    call takes on it is the same for every value of the phase (``counters``)."""
    if type(value) is not int or type(window) is not int or window < 2 or value < 0:
        return value  # keyed by value
    lo, hi = (0, 0) if value == 0 else (1, window - 1) if value < window else (window, None)
    if walked.counters is None:
        walked.counters = []
    walked.counters.append(Counter(("layers", i), _COUNTER, lo, hi,
                                   f"StaticCache.layers[{i}].{_COUNTER}"))
    return ("phase", lo)
