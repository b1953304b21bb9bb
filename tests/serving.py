"""A continuous-batching decode step over a slot-based KV cache, and its serving loop.

The design the buckets serve (issue 16): every live sequence owns a slot of a static
KV cache; a step takes the live sequences' last tokens, their slot ids and positions,
writes each row's key and value at ``cache[slot, pos]`` and attends over its own slot.
The batch changes size every step as requests join and finish.  Padded rows are given
the slot ``DUMMY`` (``pad_values``), so they write their junk there and nowhere else,
which ``pad_writes`` declares.  Shared by the CPU test and the CUDA one.
"""

from __future__ import annotations

import random

import torch
from torch import nn

SLOTS = 8  # real slots
DUMMY = SLOTS  # one more slot, where padded rows write
POSITIONS = 12
BUCKETS = [2, 4, 8]


class SlotDecoder(nn.Module):
    """One decode step: ``cache[slot_ids, pos] = k`` style scatter, attention per slot."""

    def __init__(self, vocab: int = 50, d: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.out = nn.Linear(d, vocab)
        self.scale = d ** -0.5

    def forward(self, tokens: torch.Tensor, slot_ids: torch.Tensor, pos: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)  # (B, d)
        k_cache[slot_ids, pos] = self.k(h)  # index_put_: each row into its slot
        v_cache[slot_ids, pos] = self.v(h)
        keys, values = k_cache[slot_ids], v_cache[slot_ids]  # (B, T, d): own slot only
        scores = torch.einsum("bd,btd->bt", self.q(h), keys) * self.scale
        seen = torch.arange(keys.shape[1], device=pos.device)[None, :] <= pos[:, None]
        att = scores.masked_fill(~seen, float("-inf")).softmax(-1)
        return self.out(torch.einsum("bt,btd->bd", att, values))


def new_cache(model: SlotDecoder, device: str | torch.device) -> list[torch.Tensor]:
    d = model.q.in_features
    return [torch.zeros(SLOTS + 1, POSITIONS, d, device=device) for _ in range(2)]


def schedule(steps: int, seed: int = 0) -> list[list[tuple[int, int]]]:
    """Per step, the live (slot, position) pairs: requests join free slots and finish
    after a random length, so the batch size wanders over 1..SLOTS."""
    rng = random.Random(seed)
    live: dict[int, int] = {}  # slot -> next position
    lengths: dict[int, int] = {}
    out = []
    for _ in range(steps):
        for slot in [s for s in live if live[s] >= lengths[s]]:
            del live[slot]
        free = [s for s in range(SLOTS) if s not in live]
        rng.shuffle(free)
        for slot in free[: rng.choice((0, 1, 1, 2, 3))]:
            live[slot], lengths[slot] = 0, rng.randint(1, 5)
        if not live:
            slot = free[0]
            live[slot], lengths[slot] = 0, POSITIONS
        out.append(sorted(live.items()))
        for slot in live:
            live[slot] += 1
    return out


def warm(step, model: SlotDecoder, device: str | torch.device) -> list[torch.Tensor]:
    """``autograph.warmup`` every bucket before serving, on the cache serving will use
    (its graphs are keyed by the cache's address), which is then cleared."""
    import autograph

    cache = new_cache(model, device)
    n = BUCKETS[-1]
    with torch.inference_mode():
        reports = autograph.warmup(step, torch.zeros(n, dtype=torch.long, device=device),
                                   torch.arange(n, device=device),
                                   torch.zeros(n, dtype=torch.long, device=device), *cache)
        for c in cache:
            c.zero_()
    assert all(r["captured"] for r in reports), reports
    return cache


def serve(step, reference, model: SlotDecoder, device: str | torch.device, steps: int = 60,
          atol: float = 1e-5, cache: list[torch.Tensor] | None = None
          ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Run the serving loop through ``step`` (positional calls) and ``reference`` (eager),
    each on its own cache; check every step's logits, then return both caches."""
    cache = cache if cache is not None else new_cache(model, device)
    ref_cache = new_cache(model, device)
    gen = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for live in schedule(steps):
            n = len(live)
            tokens = torch.randint(0, model.emb.num_embeddings, (n,), generator=gen).to(device)
            slot_ids = torch.tensor([s for s, _ in live], device=device)
            pos = torch.tensor([p for _, p in live], device=device)
            got = step(tokens, slot_ids, pos, *cache)
            want = reference(tokens, slot_ids, pos, *ref_cache)
            assert got.shape == want.shape == (n, model.emb.num_embeddings)
            torch.testing.assert_close(got, want, rtol=atol, atol=atol)
    return cache, ref_cache


def assert_same_outside_dummy(cache: list[torch.Tensor], ref: list[torch.Tensor]) -> None:
    for got, want in zip(cache, ref):
        torch.testing.assert_close(got[:DUMMY], want[:DUMMY], rtol=1e-5, atol=1e-5)
