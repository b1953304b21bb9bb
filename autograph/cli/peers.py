"""The methods the benchmark compares: eager, autograph, a hand-written CUDA graph,
``torch.compile(mode="reduce-overhead")`` and ``torch.cuda.make_graphed_callables``.

Each builder takes a model and one example call and returns a :class:`Method`: a step
callable with the same arguments as the model, and a note for the table (a fallback, a
caveat).  Arguments the model writes in place (a KV cache) are given to every method
exactly as a user of that method would: as call arguments where the method supports
it, closed over where it does not.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from autograph import graphed, stats

METHODS = ("eager", "hand-graph", "autograph", "autograph outputs=reuse",
           "autograph verify_every=1000", "torch.compile", "make_graphed_callables")
VERIFY_EVERY = 1000


@dataclass
class Method:
    """One way to run a step: ``step(*inputs)``, with ``note()`` read after timing."""

    name: str
    step: Callable[..., Any]
    note: Callable[[], str] = field(default=lambda: "")


def build(name: str, model: torch.nn.Module, inputs: Sequence[torch.Tensor],
          persistent: Sequence[torch.Tensor]) -> Method:
    """``model(*inputs, *persistent)`` run by the method ``name``; ``persistent`` are the
    arguments the model writes in place (the method's own copy of them)."""
    return _BUILDERS[name](model, list(inputs), list(persistent))


def _eager(model: Any, inputs: list[torch.Tensor], persistent: list[torch.Tensor]) -> Method:
    return Method("eager", lambda *xs: model(*xs, *persistent))


def _autograph(model: Any, inputs: list[torch.Tensor],
               persistent: list[torch.Tensor], **options: Any) -> Method:
    fast = graphed(model, **options)

    def note() -> str:
        s = stats(fast)
        parts = [f"{s['verifications']} verified replays, {s['verify_failures']} failed"
                 ] if options.get("verify_every") else []
        if options.get("outputs") == "reuse":
            parts.append(f"{s['outputs_protected']} calls protected a held output")
        if s["eager"] > 2:
            parts.append(f"{s['eager']} eager calls: {dict(s['eager_reasons'])}")
        return "; ".join(parts)

    return Method("autograph", lambda *xs: fast(*xs, *persistent), note)


def _verified(model: Any, inputs: list[torch.Tensor], persistent: list[torch.Tensor]) -> Method:
    """autograph with every 1000th replay also run eagerly on copies and compared."""
    method = _autograph(model, inputs, persistent, verify_every=VERIFY_EVERY)
    method.name = f"autograph verify_every={VERIFY_EVERY}"
    return method


def _reuse(model: Any, inputs: list[torch.Tensor], persistent: list[torch.Tensor]) -> Method:
    """autograph handing out the graph's own output tensors (no clone); a call made while
    an earlier output is still held runs eagerly instead (counted in the note)."""
    method = _autograph(model, inputs, persistent, outputs="reuse")
    method.name = "autograph outputs=reuse"
    return method


def _hand(model: Any, inputs: list[torch.Tensor], persistent: list[torch.Tensor]) -> Method:
    """The hand-written reference: warm up on a side stream, capture once, then per step
    copy the inputs in, replay, and clone the output out."""
    static = [x.clone() for x in inputs]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            model(*static, *persistent)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = model(*static, *persistent)

    def step(*xs: torch.Tensor) -> torch.Tensor:
        for dst, src in zip(static, xs):
            dst.copy_(src)
        graph.replay()
        return out.clone()

    hand = Method("hand-graph", step)
    hand.graph = graph  # type: ignore[attr-defined]
    return hand


def _compiled(model: Any, inputs: list[torch.Tensor],
              persistent: list[torch.Tensor]) -> Method:
    torch._dynamo.reset()
    counters = _inductor_counters()
    before = counters.get("cudagraph_skips", 0)
    compiled = torch.compile(model, mode="reduce-overhead")

    def note() -> str:
        skips = counters.get("cudagraph_skips", 0) - before
        if skips:
            return (f"inductor skipped CUDA graphs {skips}x (e.g. mutated inputs): "
                    "runs compiled kernels without graphs")
        return ""

    return Method("torch.compile", lambda *xs: compiled(*xs, *persistent), note)


def _inductor_counters() -> Any:
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # pragma: no cover - torch without dynamo
        return {}
    return counters["inductor"]


def _make_graphed(model: Any, inputs: list[torch.Tensor],
                  persistent: list[torch.Tensor]) -> Method:
    # Always a function: given a module, make_graphed_callables replaces its forward (and
    # the other methods share the module).  It copies every argument into a static input
    # on each call, so arguments written in place are closed over instead.
    def fn(*xs: torch.Tensor) -> Any:
        return model(*xs, *persistent)

    graphed_fn = torch.cuda.make_graphed_callables(fn, tuple(x.clone() for x in inputs))
    return Method("make_graphed_callables", graphed_fn,
                  lambda: "outputs are the graph's own buffers (not cloned)")


_BUILDERS: dict[str, Callable[[Any, list[torch.Tensor], list[torch.Tensor]], Method]] = {
    "eager": _eager,
    "hand-graph": _hand,
    "autograph": _autograph,
    "autograph outputs=reuse": _reuse,
    "autograph verify_every=1000": _verified,
    "torch.compile": _compiled,
    "make_graphed_callables": _make_graphed,
}
