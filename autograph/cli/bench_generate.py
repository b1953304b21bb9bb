"""The transformers workload of ``python -m autograph bench``: ``generate()`` with a
static cache on a Llama-shaped model built from a config (random weights, nothing is
downloaded), greedy, eager against ``autograph.graphed(model).generate`` and against
transformers' own compiled static-cache path (``generate`` without
``disable_compile``, which compiles the forward with ``mode="reduce-overhead"``).

Per method: the first generate (set-up, capture or compilation included), then the
median milliseconds per new token (a whole generate, prefill included, divided by the
new tokens) over rounds interleaved across methods, and the tokens compared with
eager's.  Skipped, with a note, where transformers is not installed.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import autograph

from .cells import ratio


@dataclass
class GenerateRow:
    """One method's generate: per-token median, first generate, tokens as eager's."""

    method: str
    ms_per_token: float | None
    first_ms: float | None
    tokens_equal: bool | None
    note: str = ""


def available() -> str | None:
    """None if the workload can run here, else why not."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        import transformers  # noqa: F401
    except ImportError:
        return "transformers is not installed (pip install transformers)"
    return None


def build_model(layers: int = 4, hidden: int = 512) -> Any:
    """A Llama-shaped causal LM from a config, fp16 on the GPU, no EOS (fixed length)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 4,
                      num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                      num_key_value_heads=max(1, hidden // 128), max_position_embeddings=2048)
    model = LlamaForCausalLM(cfg).to(device="cuda", dtype=torch.float16)  # type: ignore[call-arg]
    model.eval()
    model.generation_config.eos_token_id = model.config.eos_token_id = None
    return model


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - start


def bench_generate(new_tokens: int = 128, rounds: int = 5, batch: int = 1, layers: int = 4,
                   hidden: int = 512, compiled: bool = True,
                   progress: Callable[[str], None] = lambda _: None) -> list[GenerateRow]:
    """Eager, autograph and (with ``compiled``) transformers' compiled path, each a
    generate of ``new_tokens`` greedy tokens from a 16-token prompt."""
    model = build_model(layers, hidden)
    ids = torch.randint(3, 32000, (batch, 16), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(0))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
              pad_token_id=0, cache_implementation="static")
    fast = autograph.graphed(model)
    methods: dict[str, Callable[[], Any]] = {
        "eager": lambda: model.generate(ids, **kw, disable_compile=True),
        "autograph": lambda: fast.generate(ids, **kw, disable_compile=True),
    }
    if compiled:
        methods["transformers compiled"] = lambda: model.generate(ids, **kw)
    rows: dict[str, GenerateRow] = {}
    reference = None
    with torch.inference_mode():
        for name, fn in methods.items():
            progress(f"generate: {name}: first generate")
            try:
                out, first = _timed(fn)
            except Exception as exc:  # noqa: BLE001 - a path that cannot run is reported
                rows[name] = GenerateRow(name, None, None, None, f"failed: {type(exc).__name__}")
                continue
            reference = out if reference is None else reference
            rows[name] = GenerateRow(name, None, first * 1e3, bool(torch.equal(out, reference)))
        ready = {n: fn for n, fn in methods.items() if rows[n].first_ms is not None}
        progress(f"generate: timing {', '.join(ready)}")
        samples: dict[str, list[float]] = {n: [] for n in ready}
        for _ in range(rounds):
            for name, fn in ready.items():
                out, seconds = _timed(fn)
                samples[name].append(seconds)
                if reference is not None and not torch.equal(out, reference):
                    rows[name].tokens_equal = False
    for name, s in samples.items():
        rows[name].ms_per_token = statistics.median(s) / new_tokens * 1e3
    stats = autograph.stats(fast)
    rows["autograph"].note = (f"{stats['replays']} replays of {stats['calls']} calls, "
                              f"{stats['captures']} captures")
    return list(rows.values())


def format_generate(rows: list[GenerateRow], title: str) -> str:
    head = (f"{title:<34} {'ms/token':>9} {'eager/x':>8} {'first generate ms':>18} "
            f"{'tokens':>10}  note")
    lines = [head, "-" * len(head)]
    eager = rows[0].ms_per_token if rows else None
    for r in rows:
        t = r.ms_per_token
        tokens = "-" if r.tokens_equal is None else ("as eager" if r.tokens_equal else "DIFFER")
        lines.append(f"{r.method:<34} {t if t is not None else float('nan'):>9.3f} "
                     f"{ratio(eager, t):>8} "
                     f"{r.first_ms if r.first_ms is not None else float('nan'):>18.1f} "
                     f"{tokens:>10}  {r.note}".rstrip())
    return "\n".join(lines)
