"""Faster keyers for known object types (transformers' caches).

A keyer returns the same kind of structure the general walk (``walk.walk``) gives and
appends the object's tensors to the :class:`~autograph.walk.Walked`, without the
recursion.  transformers' keyers are registered when ``transformers.cache_utils`` is
already imported: autograph never imports transformers itself.

A ``StaticCache`` is keyed on every decode step of ``generate()``, and between two steps
nothing in it is rebound: its keyer keeps a record of the last keying (:class:`Memo`)
and reuses it while every attribute it read is the very same object, so a repeat costs
identity checks and the tensors' metadata (read again by ``objects.finish``).
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from operator import is_
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
        memo = _memos.get(id(cache))
        if memo is not None and memo.ref() is cache and memo.unchanged(d):
            walked.tensors.extend(memo.tensors)
            walked.paths.extend(memo.paths)
            walked.memo = memo
            return memo.state
        layers = d.get("layers")
        if type(layers) is not list or any(type(layer) not in layer_types for layer in layers):
            counter = [0]
            return walk(cache, walked, type(cache).__name__, 0, counter)
        append_t, append_p = walked.tensors.append, walked.paths.append
        parts = []
        seen: list[Any] | None = []  # per layer (layer, type, names, kinds, values)
        for i, layer in enumerate(layers):
            ld = layer.__dict__
            kinds = tuple(map(type, ld.values()))
            if not _PLAIN_KINDS.issuperset(kinds):  # a float, a container: the walk
                counter = [0]
                parts.append(walk(layer, walked, f"StaticCache.layers[{i}]", 1, counter))
                seen = None
                continue
            if seen is not None:
                seen.append((layer, type(layer), tuple(ld), kinds, tuple(ld.values())))
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
            if type(v) not in _PLAIN_KINDS or type(v) is _Tensor:
                seen = None
            counter = [0]
            rest.append((name, walk(v, walked, f"StaticCache.{name}", 1, counter)))
        state = ("static_cache", tuple(parts), tuple(rest))
        if seen is not None and walked.counters is None:  # counters: keyed by phase
            walked.memo = _remember(cache, d, layers, seen, state, walked)
        return state

    register(static_cache, key_static)


_COUNTER = "cumulative_length_int"


class Memo:
    """What the last keying of one ``StaticCache`` read and gave, to key it again
    without the work while nothing it read has changed: the cache's attribute names and
    values, its ``layers`` list and, per layer, the layer, its type and its attributes'
    names, types and values, all compared by identity (a rebound attribute, an equal
    but new int, a new tensor: the full keying again).  The tensors' metadata is read
    on every call all the same (``objects.finish``: an in-place ``resize_`` or ``.data =``
    keeps the tensor object), and ``done`` is the finished key it gave last.

    Only a cache whose values are all plain (tensors, ints, bools, strings, None,
    dtypes, devices) and has no host counter is remembered: the values held here are
    the cache's own, and the record goes when the cache does."""

    __slots__ = ("ref", "names", "values", "layers", "per_layer", "state", "tensors",
                 "paths", "done")

    def __init__(self, cache: Any, d: dict[str, Any], layers: list[Any], seen: list[Any],
                 state: Any, walked: Walked) -> None:
        key = id(cache)
        self.ref = weakref.ref(cache, lambda r: _forget(key, r))
        self.names, self.values = tuple(d), tuple(d.values())
        self.layers, self.per_layer = layers, tuple(seen)
        self.state = state
        self.tensors, self.paths = tuple(walked.tensors), tuple(walked.paths)
        # (device, the finished ObjectKey, the check of its tensors, their storage
        # addresses), set by objects.finish
        self.done: tuple[Any, Any, Any, frozenset[int]] | None = None

    def unchanged(self, d: dict[str, Any]) -> bool:
        """Whether the cache (its ``__dict__``, ``d``) is as this record read it."""
        if tuple(d) != self.names or not all(map(is_, d.values(), self.values)):
            return False
        layers = self.layers
        for layer, (was, kind, names, _kinds, values) in zip(layers, self.per_layer):
            if layer is not was or type(layer) is not kind:
                return False
            # the very same values have the same types (a tensor's, which ``__class__``
            # could change, is compared by the tensors' check in ``objects.finish``)
            ld = layer.__dict__
            if tuple(ld) != names or not all(map(is_, ld.values(), values)):
                return False
        return len(layers) == len(self.per_layer)


# id(cache) -> its record, dropped with the cache (a few caches at most at a time)
_memos: dict[int, Memo] = {}
_MAX_MEMOS = 16


def _remember(cache: Any, d: dict[str, Any], layers: list[Any], seen: list[Any],
              state: Any, walked: Walked) -> Memo:
    memo = Memo(cache, d, layers, seen, state, walked)
    if len(_memos) >= _MAX_MEMOS:
        _memos.clear()
    _memos[id(cache)] = memo
    return memo


def _forget(key: int, ref: Any) -> None:
    memo = _memos.get(key)
    if memo is not None and memo.ref is ref:
        del _memos[key]


def _phase(walked: Walked, i: int, value: int, window: Any) -> Any:
    """A sliding layer's token count by its phase: 0 (empty), filling (1 to the window
    less two), the last step of filling (the window less one) or full (the window or
    more), which is what ``update()`` and ``get_mask_sizes()`` branch on for a call of
    a given number of new tokens (the mask's offset, ``max(count - window + 1, 0)``,
    compares ``count`` with the window less one: a decode loop with no mask of its own
    reads it).  The capture checks that every branch the call takes on it is the same
    for every value of the phase (``counters``)."""
    if type(value) is not int or type(window) is not int or window < 2 or value < 0:
        return value  # keyed by value
    lo, hi = (0, 0) if value == 0 else (1, window - 2) if value < window - 1 \
        else (window - 1, window - 1) if value == window - 1 else (window, None)
    if walked.counters is None:
        walked.counters = []
    walked.counters.append(Counter(("layers", i), _COUNTER, lo, hi,
                                   f"StaticCache.layers[{i}].{_COUNTER}"))
    return ("phase", lo)
