"""Issue 12 on real CUDA graphs: aliasing arguments, views out, exceptions, buckets,
tensors read from outside, numerics flags, host randomness, autograd through closures,
regions across threads and generators, re-registered buffers, spectral norm, and a few
real models.  Graphed output equals eager on fresh random inputs; replays happened where
a graph is possible.  Skipped without CUDA."""

from __future__ import annotations

import copy
import random
import threading
import types

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

import autograph

from ..standin import Tally
from ..test_backward import check_checkpointing
from ..test_guards import check_configuration_objects_are_guarded
from ..test_usage import counts, one, replayed  # the CPU file's counting helpers

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

ORIGINAL_CALL = nn.Module.__call__
CALLS = 8
CUDA = "cuda"


def randn(*shape, **kw):
    return torch.randn(*shape, device=CUDA, **kw)


# 1. Arguments that alias each other ---------------------------------------------------


def test_mha_self_attention_with_a_fully_padded_row_equals_eager():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(64, 4, batch_first=True).cuda().eval()
    g = autograph.graphed(mha)
    mask = torch.zeros(3, 7, dtype=torch.bool, device=CUDA)
    mask[1] = True
    mask[0, 4:] = True
    with torch.no_grad():
        for i in range(3 * CALLS):
            x = randn(3, 7, 64)
            args = (x, x, x) if (i // 4) % 2 == 0 else (x, randn(3, 7, 64), randn(3, 7, 64))
            out, _ = g(*args, key_padding_mask=mask, need_weights=False)
            expect, _ = mha(*args, key_padding_mask=mask, need_weights=False)
            torch.testing.assert_close(out, expect, equal_nan=True)
    replayed(g)


def read_write(x, out):
    out.mul_(0.5)
    out.add_(x * 2)
    return out


def test_aliased_and_overlapping_read_and_written_arguments():
    g = autograph.graphed(read_write)
    buf = randn(8)
    ref = buf.clone()
    with torch.no_grad():
        for _ in range(CALLS):  # captured with a separate read argument
            x = randn(4)
            assert g(x, buf[2:6]).data_ptr() == buf[2:6].data_ptr()
            read_write(x, ref[2:6])
            torch.testing.assert_close(buf, ref)
        for _ in range(CALLS):  # overlapping ranges of one storage
            g(buf[:4], buf[2:6])
            read_write(ref[:4], ref[2:6])
            torch.testing.assert_close(buf, ref)
        for _ in range(CALLS):  # the very same tensor
            out = buf[2:6]
            g(out, out)
            r = ref[2:6]
            read_write(r, r)
            torch.testing.assert_close(buf, ref)
    replayed(g)


def test_the_aliasing_pattern_is_part_of_the_key():
    def f(a, b):
        return a * 2 if a is b else a - b

    g = autograph.graphed(f)
    with torch.no_grad():
        for i in range(4 * CALLS):
            x = randn(5)
            y = x if (i // CALLS) % 2 == 0 else randn(5)
            torch.testing.assert_close(g(x, y), f(x, y))
    replayed(g)


# 2. Outputs that are views of arguments ------------------------------------------------

VIEWS = {
    "slice": lambda x: x[1:],
    "transpose": lambda x: x.t(),
    "column": lambda x: x[:, 1],
    "diagonal": lambda x: x.diagonal(),
}


@pytest.mark.parametrize("view", list(VIEWS))
def test_an_output_view_of_a_strided_argument_is_that_view_of_the_callers_tensor(view):
    fn = VIEWS[view]

    def f(x):
        return fn(x), x * 2

    g = autograph.graphed(f)
    with torch.no_grad():
        for _ in range(CALLS):
            base = randn(4, 8)
            x = base[:, ::2]
            out, doubled = g(x)
            expect = fn(x)
            torch.testing.assert_close(out, expect)
            torch.testing.assert_close(doubled, x * 2)
            assert out.stride() == expect.stride() and out.data_ptr() == expect.data_ptr()
            assert out._base is base
            out.fill_(7)
            assert torch.equal(fn(x), torch.full_like(expect, 7))
    replayed(g)


# 3. Exceptions ----------------------------------------------------------------------


@pytest.mark.parametrize("failing", [1, 2, 3])
def test_an_exception_in_warmup_or_capture_propagates_once_and_the_body_runs_once(failing):
    torch.manual_seed(0)
    lin = nn.Linear(32, 32).cuda().eval()
    runs = Tally()

    def f(x):
        if runs.tick() == failing:
            raise ValueError("boom")
        return lin(x)

    g = autograph.graphed(f)
    with torch.no_grad():
        for call in range(1, 3 + CALLS):
            x = randn(4, 32)
            before = runs.n
            if call == failing:
                with pytest.raises(ValueError, match="boom"):
                    g(x)
            else:
                torch.testing.assert_close(g(x), lin(x))
            if call <= 4:
                assert runs.n == before + 1, (call, runs.n)
        torch.randn(1, device=CUDA)  # random numbers still work after it
    replayed(g)


# 4. Buckets -----------------------------------------------------------------------------


def test_buckets_a_later_call_writing_another_argument_updates_the_callers_tensor():
    def f(x, a, b, which):
        (a if which else b).add_(x)
        return x * 2

    g = autograph.graphed(f, buckets=[2, 4, 8])
    a, b = randn(3, 5), randn(3, 5)
    ra, rb = a.clone(), b.clone()
    with torch.no_grad():
        for which in (True, False, True, False):
            for _ in range(CALLS):
                x = randn(3, 5)
                torch.testing.assert_close(g(x, a, b, which), f(x, ra, rb, which))
                torch.testing.assert_close(a, ra)
                torch.testing.assert_close(b, rb)
    replayed(g)


def test_buckets_a_flag_argument_that_switches_on_a_row_mixing_path_later():
    def f(x, mix):
        return x - x.mean(0) if mix else x * 2

    g = autograph.graphed(f, buckets=[2, 4, 8])
    with torch.no_grad():
        for mix in (False, True, False, True):
            for _ in range(CALLS):
                x = randn(3, 5)
                torch.testing.assert_close(g(x, mix), f(x, mix))
    counts(g)


# 5. Tensors read from outside the arguments, parameters and buffers --------------------


class Symmetric(nn.Module):
    def forward(self, w):
        return w.triu() + w.triu(1).transpose(-1, -2)


@pytest.mark.parametrize("update", ["in-place", "new-data"])
def test_parametrize_cached_then_a_weight_update_after_the_block(update):
    torch.manual_seed(0)
    layer = nn.Linear(32, 32).cuda().eval()
    parametrize.register_parametrization(layer, "weight", Symmetric())
    g = autograph.graphed(layer)
    with torch.no_grad():
        with parametrize.cached():
            for _ in range(CALLS):
                x = randn(4, 32)
                torch.testing.assert_close(g(x), layer(x))
        original = layer.parametrizations.weight.original
        if update == "in-place":
            original.mul_(2)
        else:
            original.data = torch.randn_like(original)
        for _ in range(CALLS):
            x = randn(4, 32)
            torch.testing.assert_close(g(x), layer(x))
    counts(g)


G = None


def scale_by_global(x):
    return x * G


def test_a_global_tensor_and_an_object_attribute_replaced_between_calls():
    global G
    cfg = types.SimpleNamespace(scale_tensor=randn(16))

    def by_object(x):
        return x * cfg.scale_tensor

    g, h = autograph.graphed(scale_by_global), autograph.graphed(by_object)
    try:
        G = randn(16)
        with torch.no_grad():
            for _ in range(3):
                for _ in range(CALLS):
                    x = randn(16)
                    torch.testing.assert_close(g(x), scale_by_global(x))
                    torch.testing.assert_close(h(x), by_object(x))
                G = randn(16)
                cfg.scale_tensor = randn(16)
    finally:
        G = None
    replayed(g)
    counts(h)


# 6. Numerics flags ------------------------------------------------------------------


def _differs(a, b, tol):
    return not torch.allclose(a, b, rtol=tol, atol=tol)


def test_cudnn_allow_tf32_toggled_between_calls_of_a_conv_model():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(64, 128, 3, padding=1), nn.Conv2d(128, 64, 3, padding=1))
    m = m.cuda().eval()
    g = autograph.graphed(m)
    tol = 1e-5
    saved = torch.backends.cudnn.allow_tf32
    try:
        with torch.no_grad():
            x = randn(2, 64, 32, 32)
            torch.backends.cudnn.allow_tf32 = True
            tf32 = m(x)
            torch.backends.cudnn.allow_tf32 = False
            if not _differs(tf32, m(x), tol):
                pytest.skip("TF32 convolutions give fp32 results on this GPU")
            for flag in (True, False, True, False):
                torch.backends.cudnn.allow_tf32 = flag
                for _ in range(CALLS):
                    x = randn(2, 64, 32, 32)
                    torch.testing.assert_close(g(x), m(x), rtol=tol, atol=tol)
    finally:
        torch.backends.cudnn.allow_tf32 = saved
    replayed(g)


def test_matmul_allow_tf32_toggled_between_calls():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024)).cuda().eval()
    g = autograph.graphed(m)
    tol = 1e-5
    saved = torch.backends.cuda.matmul.allow_tf32
    try:
        with torch.no_grad():
            for flag in (False, True, False, True):
                torch.backends.cuda.matmul.allow_tf32 = flag
                for _ in range(CALLS):
                    x = randn(16, 1024)
                    torch.testing.assert_close(g(x), m(x), rtol=tol, atol=tol)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    replayed(g)


