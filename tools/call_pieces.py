"""The cost of each check on the replay path, one by one (issue 16's profile).

Times, best of 7 in microseconds, every piece a replayed call of a tiny MLP at batch 1
goes through (kill switch, compile probe, nesting, modes and each numerics flag, the
parameter check, the key memo, the capture probe, the stream order, the lock, copy,
replay, clone), so the replay path's cost can be placed piece by piece on the device
it runs on.  Without CUDA it times them on the CPU through the stand-in.

    PYTHONPATH=. python tools/call_pieces.py
"""

import sys
import threading
from pathlib import Path

import torch
from timing import best  # tools/timing.py (tools run as scripts)

import autograph
from autograph import modes as _modes
from autograph import switch
from autograph.cli.models import mlp
from autograph.keys import GraphKey, key_call
from autograph.lifecycle import is_nested

N = 20000


def main():
    cuda = torch.cuda.is_available()
    if not cuda:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from standin import NullBackend

        from autograph.capture import use_backend
        use_backend(NullBackend())
    device = torch.device("cuda:0" if cuda else "cpu")
    model = mlp().to(device).eval()
    g = autograph.graphed(model)
    x = torch.randn(1, 256, device=device)
    rows = {}
    with torch.inference_mode():
        for _ in range(5):
            g(x)
        engine = g._self_engine
        (entry,) = engine.cache.entries.values()
        key = next(iter(engine.cache.entries))
        graph = entry.graph
        static, out = graph.static.buffers[0], graph.build.single_output
        pool = graph.pool
        lock = pool.lock
        order = graph.backend.order_replay
        capturing = engine._device[2]
        parts = key[1]

        def hand():
            static.copy_(x)
            graph.graph.replay()
            return out.clone()

        def locked():
            with lock:
                pass

        rows = {
            "g(x)": lambda: g(x),
            "hand copy+replay+clone": hand,
            "copy_": lambda: static.copy_(x),
            "replay": graph.graph.replay,
            "clone": out.clone,
            "engine(args)": lambda: engine((x,), {}),
            "engine._key": lambda: engine._key((x,), {}),
            "key_call, memo hit": lambda: key_call((x,), {}, _modes.modes, engine.training,
                                                   engine.memo),
            "memo.find": lambda: engine.memo.find((x,)),
            "modes(device)": lambda: _modes.modes(device),
            "watch.ok": engine.watch.ok,
            "watch.training": engine.watch.training,
            "GraphKey + dict get": lambda: engine.cache.entries.get(
                tuple.__new__(GraphKey, (1, parts, (), key[3], key[4], ()))),
            "entry.run(leaves)": lambda: entry.run((x,)),
            "capture probe": capturing,
            "order_replay": lambda: order(device, pool),
            "lock": locked,
            "is_compiling": torch.compiler.is_compiling,
            "kill switch": lambda: (switch._active or switch.env_set()),
            "is_nested": is_nested,
            "functorch probe": torch._C._are_functorch_transforms_active,
            "profiler probe": torch._C._autograd._profiler_enabled,
            "grad enabled": torch.is_grad_enabled,
            "thread ident": threading.get_ident,
        }
        for name in dir(_modes):
            reader = getattr(_modes, name)
            if name.startswith("_") and callable(reader) and name[1:] in (
                    "matmul", "conv", "rnn", "fp16_reduction", "bf16_reduction",
                    "fp16_accumulation", "cudnn_deterministic", "deterministic"):
                rows[f"flag {name[1:]}"] = reader
        for name, fn in rows.items():
            print(f"{name:<26} {best(fn, n=N):7.2f} us", flush=True)


if __name__ == "__main__":
    main()
