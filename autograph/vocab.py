"""The words every part of autograph speaks: entry states, rank actions, eager reasons.

This module imports nothing of the package, so every other module can import it.
Eager reasons are a bounded vocabulary (:class:`EagerReason`, short identifiers that
are safe as Prometheus label values); what varies per occurrence (a batch size, an
exception's message, a type name) travels beside it as free-text *detail*.
"""

from __future__ import annotations

import enum
import inspect
import logging

logger = logging.getLogger("autograph")


class State(enum.Enum):
    """Where one key of one callable stands."""

    WARMING = "warming"  # running eagerly on the capture stream until it is captured
    READY = "ready"  # captured: calls replay the graph
    EAGER = "eager"  # runs eagerly for good, for ``Entry.reason``


class Action(enum.IntEnum):
    """What a call does; ordered, so ranks agree on the least advanced proposal."""

    EAGER = 0
    WARM = 1
    CAPTURE = 2
    REPLAY = 3


class EagerReason(enum.Enum):
    """Why a call ran eagerly.  ``value`` is a short identifier, ``message`` the text
    a person reads (``stats()``'s ``eager_details`` adds the occurrence's detail)."""

    WARMUP = "warmup"
    LEARNING = "learning"
    IN_PLACE = "in_place"
    DISABLED = "disabled"
    NESTED = "nested"
    CAPTURING = "capturing"
    NO_TENSORS = "no_tensors"
    DEVICE = "device"
    SEVERAL_DEVICES = "several_devices"
    UNKEYABLE = "unkeyable_argument"
    HOOKS = "hooks"
    AUTOGRAD = "autograd"
    ASSIGNS = "assigns_attribute"
    HOST_RANDOM = "host_random"
    RNG_STATE = "reads_rng_state"
    RNG_SET = "sets_rng_state"
    OUTPUT = "unsupported_output"
    CAPTURE_FAILED = "capture_failed"
    REPLAY_FAILED = "replay_failed"
    MEMORY = "over_memory_budget"
    NOT_WORTH = "not_worth"
    BUCKET_MISS = "bucket_miss"
    RANKS_DISAGREE = "ranks_disagree"
    RANKS_BEHIND = "ranks_behind"
    VERIFY_FAILED = "verify_failed"
    GIVEN_UP = "given_up"
    OUTPUTS_HELD = "outputs_held"
    BACKWARD_UNSUPPORTED = "backward_unsupported"
    BACKWARD_PENDING = "backward_pending"
    BAD_ARGUMENTS = "bad_arguments"

    @property
    def message(self) -> str:
        return _MESSAGES[self]

    def __str__(self) -> str:
        return self.value


_MESSAGES = {
    EagerReason.WARMUP: "warming up a new key before its capture",
    EagerReason.LEARNING: "learning which arguments carry the batch",
    EagerReason.IN_PLACE: "argument written in place: capturing it at its address",
    EagerReason.DISABLED: "graphs are disabled (AUTOGRAPH_DISABLE or autograph.disabled())",
    EagerReason.NESTED: "called inside another graphed call's warmup or capture",
    EagerReason.CAPTURING: "called while the current stream is capturing",
    EagerReason.NO_TENSORS: "no tensor arguments",
    EagerReason.DEVICE: "inputs not on a device that can be graphed",
    EagerReason.SEVERAL_DEVICES: "tensor arguments on several devices",
    EagerReason.UNKEYABLE: "an argument, or a tensor the code reads, cannot be keyed",
    EagerReason.HOOKS: "module hooks would not replay",
    EagerReason.AUTOGRAD: "autograd would record this call and it is not graphed for "
                          "training (backward=False, or group=; use torch.no_grad())",
    EagerReason.ASSIGNS: "the forward assigns an attribute (of a module or an argument object)",
    EagerReason.HOST_RANDOM: "the forward draws host random numbers to decide what to run",
    EagerReason.RNG_STATE: "the forward reads the generator's state and draws random "
                           "numbers (activation checkpointing): a graph would keep the "
                           "state it read",
    EagerReason.RNG_SET: "the forward sets the generator's seed or state (torch.manual_seed, "
                         "a saved state restored): a graph's replays would draw on",
    EagerReason.OUTPUT: "an output cannot be handed back safely",
    EagerReason.CAPTURE_FAILED: "capture failed",
    EagerReason.REPLAY_FAILED: "replay failed",
    EagerReason.MEMORY: "graph needs more than max_graph_memory",
    EagerReason.NOT_WORTH: "graph not faster than eager by min_speedup",
    EagerReason.BUCKET_MISS: "batch larger than the largest bucket",
    EagerReason.RANKS_DISAGREE: "ranks disagree on this call's key: every rank runs it eagerly",
    EagerReason.RANKS_BEHIND: "another rank runs this call eagerly",
    EagerReason.VERIFY_FAILED: "a verified replay differed from eager",
    EagerReason.GIVEN_UP: "graphs do not pay for this callable: it runs eagerly until "
                          "autograph.reset()",
    EagerReason.OUTPUTS_HELD: "an earlier call's output is still held (outputs='reuse'): "
                              "running eagerly so that it is not overwritten",
    EagerReason.BACKWARD_UNSUPPORTED: "autograd records this call in a way a backward "
                                      "graph cannot replay",
    EagerReason.BACKWARD_PENDING: "an earlier call's backward has not run yet and what "
                                  "it saved cannot be spilled: a replay would overwrite it",
    EagerReason.BAD_ARGUMENTS: "the arguments do not fit the parameters: the call raised "
                               "TypeError, as in eager mode",
}

# Reasons that are steps on the way to a graph, not problems, or that the caller sees
# anyway (the TypeError of a call whose arguments do not fit): never logged as warnings.
QUIET = frozenset({EagerReason.WARMUP, EagerReason.LEARNING, EagerReason.IN_PLACE,
                   EagerReason.DISABLED, EagerReason.OUTPUTS_HELD, EagerReason.BAD_ARGUMENTS})


class Uncapturable(Exception):
    """A call that must run eagerly, with its reason and an optional detail."""

    def __init__(self, reason: EagerReason, detail: str = "") -> None:
        super().__init__(f"{reason.message}: {detail}" if detail else reason.message)
        self.reason = reason
        self.detail = detail


# details of eager reasons the engine gives (dispatch.py)
IN_TRANSFORM = ("called inside a torch.func transform (vmap, grad, jacrev, functionalize) "
                "or a forward-mode AD level (dual_level)")
INFERENCE_ARGUMENT = "an argument is an inference tensor (made under torch.inference_mode)"
HOOKS_DISABLED = ("saved-tensor hooks are disabled (disable_saved_tensors_hooks): a "
                  "training graph's capture saves its tensors through one")
SAVED_HOOKS = ("saved-tensor hooks are active (torch.autograd.graph.saved_tensors_hooks, "
               "save_on_cpu): a graph would save its tensors without them")


def deferred_body(fn: object) -> str | None:
    """What kind of function ``fn`` is if its body runs after the call returns (a
    generator or an async function: outside a graph, or a region, entered around the
    call), else None."""
    call = fn if inspect.isroutine(fn) or not callable(fn) else type(fn).__call__
    for f in (fn, call):  # a callable object: its class's __call__
        kind = ("an async generator function" if inspect.isasyncgenfunction(f) else
                "a generator function" if inspect.isgeneratorfunction(f) else
                "an async function" if inspect.iscoroutinefunction(f) else None)
        if kind is not None:
            return kind
    return None