def test_matmul_fp32_precision_new_api_does_not_raise_and_equals_eager():
    matmul = torch.backends.cuda.matmul
    if not hasattr(matmul, "fp32_precision"):
        pytest.skip("torch.backends.cuda.matmul.fp32_precision is not in this torch")
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024)).cuda().eval()
    g = autograph.graphed(m)
    tol = 1e-5
    saved = matmul.fp32_precision
    try:
        with torch.no_grad():
            for precision in ("tf32", "ieee", "tf32", "ieee"):
                matmul.fp32_precision = precision
                for _ in range(CALLS):
                    x = randn(16, 1024)
                    torch.testing.assert_close(g(x), m(x), rtol=tol, atol=tol)
    finally:
        matmul.fp32_precision = saved
    replayed(g)


def test_fp16_reduced_precision_reduction_toggled_between_calls():
    torch.manual_seed(0)
    m = nn.Linear(8192, 256).cuda().half().eval()
    g = autograph.graphed(m)
    matmul = torch.backends.cuda.matmul
    saved = matmul.allow_fp16_reduced_precision_reduction
    try:
        with torch.no_grad():
            for flag in (True, False, True, False):
                matmul.allow_fp16_reduced_precision_reduction = flag
                for _ in range(CALLS):
                    x = randn(8, 8192, dtype=torch.float16)
                    torch.testing.assert_close(g(x), m(x), rtol=1e-3, atol=1e-3)
    finally:
        matmul.allow_fp16_reduced_precision_reduction = saved
    replayed(g)


