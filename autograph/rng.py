"""Whether a call sets the device's random generator, seen on the generator itself.

A graph's replays draw on from where the device's generator stands (CUDA registers the
generator's state with the graph and advances its offset by the graph's draws on each
replay).  A call that sets the generator on its own (``torch.manual_seed`` inside it,
a state it saved and restores between two draws, ``Generator.set_state``) draws the
same numbers again in eager mode, and other numbers from a graph; setting the seed a
generator already has is even allowed inside a CUDA capture.  The setters are reached
under many names (``from torch.random import ...``, a generator's own methods), so what
is watched is the generator: its seed and position before and after each warmup
(:func:`move`) and between the random operators of a learning warmup
(:func:`went_back`, called by ``mutation.WriteRecorder``).  Such a call runs eagerly
(``EagerReason.RNG_SET``).
"""

from __future__ import annotations

import collections
import enum
import itertools
import random
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from . import coderefs
from .reach import Reach

SETS = "seen before one of its random operators"
RESETS = "it draws the same numbers on every call"


class Mark(NamedTuple):
    """Where a generator stands: its seed and position (the Philox offset of a CUDA
    generator, an int; the whole state where there is no offset: the CPU stand-in)."""

    seed: int
    position: Any


class Move(enum.Enum):
    """What a warmup did to the generator."""

    STILL = "still"  # the same seed and position after as before
    DREW = "drew"  # moved forward
    SET = "set"  # another seed, or a position behind the one before


def generator(device: torch.device) -> torch.Generator | None:
    """The default generator random operators on ``device`` draw from, or None."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]  # type: ignore[no-any-return]
    if device.type == "cpu":  # the stand-in's device
        return torch.default_generator
    return None


def mark(gen: torch.Generator | None) -> Mark | None:
    """Where ``gen`` stands now (None for no generator)."""
    if gen is None:
        return None
    if gen.device.type == "cpu" or not hasattr(gen, "get_offset"):  # no offset
        return Mark(gen.initial_seed(), bytes(gen.get_state().numpy()))
    return Mark(gen.initial_seed(), gen.get_offset())


def move(before: Mark | None, after: Mark | None) -> Move:
    """What happened to the generator between two marks around a call."""
    if before is None or after is None or before == after:
        return Move.STILL
    if before.seed != after.seed or (
            type(before.position) is int and after.position < before.position):
        return Move.SET
    return Move.DREW


def went_back(before: Mark, after: Mark) -> bool:
    """Whether the generator was set between two marks: another seed, or a position
    behind the one before (on a generator without offsets: any other state, since
    only the call's random operators move it between two of them)."""
    if before.seed != after.seed:
        return True
    if type(before.position) is int:
        return after.position < before.position  # type: ignore[no-any-return]
    return after.position != before.position  # type: ignore[no-any-return]


# -- host generators --------------------------------------------------------------------
def host_generators(reach: Reach, modules: Any, arguments: Any = ()) -> tuple[Any, ...]:
    """The host generator objects a call reaches by name, whose draws may decide what
    it runs (``self.rng.random() < eps`` with a ``random.Random`` or a numpy
    ``Generator``; a CPU ``torch.Generator``): those held by the watched ``modules``
    (as attributes, or two containers or plain objects down, as class attributes of
    their user classes), by the graphed method's object (its attributes, and deeper
    under the names its code uses), among the ``arguments``, bound by a
    ``functools.partial`` or as a default argument, and named (or held by a namespace or
    a user's class named) as globals or closure cells by the function's code, the
    user's functions it names, or a module's ``forward`` (``reach``); three levels down
    from all but the modules.  The global streams are read by ``lifecycle`` itself."""
    return reached_by(reach, modules, arguments, _host_generator)


def torch_generators(reach: Reach, modules: Any, arguments: Any = ()
                     ) -> tuple[torch.Generator, ...]:
    """The ``torch.Generator`` objects of any device a call reaches, where
    :func:`host_generators` looks (the padding check puts back what its extra runs draw
    from them)."""
    return reached_by(reach, modules, arguments, _torch_generator)


def _torch_generator(value: Any) -> bool:
    return isinstance(value, torch.Generator)


def reached_by(reach: Reach, modules: Any, arguments: Any, wanted: Callable[[Any], bool]
               ) -> tuple[Any, ...]:
    """The objects for which ``wanted`` holds among those :func:`host_generators` reads."""
    found: dict[int, Any] = {}
    budget = [_READ]  # values read in all: a huge container costs the warmup little

    def add(values: Any, depth: int = 3) -> None:
        for v in itertools.islice(values, _SCANNED):
            budget[0] -= 1
            if budget[0] < 0:
                return
            if wanted(v):
                found.setdefault(id(v), v)
            elif depth and isinstance(v, (list, tuple, collections.deque)):
                add(v, depth - 1)
            elif depth and isinstance(v, dict):
                add(v.values(), depth - 1)
            elif depth and (coderefs._namespace(v) or coderefs.slotted(v)):
                add(coderefs.attributes(v).values(), depth - 1)

    for m in modules:
        add(vars(m).values(), depth=2)
        for klass in type(m).__mro__:
            if coderefs._user_class(klass):
                add(vars(klass).values(), depth=0)
    add(v for _, v in reach.bound)
    if reach.owner is not None:
        # its own attributes (``explore(self)`` reads them in a helper), and deeper what
        # the method and the methods of its class it calls name (not a data loader's
        # generator a prefetching thread draws from)
        add(vars(reach.owner).values(), depth=0)
        add(v for _, v in reach.owner_named)
    add(arguments)
    for named in reach.named:
        add((named.value,))
        if isinstance(named.value, type) and coderefs._user_class(named.value):
            add(vars(named.value).values(), depth=1)  # a user's class: its attributes
    return tuple(found.values())


_SCANNED = 64  # the items host_generators reads of one container
_READ = 4096  # the values host_generators reads in all


def host_state(gens: tuple[Any, ...]) -> tuple[Any, ...]:
    """Where each of ``gens`` (:func:`host_generators`) stands, comparable with ``==``."""
    return tuple(_frozen(_state_of(g)) for g in gens)


def _host_generator(value: Any) -> bool:
    if isinstance(value, random.Random):
        return type(value).getstate is not random.SystemRandom.getstate
    if isinstance(value, torch.Generator):
        return value.device.type == "cpu"
    np = sys.modules.get("numpy")
    return np is not None and isinstance(
        value, (np.random.Generator, np.random.RandomState, np.random.BitGenerator))


def _state_of(gen: Any) -> Any:
    if isinstance(gen, random.Random):
        return gen.getstate()
    if isinstance(gen, torch.Generator):
        return bytes(gen.get_state().numpy())
    if hasattr(gen, "bit_generator"):  # numpy Generator
        return gen.bit_generator.state
    if hasattr(gen, "get_state"):  # numpy RandomState
        return gen.get_state(legacy=False)
    return gen.state  # numpy BitGenerator


def _frozen(value: Any) -> Any:
    """``value`` with its dicts as sorted tuples and its arrays as bytes (a numpy state
    holds arrays, whose ``==`` has no plain truth value)."""
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    if isinstance(value, (tuple, list)):
        return tuple(_frozen(v) for v in value)
    tobytes = getattr(value, "tobytes", None)
    return tobytes() if callable(tobytes) else value

