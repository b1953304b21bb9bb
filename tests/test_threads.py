"""Calls from several threads are correct and get separate outputs."""

import threading

import pytest
import torch
from torch import nn

import autograph

pytestmark = pytest.mark.usefixtures("standin")


def test_many_threads_one_module_several_shapes():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8))
    g = autograph.graphed(model, warmup=1)
    errors = []
    outputs = {}

    def worker(tid):
        gen = torch.Generator().manual_seed(tid)
        try:
            with torch.no_grad():
                for step in range(25):
                    x = torch.randn(1 + (tid + step) % 3, 8, generator=gen)
                    out = g(x)
                    outputs[(tid, step)] = (x, out)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    with torch.no_grad():
        for x, out in outputs.values():
            torch.testing.assert_close(out, model(x))
    ptrs = {out.data_ptr() for _, out in outputs.values()}
    assert len(ptrs) == len(outputs)  # nobody shares an output buffer
    s = autograph.stats(g)
    assert s["calls"] == 200 and s["graphs"] == 3 and s["replays"] > 150


class _Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(3, 3)

    def forward(self, x):
        y = self.l(x)
        return y + torch.ones(x.shape[0], 1) if self.training else y


@pytest.mark.parametrize("change", ["train", "default_dtype"])
def test_a_flag_changed_by_another_thread_during_a_capture_drops_that_graph(
        standin, monkeypatch, change):
    """Another thread calls ``model.train()`` or ``torch.set_default_dtype`` while a
    call is captured (here: inside the capture itself) and sets it back: the graph may
    have baked in either, so it is dropped and the next call captures again; every
    call equals eager (the graph kept the training branch, or float64 outputs)."""
    model = _Branchy().eval()
    g = autograph.graphed(model, warmup=1)
    original = standin.capture
    flipped = []

    def capture(device, fn, *args, **kwargs):
        def racing():
            if not flipped:  # once: the other thread's change, mid-capture
                flipped.append(True)
                if change == "train":
                    model.train()
                else:
                    torch.set_default_dtype(torch.float64)
            return fn()
        try:
            return original(device, racing, *args, **kwargs)
        finally:
            if change == "train":  # set back at once: the flag reads as at the key
                model.eval()

    monkeypatch.setattr(standin, "capture", capture)
    x = torch.randn(2, 3)
    with torch.no_grad():
        for _ in range(5):
            got = g(x)
            torch.set_default_dtype(torch.float32)  # set back after the capture ended
            with autograph.disabled():
                want = model(x)
            assert got.dtype == want.dtype
            torch.testing.assert_close(got, want)
    assert autograph.stats(g)["replays"] >= 2, autograph.stats(g)


def test_threads_writing_their_own_caches_get_their_own_graphs(standin):
    """Two threads, each with its own cache written in place by one graphed function:
    the first to learn that the key writes its argument moved the shared entry to its
    cache's address, and the other thread's capture filled that entry with a graph
    writing its own cache (both threads' caches then went wrong).  Each address gets
    an entry of its own; a capture of an entry moved away runs eagerly."""
    import time

    first = threading.Event()

    def f(x, cache):
        if threading.current_thread().name == "A" and not first.is_set():
            first.set()
            time.sleep(0.3)  # thread B keys its call meanwhile
        cache.mul_(0.5).add_(x)
        return cache.sum(0)

    g = autograph.graphed(f, warmup=0)
    caches = {n: (torch.zeros(2, 4), torch.zeros(2, 4)) for n in "AB"}
    bad = []

    def worker(name):
        gen = torch.Generator().manual_seed(ord(name))
        mine, theirs = caches[name]
        if name == "B":
            first.wait()
        for i in range(6):
            x = torch.randn(2, 4, generator=gen)
            got, want = g(x, mine), f(x, theirs)
            if not torch.equal(mine, theirs) or not torch.equal(got, want):
                bad.append((name, i))
            mine.copy_(theirs)
            time.sleep(0.05)

    with torch.no_grad():
        threads = [threading.Thread(target=worker, args=(n,), name=n) for n in "AB"]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    s = autograph.stats(g)
    assert not bad, bad
    assert s["captures"] == 2 and s["replays"] >= 6, s


class _Logged(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(16, 16) for _ in range(10)])
        self.history = []  # a log another thread writes; the forward never reads it

    def forward(self, x):
        return torch.tanh(self.layers(x))


def test_other_threads_changes_to_a_module_list_are_kept(standin):
    """Another thread appending to a list the module holds while a call is captured:
    none of its items is lost (a capture that saw the list change put back what it
    held, erasing the other thread's appends); the call's results equal eager's."""
    net = _Logged().eval()
    g = autograph.graphed(net)
    go, stop, appended = threading.Event(), threading.Event(), [0]
    running = threading.Event()

    def append():
        go.wait()
        while not stop.is_set():
            net.history.append(appended[0])
            appended[0] += 1
            running.set()

    t = threading.Thread(target=append)
    t.start()
    try:
        with torch.no_grad():
            for step in range(6):
                x = torch.randn(4, 16)
                if step == 2:  # the appends under way before the call (on CI's two
                    go.set()  # cores the thread ran only after stop, at times)
                    running.wait(10)
                out = g(x)
                if step == 3:
                    stop.set()
                with autograph.disabled():
                    torch.testing.assert_close(out, net(x))
    finally:
        go.set()
        stop.set()
        t.join()
    assert len(net.history) == appended[0] > 0