def scatter_sum(src, idx):
    out = torch.zeros(64, device=src.device, dtype=src.dtype)
    return out.index_add_(0, idx, src)


def deterministic_aware(x):
    if torch.are_deterministic_algorithms_enabled():
        return x.cumsum(0)
    return x * 3


def test_deterministic_algorithms_toggled_between_calls():
    g, h = autograph.graphed(scatter_sum), autograph.graphed(deterministic_aware)
    saved = (torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled())
    try:
        with torch.no_grad():
            for flag in (False, True, False, True):
                torch.use_deterministic_algorithms(flag)
                for _ in range(CALLS):
                    src = randn(100_000) * 1e3
                    idx = torch.randint(0, 64, (100_000,), device=CUDA)
                    out, expect = g(src, idx), scatter_sum(src, idx)
                    if flag:  # deterministic: exactly eager's sums
                        torch.testing.assert_close(out, expect, rtol=0, atol=0)
                    else:
                        torch.testing.assert_close(out, expect, rtol=1e-4, atol=1e-1)
                    x = randn(6)
                    torch.testing.assert_close(h(x), deterministic_aware(x))
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
    counts(g)
    replayed(h)


def test_default_dtype_changed_between_calls():
    def f(x):
        return x + torch.ones(3, device=x.device)

    g = autograph.graphed(f)
    saved = torch.get_default_dtype()
    try:
        with torch.no_grad():
            for dtype in (torch.float32, torch.float64, torch.float32, torch.float64):
                torch.set_default_dtype(dtype)
                for _ in range(CALLS):
                    x = randn(3, dtype=torch.float32)
                    out, expect = g(x), f(x)
                    assert out.dtype == expect.dtype
                    torch.testing.assert_close(out, expect)
    finally:
        torch.set_default_dtype(saved)
    replayed(g)


