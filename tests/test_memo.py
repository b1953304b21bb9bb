"""The key memo (memo.py): a call it recognises gets the very key the full path gives."""

import random

import pytest
import torch

import autograph
from autograph import memo as memo_module
from autograph.keys import key_call
from autograph.memo import KeyMemo
from autograph.modes import modes

pytestmark = pytest.mark.skipif(memo_module._TensorGuards is None,
                                reason="this torch has no TensorGuards: the memo is off")


def variants(rng):
    """Tensors that differ from one another in exactly what a key holds, or in nothing
    it holds (storage offsets, values)."""
    base = torch.randn(4, 6)
    pick = rng.randrange(18)
    if pick == 0:
        return base
    if pick == 1:
        return base.t()
    if pick == 2:
        return torch.randn(6, 4)
    if pick == 3:
        return base.double()
    if pick == 4:
        return base.clone().requires_grad_()
    if pick == 5:
        return torch.nn.Parameter(base.clone())
    if pick == 6:
        return base[1:]  # a storage offset and another shape
    if pick == 7:
        return torch.randn(5, 6)[1:]  # another storage offset, the same geometry as base
    if pick == 8:
        return base[:, :1].expand(4, 6)  # zero strides
    if pick == 9:
        return torch.randn(2, 3, 2, 2).to(memory_format=torch.channels_last)
    if pick == 10:
        return torch.randn(2, 3, 2, 2)
    if pick == 11:
        return torch.tensor(1.5)
    if pick == 17:
        return torch.randn(1, 6).t()
    if pick == 12:
        return torch.empty(0, 6)
    if pick == 13:  # size-1 dimensions of other strides: keyed alike below 4 dimensions
        return torch.randn(1, 7 + rng.randrange(3))[:, -6:]
    if pick == 14:
        return torch.randn(1, 6)
    if pick == 15:  # ... and apart at 4 (N1HW with C's stride 1 is channels_last)
        return torch.randn(2, 1, 2, 2).to(memory_format=torch.channels_last)
    if pick == 16:
        return torch.randn(2, 1, 2, 2)
    with torch.inference_mode():
        return torch.randn(4, 6)


@pytest.mark.parametrize("seed", range(20))
def test_a_remembered_key_is_the_full_paths_key(seed):
    rng = random.Random(seed)
    memo = KeyMemo()
    training = lambda: None  # noqa: E731
    hits = 0
    for _ in range(150):
        args = tuple(variants(rng) for _ in range(rng.randrange(1, 4)))
        if rng.random() < 0.3:
            args = (*args, args[0])  # the same tensor twice: aliasing is read per call
        known = memo.find(args) if memo.recent else None
        hits += known is not None
        got = key_call(args, {}, modes, training, memo)
        want = key_call(args, {}, modes, training)
        assert got[0] == want[0] and got[2] == want[2]
        assert list(got[1].leaves) == list(want[1].leaves)
        assert got[1].tensor_pos == want[1].tensor_pos
    assert hits > 0


def test_in_place_changes_of_an_argument_are_seen():
    """The same tensor object, changed in place between calls (``resize_``, ``t_``,
    ``.data =``, ``requires_grad_``): each call gets the key of what it is now."""
    memo = KeyMemo()
    x = torch.randn(3, 4)

    def same_key():
        got = key_call((x,), {}, modes, lambda: None, memo)[0]
        return got == key_call((x,), {}, modes, lambda: None)[0]

    for change in (lambda: x.t_(), lambda: x.resize_(5, 2), lambda: x.unsqueeze_(0),
                   lambda: setattr(x, "data", torch.randn(2, 2, dtype=torch.float64)),
                   lambda: x.requires_grad_()):
        assert same_key() and same_key()  # learned, then found
        change()
        assert same_key()


def test_graphed_calls_with_in_place_resized_arguments_equal_eager(standin):
    lin = torch.nn.Linear(4, 4)
    g = autograph.graphed(lin)
    x = torch.randn(2, 4)
    with torch.no_grad():
        for shape in [(2, 4)] * 4 + [(3, 4)] * 4 + [(2, 4)] * 2:
            x.resize_(*shape).normal_()
            torch.testing.assert_close(g(x), lin(x))
    assert autograph.stats(g)["replays"] >= 3


