"""Ranks that never diverge: agreement on what each call does, across a process group.

With ``graphed(..., group=pg)`` every call of the callable first agrees with the other
ranks of ``pg`` (one small all-reduce): each rank proposes what it would do, and all do
the least advanced of the proposals, in the order eager < warm up < capture < replay.
So a rank that must run eagerly (a failed capture, an unkeyable argument) makes all
ranks run eagerly; a rank that lost its graph (its module changed) makes the others
warm up and capture again with it; and ranks whose calls have different keys run
eagerly.  Collectives inside the graph then always meet their peers: no rank replays a
graph while another runs the same step eagerly.  With buckets, the batch size is
agreed first (the largest of the ranks'), so every rank pads to the same bucket.

The agreement runs on the host (``channels``), so it launches nothing on the GPU and
never waits for the GPU: while the GPU runs the previous steps, the hosts agree on the
next one.  It cannot be skipped in steady state: a rank's state can change between two
calls (its module changed, a capture failed) where the others cannot see it, and since
no rank may replay a step that another runs eagerly, every rank must hear from every
other before each call.  Destroying the group drops the graphs first (``shutdown``);
calls made with a destroyed group run eagerly.

Every rank must make the same graphed calls in the same order (as tensor-parallel
ranks do), and the kill switch must be set alike on all ranks.
"""

from __future__ import annotations

import logging
from typing import Any

from .channels import _channel
from .shutdown import _live, install
from .vocab import Action, logger

NAMES = {Action.EAGER: "eager", Action.WARM: "warm up", Action.CAPTURE: "capture",
         Action.REPLAY: "replay"}


class Ranks:
    """The agreement of one graphed callable's calls across ``group``."""

    def __init__(self, group: Any) -> None:
        import torch.distributed as dist

        install()
        self.dist = dist
        self.group: Any = group
        self.step = 0
        self.alone = dist.get_world_size(group) == 1  # nobody to agree with: no collective
        self.closed = False  # the group was destroyed: calls run eagerly
        self.keys_differ = False  # at the last agreement
        self._channel: Any = None
        self._warned: set[tuple[Action, Action]] = set()
        _live.add(self)

    def rank(self) -> int:
        return -1 if self.closed else int(self.dist.get_rank(self.group))

    def close(self) -> None:
        """The group is gone: hold it no longer (nor its channel); calls run eagerly."""
        self.closed = True
        self.group = self._channel = None

    def _reduce_max(self, values: list[int]) -> list[int]:
        channel = self._channel
        if channel is None:
            channel = self._channel = _channel(self.group)
        return list(channel.reduce_max(values))

    def agree(self, action: Action, key_digest: int, name: str) -> Action:
        """The action every rank takes for this call (one all-reduce on the host)."""
        self.step += 1
        if self.closed:
            return Action.EAGER
        if self.alone:
            return action
        neg_action, low, high = self._reduce_max([-int(action), -key_digest, key_digest])
        self.keys_differ = -low != high
        agreed = Action.EAGER if self.keys_differ else Action(-neg_action)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("%s: rank %d step %d: graph %016x, proposed %s, agreed %s", name,
                         self.rank(), self.step, key_digest,
                         NAMES[action], NAMES[agreed])
        if agreed != action and (action, agreed) not in self._warned:
            self._warned.add((action, agreed))
            logger.warning("%s: rank %d step %d: would %s graph %016x, but the ranks agree "
                           "on %s%s", name, self.rank(), self.step,
                           NAMES[action], key_digest, NAMES[agreed],
                           " (their keys differ)" if self.keys_differ else "")
        return agreed

    def agree_batch(self, rows: int, learning: bool) -> tuple[int, bool]:
        """The largest batch size of the ranks' calls (0 if a rank is not bucketing),
        and whether any rank is learning its arguments (then none pads)."""
        if self.alone or self.closed:
            return rows, learning
        low, high, anyone = self._reduce_max([-rows, rows, int(learning)])
        return (0 if -low == 0 else high), bool(anyone)