def test_the_padding_check_hands_no_thread_a_number_twice(standin):
    """A bucketed sampling step beside a thread drawing random numbers: the padding
    check sets no generator state back while other threads run (it handed the other
    thread numbers it had drawn already)."""
    torch.manual_seed(0)
    weight = torch.randn(16, 50)

    @autograph.graphed(buckets=[2, 4, 8, 16, 32, 64])
    def sample(h):
        return torch.multinomial(torch.softmax(h @ weight, -1), 1).squeeze(-1)

    stop, draws = threading.Event(), []

    def draw():
        while not stop.is_set():
            draws.append(tuple(torch.rand(4).tolist()))

    t = threading.Thread(target=draw)
    t.start()
    try:
        gen = torch.Generator().manual_seed(3)
        with torch.inference_mode():
            for step in range(20):
                sample(torch.randn(1 + (step * 7) % 60, 16, generator=gen))
    finally:
        stop.set()
        t.join()
    assert len(draws) == len(set(draws)) > 0


class _ResetsDuring(nn.Module):
    """Calls ``during()`` in its forward: a ``reset()`` made while its call is captured,
    as another thread's reset lands mid-capture."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.during = lambda: None

    def forward(self, x):
        self.during()
        return torch.tanh(self.lin(x))


def test_a_reset_during_a_capture_leaves_no_graph_counted(standin):
    """A ``reset()`` that lands while a call is captured (another thread's): the graph
    captured into the entry the reset dropped is not kept (it was counted in
    ``graphs`` and ``graph_memory_bytes`` and never forgotten)."""
    net = _ResetsDuring().eval()
    g = autograph.graphed(net, warmup=1)
    with torch.no_grad():
        x = torch.randn(2, 16)
        g(x)  # the warmup
        net.__dict__["during"] = g.reset  # the capture's call resets (not an assignment)
        torch.testing.assert_close(g(x), torch.tanh(net.lin(x)))
        net.__dict__["during"] = lambda: None
    s = autograph.stats(g)
    assert s["graphs"] == 0 and s["graph_memory_bytes"] == 0, s
    with torch.no_grad():
        for _ in range(4):
            torch.testing.assert_close(g(x), torch.tanh(net.lin(x)))
    assert autograph.stats(g)["replays"] >= 1


def test_a_call_waiting_on_a_worker_threads_graphed_call_does_not_hang(standin, monkeypatch):
    """A graphed call whose Python hands a graphed branch to a thread pool and waits
    for it hung on its first call: its warmup held the capture lock the worker's warmup
    waited for.  The worker runs eagerly after ``LOCK_WAIT``, the waiting call is
    given up (eager), and the branch graphs in the worker from then on."""
    from concurrent.futures import ThreadPoolExecutor

    from autograph import lifecycle

    monkeypatch.setattr(lifecycle, "LOCK_WAIT", 0.2)
    lin = torch.nn.Linear(4, 4)
    branch = autograph.graphed(lin)
    with ThreadPoolExecutor(1) as pool:
        def step(x):
            return torch.relu(x) + pool.submit(branch, x).result()

        g = autograph.graphed(step)
        done = threading.Event()
        failures = []

        def calls():
            try:
                with torch.no_grad():
                    for _ in range(8):
                        x = torch.randn(2, 4)
                        torch.testing.assert_close(g(x), torch.relu(x) + lin(x))
            except Exception as exc:  # noqa: BLE001 - reported below
                failures.append(exc)
            done.set()

        threading.Thread(target=calls, daemon=True).start()
        assert done.wait(60), "the graphed call hung"
    assert not failures, failures
    assert autograph.stats(branch)["replays"] >= 2, autograph.stats(branch)


def check_a_worker_replaying_while_a_waiting_call_holds_the_lock_does_not_spin(
        device="cpu"):
    """A worker's replay of a captured key with output variants found none free and
    tried to capture one while the waiting caller's warmup held the capture lock: the
    busy lock changed nothing and the loop tried again for ever.  It clones instead."""
    @autograph.graphed
    def branch(x):
        return x.sin() + 1

    for _ in range(4):  # warmups, the capture, a replay (grad mode on: no copy kept)
        held = branch(torch.randn(3, device=device))

    def in_a_worker(x):  # (daemon threads: a spinning one does not block the exit)
        out = []
        worker = threading.Thread(target=lambda: out.append(branch(x)), daemon=True)
        worker.start()
        worker.join()
        return out[0]

    g = autograph.graphed(lambda x: in_a_worker(x) * 2)
    done, failures = threading.Event(), []

    def call():
        try:
            x = torch.randn(3, device=device)
            torch.testing.assert_close(g(x), (x.sin() + 1) * 2)
        except Exception as exc:  # noqa: BLE001 - reported below
            failures.append(exc)
        done.set()

    threading.Thread(target=call, daemon=True).start()
    assert done.wait(30), "the worker's replay spun"
    assert not failures and held is not None, failures


def test_a_worker_replaying_while_a_waiting_call_holds_the_lock_does_not_spin(standin):
    check_a_worker_replaying_while_a_waiting_call_holds_the_lock_does_not_spin()


def test_a_graph_dropped_by_another_thread_during_a_replay(standin):
    """Another thread's ``reset`` (or a region's new options) dropped the entry's graph
    between its replay and the engine reading it: a held output (``outputs="reuse"``)
    raised ``AttributeError: 'NoneType' object has no attribute 'held_reason'``."""
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh())
    g = autograph.graphed(model, outputs="reuse", warmup=0)
    with torch.no_grad():
        kept = [g(torch.randn(3, 6)) for _ in range(3)]  # held: the next replay is refused
        (entry,) = g._self_engine.cache.entries.values()
        run = entry.run

        def dropped_meanwhile(leaves):
            entry.graph = None  # as cache.forget_graph does on another thread
            return run(leaves)

        entry.run = dropped_meanwhile
        x = torch.randn(3, 6)
        torch.testing.assert_close(g(x), model(x))
    assert kept[0] is not None