# 7. Host randomness -----------------------------------------------------------------


class LayerDrop(nn.Module):
    def __init__(self, source):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(4))
        self.source = source

    def forward(self, x):
        for layer in self.layers:
            r = torch.rand(()) if self.source == "torch" else random.random()
            if r < 0.5:  # a CPU draw decides what runs
                x = layer(x)
        return x


@pytest.mark.parametrize("source", ["torch", "python"])
def test_layerdrop_on_host_random_numbers_equals_eager_under_the_same_seeds(source):
    torch.manual_seed(0)
    m = LayerDrop(source).cuda().eval()
    g = autograph.graphed(m)
    with torch.no_grad():
        for i in range(3 * CALLS):
            x = randn(4, 32)
            torch.manual_seed(i)
            random.seed(i)
            out = g(x)
            torch.manual_seed(i)
            random.seed(i)
            torch.testing.assert_close(out, m(x))
    assert counts(g)["eager"] > 2


# 8. Autograd through tensors that are not parameters ----------------------------------


@pytest.mark.parametrize("where", ["closure", "module-attribute"])
def test_gradient_reaches_a_tensor_that_is_not_a_parameter(where):
    leaf = randn(32, requires_grad=True)
    lin = nn.Linear(32, 32).cuda().requires_grad_(False)
    if where == "closure":
        def f(x):
            return (lin(x) * leaf).tanh()
    else:
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = lin
                self.w = leaf

            def forward(self, x):
                return (self.lin(x) * self.w).tanh()

        f = M()
    g = autograph.graphed(f)
    for _ in range(CALLS):
        x = randn(4, 32)
        leaf.grad = None
        g(x).sum().backward()
        got = leaf.grad.clone()
        leaf.grad = None
        f(x).sum().backward()
        torch.testing.assert_close(got, leaf.grad)
    counts(g)


# 9. Regions across threads and generators -------------------------------------------


def mlp():
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32)).cuda().eval()


def test_a_region_in_a_generator_resumed_on_another_thread():
    model = mlp()
    xs = [randn(2, 32) for _ in range(6)]
    results = []

    def gen():
        with torch.no_grad(), autograph.capture_region():
            for x in xs:
                results.append((x, model(x)))
                yield 1
            yield 2

    it = gen()
    next(it)
    next(it)
    errors = []

    def rest():
        try:
            for _ in it:
                pass
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    t = threading.Thread(target=rest)
    t.start()
    t.join()
    assert not errors, errors
    assert nn.Module.__call__ is ORIGINAL_CALL
    with torch.no_grad():
        for x, out in results:
            torch.testing.assert_close(out, model(x))


def test_regions_on_four_threads_count_only_their_own_calls():
    torch.manual_seed(0)
    model = mlp()
    inputs = [[randn(3, 32) for _ in range(20)] for _ in range(4)]
    regions, errors, pairs = {}, [], []
    start = threading.Barrier(4)

    def worker(k):
        try:
            start.wait()
            with torch.no_grad(), autograph.capture_region() as region:
                regions[k] = region
                for x in inputs[k]:
                    pairs.append((x, model(x)))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert nn.Module.__call__ is ORIGINAL_CALL
    for region in regions.values():
        s = one(region.stats())
        assert s["calls"] == 20 and s["replays"] <= s["calls"], s
    assert counts(model)["replays"] > 0
    with torch.no_grad():
        for x, out in pairs:
            torch.testing.assert_close(out, model(x))


# 10. Smaller ------------------------------------------------------------------------


class Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.register_buffer("n", torch.zeros(()))

    def forward(self, x):
        self.n += 1
        return self.fc(x) * self.n


def test_a_forward_reassigning_its_buffer_after_an_in_place_add_is_graphed():
    torch.manual_seed(0)
    m = Counter().cuda().eval()
    ref = copy.deepcopy(m)
    g = autograph.graphed(m)
    with torch.no_grad():
        for step in range(2 * CALLS):
            x = randn(2, 16)
            torch.testing.assert_close(g(x), ref(x))
            assert m.n.item() == ref.n.item() == step + 1
    replayed(g)


