"""Run by ``torchrun --nproc-per-node 2`` (see tests/test_ranks.py and tests/gpu): ranks
that graph the same calls with ``group=`` stay in step and equal eager.

    torchrun --nproc-per-node 2 tests/ranks_check.py [cpu|cuda]

On the CPU (gloo) the graphs are the test stand-in's; on GPUs (NCCL), real CUDA graphs
with the collectives captured.  Exits non-zero on any difference; a divergence between
ranks would hang (the caller's timeout catches it).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import autograph  # noqa: E402

D, H = 16, 32


class ParallelMLP(nn.Module):
    """A tensor-parallel MLP: column-parallel up projection, row-parallel down projection,
    one all-reduce (Megatron style)."""

    def __init__(self, up: torch.Tensor, down: torch.Tensor, rank: int, world: int) -> None:
        super().__init__()
        part = H // world
        self.up = nn.Parameter(up[rank * part:(rank + 1) * part].clone())
        self.down = nn.Parameter(down[:, rank * part:(rank + 1) * part].clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(x @ self.up.t()) @ self.down.t()
        dist.all_reduce(y)
        return y


def reference(x: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ up.t()) @ down.t()


def same_on_all_ranks(value: object, what: str) -> None:
    values: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    assert all(v == values[0] for v in values), f"{what} differs across ranks: {values}"


def counts(fn: object) -> tuple[int, int, int, int]:
    s = autograph.stats(fn)
    return s["calls"], s["replays"], s["captures"], s["eager"]


def main() -> None:
    device_kind = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    if device_kind == "cpu":
        from autograph.capture import use_backend
        from tests.standin import StandinBackend

        use_backend(StandinBackend())
        dist.init_process_group("gloo")
        device = torch.device("cpu")
    else:
        dist.init_process_group("nccl")
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(0)
    up = torch.randn(H, D, generator=gen).to(device)
    down = torch.randn(D, H, generator=gen).to(device)
    tol = {"rtol": 1e-4, "atol": 1e-4}

    with torch.no_grad():
        # 1. a tensor-parallel MLP, graphed on every rank, equals the unsharded model
        mlp = autograph.graphed(ParallelMLP(up, down, rank, world).to(device), group=group)
        for _ in range(8):
            x = torch.randn(4, D, generator=gen).to(device)  # the same x on every rank
            torch.testing.assert_close(mlp(x), reference(x, up, down), **tol)
        assert counts(mlp)[1] >= 5, counts(mlp)
        same_on_all_ranks(counts(mlp), "calls, replays, captures, eager of the MLP")

        # 2. one rank's module changes (a new address): the others warm up and capture
        #    again with it instead of replaying while it runs eagerly
        new_up = torch.randn(H, D, generator=gen).to(device)
        part = H // world
        shard = new_up[rank * part:(rank + 1) * part].clone()
        if rank == 0:
            mlp.up.data = shard
        else:
            mlp.up.copy_(shard)
        for _ in range(6):
            x = torch.randn(4, D, generator=gen).to(device)
            torch.testing.assert_close(mlp(x), reference(x, new_up, down), **tol)
        same_on_all_ranks(counts(mlp)[:3], "calls, replays, captures after a change")

        # 3. buckets: different local batch sizes (data-parallel style: the collective
        #    reduces a tensor of fixed size), one bucket for all: the largest batch's
        class Gained(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.lin = nn.Linear(D, D)
                self.gain = nn.Parameter(torch.full((D,), 0.5))

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                g = self.gain.clone()
                dist.all_reduce(g)
                return self.lin(x) * g

        torch.manual_seed(0)
        gained = Gained().to(device)
        bucketed = autograph.graphed(gained, buckets=[2, 4, 8], group=group)
        for step in range(6):
            n = 3 if rank == 0 else 6
            x = torch.randn(n, D, generator=torch.Generator().manual_seed(step)).to(device)
            expect = gained.lin(x) * (gained.gain * world)
            torch.testing.assert_close(bucketed(x), expect, **tol)
        s = autograph.stats(bucketed)
        bucket = 8 if world > 1 else 4  # the bucket of the largest batch of all ranks
        assert list(s["buckets"]) == [bucket], s["buckets"]
        same_on_all_ranks((s["buckets"][bucket]["hits"], s["replays"], s["captures"]),
                          "buckets")

        # 4. calls whose keys differ across ranks run eagerly everywhere
        @autograph.graphed(group=group)
        def spread(x: torch.Tensor) -> torch.Tensor:
            total = x.sum(0)
            dist.all_reduce(total)
            return x + total

        for _ in range(4):
            x = torch.ones(2 + rank, D, device=device)
            torch.testing.assert_close(spread(x), x + float(sum(2 + r for r in range(world))))
        s = autograph.stats(spread)
        if world > 1:  # (a world of one has nobody to disagree with)
            assert s["replays"] == 0 and s["captures"] == 0, s
        same_on_all_ranks(counts(spread), "counts of calls with different keys")

        # 5. a rank that must run eagerly takes the others with it
        @autograph.graphed(group=group)
        def scaled(x: torch.Tensor, extra: object) -> torch.Tensor:
            y = x * 2
            dist.all_reduce(y)
            return y

        for _ in range(4):
            x = torch.ones(3, D, device=device)
            extra = object() if rank == world - 1 else None
            torch.testing.assert_close(scaled(x, extra), x * 2 * world)
        same_on_all_ranks(counts(scaled), "counts when one rank cannot graph")
        assert counts(scaled)[1] == 0

    dist.barrier()
    if rank == 0:
        print(f"ranks_check: {world} ranks on {device_kind}: all agree and equal eager")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
