"""Per-argument options: one resolver for names and positions, and their validation.

``batch_dims``, ``pad_values`` and ``pad_writes`` name arguments by parameter name or by
position (counted after ``self`` for a method), and a call may pass any argument either
way.  Everything that reads a per-argument option goes through :class:`Arguments`: each
option is normalized once to *canonical* keys (the parameter name where the position has
one, the position past the named parameters, as for ``*args``), and each argument of a
call is looked up by its canonical key, so ``f(x, slots)``, ``f(x, slots=slots)`` and
``f(slots=slots, x=x)`` find the same entry whether the option said ``"slots"`` or ``1``.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable, Mapping
from typing import Any

# the options that hold one entry per argument (``Options`` fields)
PER_ARGUMENT = ("batch_dims", "pad_values", "pad_writes")

Key = str | int  # an argument's position in the call, or its keyword


class Arguments:
    """Resolves an argument of a call, passed by position or keyword, to its entry in a
    per-argument option, whatever the option keyed it by."""

    __slots__ = ("names", "_index")

    def __init__(self, names: list[str]) -> None:
        self.names = names  # the positional parameters' names (self skipped)
        self._index = {name: i for i, name in enumerate(names)}

    def canonical(self, key: Key) -> Key:
        """The parameter name of a position that has one; otherwise the key itself."""
        if isinstance(key, int) and 0 <= key < len(self.names):
            return self.names[key]
        return key

    def normalize(self, mapping: Mapping[Key, Any] | None) -> dict[Key, Any]:
        """``mapping`` keyed canonically; where it names one argument both by name and by
        position, the name's entry wins."""
        out: dict[Key, Any] = {}
        for key, value in (mapping or {}).items():
            canon = self.canonical(key)
            if canon not in out or canon == key:
                out[canon] = value
        return out

    def keys_of(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> list[Key]:
        """The canonical key of every argument of a call, positional ones first."""
        names, n = self.names, len(self.names)
        return [*(names[i] if i < n else i for i in range(len(args))), *kwargs]


def positional_names(fn: Callable[..., Any], skip_self: bool) -> list[str]:
    """Names of ``fn``'s positional parameters, to match per-argument options by name."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return []
    names = [p.name for p in params
             if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return names[1:] if skip_self and names else names


Positional = Callable[[tuple[Any, ...], dict[str, Any]], tuple[tuple[Any, ...], dict[str, Any]]]


def move_names(fn: Any, skip_self: bool) -> list[str | None]:
    """Per positional parameter of ``fn``, the name a keyword argument may give it by
    (None: positional-only), read from the code object of the function called itself:
    a decorator's ``wrapper(*args, **kwargs)`` has none (``inspect.signature`` would
    follow ``__wrapped__`` or a ``__signature__`` to the inner function's, and moving
    a keyword the wrapper reads into position would change the call)."""
    if isinstance(fn, types.MethodType):
        fn, skip_self = fn.__func__, True
    code = getattr(fn, "__code__", None) if isinstance(fn, types.FunctionType) else None
    if code is None:
        return []
    names: list[str | None] = list(code.co_varnames[:code.co_argcount])
    names[:code.co_posonlyargcount] = [None] * code.co_posonlyargcount
    return names[1:] if skip_self and names else names


def positional(names: list[str | None], trusted: Callable[[], bool] = lambda: True
               ) -> Positional | None:
    """A function that passes keyword arguments naming the next positional parameters
    by position (``f(x=a, y=b)`` as ``f(a, b)``; ``f(y=b, x=a)`` too): one spelling of
    a call, one key, the shortcut of positional calls, and an ahead-of-time warmup
    that serves either spelling.  Only the run of names that continues the call's
    positional arguments moves (a keyword after a gap stays one; a positional-only
    parameter stops it).  ``names``: :func:`move_names`.  ``trusted``: whether they
    still describe what is called (a module whose ``forward`` was replaced on the
    instance, or that has forward hooks: not).  None without names."""
    if not any(names):
        return None

    def move(args: tuple[Any, ...], kwargs: dict[str, Any]
             ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        n = len(args)
        if n >= len(names) or names[n] not in kwargs or not trusted():
            return args, kwargs
        moved, rest = list(args), dict(kwargs)
        while n < len(names) and (name := names[n]) is not None and name in rest:
            moved.append(rest.pop(name))
            n += 1
        return tuple(moved), rest

    return move


Misfit = Callable[[tuple[Any, ...], Mapping[str, Any]], str | None]


def no_misfit(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
    """The check of a callable without a signature: every call may fit."""
    return None


def misfit_check(fn: Callable[..., Any], skip_self: bool) -> Misfit:
    """A check of a call against ``fn``'s parameters: it returns why the arguments do not
    bind (the ``TypeError`` message), or None where they do (or where ``fn`` has no
    signature to check against)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return no_misfit
    params = list(signature.parameters.values())
    if skip_self and params and params[0].kind in (params[0].POSITIONAL_ONLY,
                                                   params[0].POSITIONAL_OR_KEYWORD):
        signature = signature.replace(parameters=params[1:])
    bind = signature.bind

    def misfit(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str | None:
        try:
            bind(*args, **kwargs)
        except TypeError as exc:
            return str(exc)
        return None

    return misfit


def check_argument_keys(options: Any, fn: Callable[..., Any], skip_self: bool) -> None:
    """Raise ``ValueError`` if a per-argument option names an argument that ``fn`` does
    not have (a name that is not one of its parameters, or a position past its
    positional parameters unless it takes ``*args``/``**kwargs``)."""
    keys = [(what, key) for what in PER_ARGUMENT for key in (getattr(options, what, None) or {})]
    if not keys:
        return
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return  # no signature to check against (a builtin, a C extension)
    kinds = inspect.Parameter
    if skip_self and params and params[0].kind in (kinds.POSITIONAL_ONLY,
                                                   kinds.POSITIONAL_OR_KEYWORD):
        params = params[1:]
    positional = [p.name for p in params
                  if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)]
    named = [p.name for p in params
             if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)]
    var_args = any(p.kind is kinds.VAR_POSITIONAL for p in params)
    var_kwargs = any(p.kind is kinds.VAR_KEYWORD for p in params)
    fn_name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    listed = ", ".join(p.name if p.kind not in (kinds.VAR_POSITIONAL, kinds.VAR_KEYWORD)
                       else ("*" if p.kind is kinds.VAR_POSITIONAL else "**") + p.name
                       for p in params) or "none"
    for what, key in keys:
        if isinstance(key, bool) or not isinstance(key, (str, int)):
            raise ValueError(f"autograph: {what} keys are argument names or positions, "
                             f"got {key!r}")
        if isinstance(key, str):
            if not (key in named or key in positional or var_kwargs):
                raise ValueError(f"autograph: {what} names {key!r}, which is not a "
                                 f"parameter of {fn_name}; its parameters are: {listed}")
        elif key < 0:
            raise ValueError(f"autograph: {what} position {key} is negative; positions count "
                             f"from 0 (the first argument after self)")
        elif key >= len(positional) and not var_args:
            raise ValueError(
                f"autograph: {what} names position {key}, but {fn_name} takes "
                f"{len(positional)} positional argument(s) ({', '.join(positional) or 'none'});"
                f" its parameters are: {listed}")