def test_spectral_norm_in_eval_mode_equals_eager():
    torch.manual_seed(0)
    m = nn.utils.parametrizations.spectral_norm(nn.Linear(64, 64)).cuda().eval()
    g = autograph.graphed(m)
    with torch.no_grad():
        for _ in range(2 * CALLS):
            x = randn(4, 64)
            torch.testing.assert_close(g(x), m(x))
    replayed(g)


# Real models --------------------------------------------------------------------------


def test_torchvision_resnet_in_a_region():
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).cuda().eval()
    with torch.no_grad():
        for _ in range(CALLS):
            x = randn(2, 3, 64, 64)
            with autograph.capture_region():
                out = model(x)
            torch.testing.assert_close(out, model(x), rtol=1e-3, atol=1e-3)
    replayed(model)


def test_timm_vit_graphed():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=64,
                              num_classes=10).cuda().eval()
    g = autograph.graphed(model)
    with torch.no_grad():
        for _ in range(CALLS):
            x = randn(2, 3, 64, 64)
            torch.testing.assert_close(g(x), model(x), rtol=1e-3, atol=1e-3)
    replayed(g)


def test_transformers_bert_with_a_fully_padded_row_in_a_region():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=500, hidden_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=128)
    model = transformers.BertModel(config).cuda().eval()
    mask = torch.ones(3, 12, dtype=torch.long, device=CUDA)
    mask[1] = 0
    mask[0, 8:] = 0
    with torch.no_grad():
        for _ in range(CALLS):
            ids = torch.randint(0, 500, (3, 12), device=CUDA)
            with autograph.capture_region():
                out = model(input_ids=ids, attention_mask=mask).last_hidden_state
            expect = model(input_ids=ids, attention_mask=mask).last_hidden_state
            torch.testing.assert_close(out, expect, rtol=1e-3, atol=1e-3, equal_nan=True)
    counts(model)


# Found on the H200 by the exploratory run of 2026-12-01 -------------------------------


def test_a_forward_hook_registered_after_capture_runs_and_removed_gives_graphs_back():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)).cuda().eval()
    g = autograph.graphed(m)
    with torch.no_grad():
        for _ in range(4):
            x = randn(3, 16)
            torch.testing.assert_close(g(x), m(x))
        handle = m[1].register_forward_hook(lambda mod, i, o: o * 0 + 1)
        x = randn(3, 16)
        torch.testing.assert_close(g(x), m(x))
        handle.remove()
        before = autograph.stats(g)["replays"]
        for _ in range(3):
            x = randn(3, 16)
            torch.testing.assert_close(g(x), m(x))
    s = counts(g)
    assert s["eager_reasons"].get("hooks") == 1 and s["replays"] == before + 3, s


@pytest.mark.parametrize("p", [0.0, 0.3])
def test_activation_checkpointing_with_and_without_dropout_gradients_equal_eager(p):
    check_checkpointing(p, CUDA, CALLS)


def test_autocast_alternating_with_eager_calls_in_the_block_replays():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 8)).cuda()
    g = autograph.graphed(m)
    with torch.no_grad():
        for i in range(4 * CALLS):
            x = randn(4, 64)
            with torch.autocast(CUDA, dtype=torch.bfloat16, enabled=bool(i % 2)):
                want = m(x)
                got = g(x)
            assert got.dtype == want.dtype
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    s = replayed(g)
    assert s["invalidations"] == 0, s


def test_outputs_sharing_a_storage_share_it_after_a_replay_too():
    def f(x):
        y = x * 2
        return y, y, y[1:], y.t(), x + 1

    g = autograph.graphed(f)
    with torch.no_grad():
        for _ in range(CALLS):
            x = randn(3, 3)
            got, expect = g(x), f(x)
            torch.testing.assert_close(got, expect)
            a, b, c, d, _ = got
            assert a is b and c.data_ptr() == a[1:].data_ptr() and d.data_ptr() == a.data_ptr()
            a.fill_(5)
            assert (c == 5).all() and (d == 5).all()
    replayed(g)


@pytest.mark.parametrize("change", ["config", "dataclass", "dataclass flag", "none"])
def test_configuration_objects_are_guarded(change):
    check_configuration_objects_are_guarded(change, "cuda")
