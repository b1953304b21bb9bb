"""Random numbers drawn by another thread while graphs are captured (docs/semantics.md).

The benchmark's MLP is captured at 60 new shapes (a capture each) while a second thread
calls ``torch.randn`` on the GPU, without pause and every 0.5 ms; counts the draws that
failed ("Offset increment outside graph capture") with the generator left out of
captures of calls that draw nothing (``rng_free``, the default) and with it in every
capture (as before).  Needs CUDA.

    PYTHONPATH=. python tools/generator_threads.py
"""

import threading
import time

import torch

import autograph
from autograph import capture
from autograph.cli.models import mlp

_begin = capture._begin


def _always_with_generator(graph, handle, index, rng_free):
    return _begin(graph, handle, index, False)


def trial(label: str, pause: float, captures: int = 60) -> None:
    model = mlp(64, 3).cuda().eval()
    g = autograph.graphed(model, warmup=1)
    stop, failed, drawn = threading.Event(), [0], [0]

    def drawer() -> None:
        while not stop.is_set():
            try:
                torch.randn(256, device="cuda")
                drawn[0] += 1
            except RuntimeError:
                failed[0] += 1
            if pause:
                time.sleep(pause)

    thread = threading.Thread(target=drawer)
    thread.start()
    gen = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    with torch.no_grad():
        for n in range(1, captures + 1):
            x = torch.randn(n, 64, generator=gen).cuda()
            for _ in range(3):
                g(x)
    seconds = time.perf_counter() - start
    stop.set()
    thread.join()
    print(f"{label:22s} pause {pause * 1e3:3.1f} ms: {autograph.stats(g)['captures']} captures, "
          f"{drawn[0]} draws, {failed[0]} failed ({seconds * 1e3 / captures:.2f} ms per key)")


def main() -> None:
    for pause in (0.0, 0.0005):
        for label, begin in (("generator in captures", _always_with_generator),
                             ("rng_free (default)", _begin)):
            capture._begin = begin
            try:
                trial(label, pause)
            finally:
                capture._begin = _begin


if __name__ == "__main__":
    main()