def check_last_tokens_of_a_growing_sequence_replay(device="cpu"):
    """A hand-written decode loop feeding ``ids[:, -1:]`` of a growing batch-1 sequence:
    its stride ``(L, 1)`` changed at every step, so each step keyed anew and nothing
    replayed.  Strides of size-1 dimensions of contiguous tensors below 4 dimensions are
    keyed as the contiguous ones where at least those; the results, and the layouts
    of a conv on an ``N1HW`` input, on a non-contiguous 3-d argument made 4-d inside
    the call and of a pool of a transposed (1, L, C) of batch stride C, equal eager's."""
    emb = torch.nn.Embedding(50, 8).to(device)
    g = autograph.graphed(emb)
    ids = torch.randint(0, 50, (1, 3), device=device)
    with torch.no_grad():
        for _ in range(10):
            last = ids[:, -1:]
            torch.testing.assert_close(g(last), emb(last), rtol=0, atol=0)
            ids = torch.cat([ids, torch.randint(0, 50, (1, 1), device=device)], 1)
    s = autograph.stats(g)
    assert s["replays"] >= 6 and s["graphs"] == 1, s
    conv = torch.nn.Conv2d(1, 4, 3).to(device)
    c = autograph.graphed(conv)
    with torch.no_grad():
        for i in range(14):
            x = torch.randn(2, 1, 6, 6, device=device)
            if i % 2:
                x = x.to(memory_format=torch.channels_last)  # only C's stride differs
            got, want = c(x), conv(x)
            torch.testing.assert_close(got, want)
            assert got.stride() == want.stride()
    assert autograph.stats(c)["replays"] >= 4, autograph.stats(c)
    # a non-contiguous 3-d argument made 4-d inside: the batch stride decides
    # channels_last there, so it stays keyed
    weight = torch.randn(4, 5, 1, 3, device=device)
    f = autograph.graphed(lambda x: torch.nn.functional.conv2d(x.unsqueeze(2), weight))
    with torch.no_grad():
        for i in range(12):
            base = torch.randn(1, 6, 5, device=device).transpose(1, 2)  # (1, 5, 6)
            x = base if i % 2 else base[:, :, :6].as_strided((1, 5, 6), (5, 1, 5))
            got, want = f(x), torch.nn.functional.conv2d(x.unsqueeze(2), weight)
            torch.testing.assert_close(got, want)
            assert got.stride() == want.stride()
    assert autograph.stats(f)["replays"] >= 4, autograph.stats(f)
    # a contiguous (1, L, C) whose batch stride is C (from a transpose) pools in
    # another layout once transposed inside: a size-1 stride below the contiguous one
    # stays keyed
    p = autograph.graphed(lambda x: torch.nn.functional.avg_pool1d(x.transpose(1, 2), 2))
    with torch.no_grad():
        for i in range(12):
            x = torch.randn(4, 1, 3, device=device).transpose(0, 1) if i % 2 else \
                torch.randn(1, 4, 3, device=device)
            got = p(x)
            want = torch.nn.functional.avg_pool1d(x.transpose(1, 2), 2)
            torch.testing.assert_close(got, want)
            assert got.stride() == want.stride()
    assert autograph.stats(p)["replays"] >= 4, autograph.stats(p)
    # the last step of a sequence-first hidden state, (2, 1, 3) of strides (3, 6, 1),
    # permuted and pooled inside: a size-1 dimension after another stays keyed
    q = autograph.graphed(
        lambda x: torch.nn.functional.max_pool2d(x.permute(1, 2, 0).unsqueeze(2), 1))
    with torch.no_grad():
        for i in range(12):
            x = torch.randn(2, 2, 3, device=device).transpose(0, 1)[:, -1:] if i % 2 \
                else torch.randn(2, 1, 3, device=device)
            got = q(x)
            want = torch.nn.functional.max_pool2d(x.permute(1, 2, 0).unsqueeze(2), 1)
            torch.testing.assert_close(got, want)
            assert got.stride() == want.stride()
    assert autograph.stats(q)["replays"] >= 4, autograph.stats(q)


def test_last_tokens_of_a_growing_sequence_replay(standin):
    check_last_tokens_of_a_growing_sequence_replay()
