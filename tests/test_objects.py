"""Arguments that are objects holding tensors (objects.py), and graphed(model)'s own
methods (generate), on the CPU stand-in; transformers tests skip without it."""

import copy
import dataclasses
import gc
import weakref
from collections import OrderedDict

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

import autograph
from autograph.keys import key_call
from autograph.modes import modes
from autograph.objects import ObjectKey

pytestmark = pytest.mark.usefixtures("standin")


class KV:
    """A cache shaped like transformers' StaticLayer: device tensors written in place,
    a device counter, a flag and a length."""

    def __init__(self, n=8, d=4):
        self.keys = torch.zeros(n, d)
        self.length = torch.zeros((), dtype=torch.long)
        self.is_initialized = True
        self.max_len = n


class Step(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, cache):
        pos = torch.arange(x.shape[0], device=x.device) + cache.length
        cache.keys.index_copy_(0, pos, self.fc(x))
        cache.length.add_(x.shape[0])
        return cache.keys.sum(0), cache


def _key(*args, **kwargs):
    return key_call(args, kwargs, modes, lambda: None)[0]


def test_object_key_by_structure_address_and_scalars():
    a, b = KV(), KV()
    ka, kb = _key(torch.ones(1), a), _key(torch.ones(1), b)
    assert isinstance(ka.leaves[1], ObjectKey)
    assert ka != kb  # other addresses
    assert ka == _key(torch.ones(1), a)
    a.max_len = 9
    assert ka != _key(torch.ones(1), a)  # a scalar, by value
    assert ka.digest() == kb.digest()  # addresses left out of the portable digest


def test_cache_object_replays_and_writes_the_callers_cache():
    model = Step()
    g = autograph.graphed(model)
    eager_cache, cache = KV(), KV()
    with torch.no_grad():
        for _ in range(6):
            x = torch.randn(1, 4)
            want, _ = model(x, eager_cache)
            got, back = g(x, cache)
            assert back is cache
            torch.testing.assert_close(got, want)
            torch.testing.assert_close(cache.keys, eager_cache.keys)
            assert int(cache.length) == int(eager_cache.length)
    s = autograph.stats(g)
    assert s["captures"] == 1 and s["replays"] == 3, s


def test_lazy_allocation_runs_eagerly_then_the_initialized_cache_is_graphed():
    class Lazy:
        def __init__(self):
            self.keys = None
            self.length = torch.zeros((), dtype=torch.long)

    class M(nn.Module):
        def forward(self, x, cache):
            if cache.keys is None:
                cache.keys = torch.zeros(8, 4)  # allocated on first use
            cache.keys.index_copy_(0, torch.arange(1) + cache.length, x)
            cache.length.add_(1)
            return cache.keys * 2

    m = M()
    g = autograph.graphed(m)
    ce, cg = Lazy(), Lazy()
    with torch.no_grad():
        for _ in range(7):
            x = torch.randn(1, 4)
            torch.testing.assert_close(g(x, cg), m(x, ce))
    s = autograph.stats(g)
    assert s["captures"] == 1 and s["replays"] >= 3, s


def test_rebinding_a_scalar_every_call_runs_eagerly_with_the_attribute_named():
    @dataclasses.dataclass
    class State:
        t: torch.Tensor
        step: int = 0

    @autograph.graphed(warmup=1)
    def f(x, state):
        state.step += 1
        return x + state.t * state.step

    state, ref = State(torch.ones(2)), State(torch.ones(2))
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(2)
            ref.step += 1
            torch.testing.assert_close(f(x, state), x + ref.t * ref.step)
    assert state.step == 4
    s = autograph.stats(f)
    assert s["captures"] == 0 and s["eager"] == 4


def test_unkeyable_nested_value_names_its_path():
    class Holder:
        def __init__(self):
            self.items = {1, 2}

    @autograph.graphed
    def f(x, h):
        return x + len(h.items)

    with torch.no_grad():
        f(torch.ones(1), Holder())
    details = autograph.stats(f)["eager_details"]["unkeyable_argument"]
    assert any("Holder.items" in d for d in details), details


def test_graphed_module_graphs_the_calls_its_own_methods_make():
    class Predictor(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x)

        def predict(self, x, steps):
            for _ in range(steps):
                x = self(x).tanh()
            return x

    m = Predictor()
    g = autograph.graphed(m)
    with torch.no_grad():
        x = torch.randn(2, 4)
        torch.testing.assert_close(g.predict(x, 6), m.predict(x, 6))
    s = autograph.stats(g)
    assert s["calls"] == 6 and s["replays"] == 3, s
    assert g.state_dict().keys() == m.state_dict().keys()  # nn.Module's own API unwrapped


@dataclasses.dataclass
class _Record(OrderedDict):
    """A ModelOutput-like record: a dataclass and an OrderedDict of its non-None fields."""

    out: torch.Tensor | None = None
    extra: torch.Tensor | None = None
    derived: torch.Tensor | None = None

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if getattr(self, f.name) is not None:
                OrderedDict.__setitem__(self, f.name, getattr(self, f.name))


class _Derived(_Record):
    """Sets an attribute from its items: not a plain record (pytree rebuilds it)."""

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "total", self["out"].sum())


@dataclasses.dataclass
class _Passing(OrderedDict):
    """A record that passes an object argument through (``past_key_values``)."""

    out: torch.Tensor | None = None
    holder: object = None

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if getattr(self, f.name) is not None:
                OrderedDict.__setitem__(self, f.name, getattr(self, f.name))


for _cls in (_Record, _Derived, _Passing):
    pytree.register_pytree_node(
        _cls, lambda r: (list(r.values()), list(r.keys())),
        lambda values, keys, cls=_cls: cls(**dict(zip(keys, values))),
        serialized_type_name=f"test_objects.{_cls.__name__}")


@pytest.mark.parametrize("cls", [_Record, _Derived])
def test_record_outputs_are_rebuilt_as_pytree_would(cls, monkeypatch):
    """A dataclass-OrderedDict output (transformers' ModelOutput) is made on replay
    without its __init__ only where it is nothing but its items; else through pytree."""
    lin = nn.Linear(4, 4)
    unflatten, rebuilt = pytree.tree_unflatten, []

    def counted(values, spec):
        rebuilt.append(spec.type)
        return unflatten(values, spec)

    def f(x):
        y = lin(x)
        return cls(out=y, extra=y * 2)

    g = autograph.graphed(f)
    with torch.no_grad():
        for i in range(6):
            if i == 3:  # captured: from here on replays
                monkeypatch.setattr(pytree, "tree_unflatten", counted)
            x = torch.randn(2, 4)
            got, want = g(x), f(x)
            assert type(got) is cls and list(got.keys()) == ["out", "extra"]
            torch.testing.assert_close(got.out, want.out)
            torch.testing.assert_close(got["extra"], want.extra)
            assert got.derived is None and got.__dict__.keys() == want.__dict__.keys()
            if cls is _Derived:
                torch.testing.assert_close(got.total, want.total)
    assert autograph.stats(g)["replays"] == 3
    assert rebuilt.count(cls) == (3 if cls is _Derived else 0)


_CACHE = torch.zeros(2, 4)


class _Holder:
    """An object argument holding a tensor the call writes (a cache; a new view of one
    storage, so that every holder keys alike)."""

    def __init__(self):
        self.t = _CACHE[:]


def test_a_graph_keeps_no_object_argument_of_its_capture_alive(standin):
    """A record output that passes an object argument through (a ModelOutput's
    ``past_key_values``) keeps no reference to the capture's object: transformers makes
    a new cache per ``generate()``, and a graph holding the old one would keep its
    memory (and its addresses) for ever."""
    lin = nn.Linear(4, 4)

    def f(x, holder):
        holder.t.add_(lin(x))
        return _Passing(out=holder.t * 2, holder=holder)

    g = autograph.graphed(f)
    refs = []
    with torch.no_grad():
        for _ in range(4):  # warm up, capture, replay on new objects each time
            holder = _Holder()
            x = torch.randn(2, 4)
            want = (_CACHE + lin(x)) * 2
            got = g(x, holder)
            assert got.holder is holder and got["holder"] is holder
            torch.testing.assert_close(got.out, want)
            refs.append(weakref.ref(holder))
            del holder, got
    gc.collect()
    s = autograph.stats(g)
    assert s["captures"] == 1 and s["replays"] >= 1, s
    assert [r() for r in refs] == [None] * 4


class _Kv:
    """A cache object of its own memory (each one at other addresses)."""

    def __init__(self, rows=2):
        self.k = torch.zeros(rows, 4)
        self.steps = 3


def test_a_new_object_of_a_captured_structure_is_captured_after_one_warmup():
    """A key whose object argument has the structure of one already captured, at other
    addresses, is captured after the one warmup that learns what the call does to it
    (objects of known types, transformers' caches, at their first call): its replays
    write the new object, never the old one; another structure warms up fully."""
    lin = nn.Linear(4, 4)

    def f(x, kv):
        kv.k.add_(lin(x))
        return kv.k * 2

    g = autograph.graphed(f)
    kept = []
    with torch.no_grad():
        for n in range(3):
            kv = _Kv()
            kept.append(kv)  # alive: the next object cannot take its addresses
            want = torch.zeros(2, 4)
            before = dict(autograph.stats(g))
            for _ in range(4):
                x = torch.randn(2, 4)
                want += lin(x)
                torch.testing.assert_close(g(x, kv), want * 2)
            torch.testing.assert_close(kv.k, want)
            s = autograph.stats(g)
            warmups = s["eager_reasons"].get("warmup", 0) - before.get(
                "eager_reasons", {}).get("warmup", 0)
            assert s["captures"] - before.get("captures", 0) == 1, s
            assert warmups == (2 if n == 0 else 1), s
            assert s["replays"] - before.get("replays", 0) == (1 if n == 0 else 2), s
        for kv, old in zip(kept, [k.k.clone() for k in kept]):
            torch.testing.assert_close(kv.k, old)  # written by its own calls only
        before = dict(autograph.stats(g))
        g(torch.randn(3, 4), _Kv(rows=3))  # another structure: a warmup
        assert autograph.stats(g)["eager_reasons"]["warmup"] == \
            before["eager_reasons"]["warmup"] + 1
        autograph.reset(g)  # forgets the structures too: a new object warms up again
        before = dict(autograph.stats(g))
        kept.append(_Kv())
        g(torch.randn(2, 4), kept[-1])
        s = autograph.stats(g)
        assert s["captures"] == before["captures"], s
        assert s["eager_reasons"]["warmup"] == before["eager_reasons"]["warmup"] + 1, s


def _run_both(f, calls):
    """``calls`` (a list of argument tuples, made fresh per run by the callable given)
    run eagerly and through ``graphed``: outputs and the objects' final states."""
    results = []
    for fn in (f, autograph.graphed(f)):
        args_list = calls()
        with torch.no_grad():
            outs = [fn(*args) for args in args_list]
        results.append((outs, args_list))
    return results


def test_state_kept_per_object_at_its_first_call_is_made_eagerly():
    """Code may keep state of its own per object (a first call that snapshots, counts or
    initializes it): a new object of a captured structure still gets its warmup (the
    first call runs eagerly), so such a first call is never captured or run twice."""
    import weakref as _weakref

    class Kv:
        def __init__(self, gen=0):
            self.k = torch.zeros(4)
            self.gen = gen

    def cases():
        snap = _weakref.WeakKeyDictionary()
        inited = _weakref.WeakSet()
        tracked = _weakref.WeakSet()

        def snapshot(x, kv):
            if kv not in snap:
                snap[kv] = kv.k + 0
            kv.k.add_(x)
            return kv.k - snap[kv]

        def init_once(x, kv):
            if kv not in inited:
                inited.add(kv)
                kv.k.fill_(1.0)
                kv.gen += 1
            kv.k.add_(x)
            return kv.k * 1

        def counted(x, kv):
            if kv in tracked:
                kv.gen += 1
            kv.k.add_(x)
            return kv.k * 2

        return [(snapshot, None), (init_once, None), (counted, tracked)]

    for index in range(3):
        runs = []
        for graphed_run in (False, True):
            f, tracked = cases()[index]
            fn = autograph.graphed(f) if graphed_run else f
            a, b = Kv(), Kv(1)
            if tracked is not None:
                tracked.add(b)
            with torch.no_grad():
                outs = [fn(torch.ones(4), a) for _ in range(4)]
                outs += [fn(torch.ones(4), b) for _ in range(4)]
            runs.append((outs, a.k.clone(), b.k.clone(), a.gen, b.gen))
        (want, *want_state), (got, *got_state) = runs
        for w, g_ in zip(want, got):
            assert torch.equal(w, g_), (index, want, got)
        for w, g_ in zip(want_state, got_state):
            assert (torch.equal(w, g_) if isinstance(w, torch.Tensor) else w == g_), index


def test_an_object_with_a_host_tensor_next_to_device_work_always_warms_up():
    """Its host tensor's value is not in the key and may steer the call's Python: a new
    object of its structure is warmed up as any new key (``recording._learned``)."""
    from autograph.cache import GraphCache
    from autograph.keys import GraphKey
    from autograph.objects import ObjectTensor
    from autograph.options import Options
    from autograph.recording import _learned
    from autograph.stats import Stats

    def key(version):
        t = ObjectTensor(torch.Size([]), (), torch.int64, torch.device("cpu"), 64, version)
        part = ObjectKey(_Kv, ("attrs",), (t,), 1)
        return GraphKey(1, (part,), (), (), None)

    cache = GraphCache(Options(), Stats("f"))
    _learned(cache, key(3))
    assert not cache.shapes
    _learned(cache, key(None))
    assert cache.shapes == {key(None).unaddressed(): False}  # no known type: one warmup


transformers = pytest.importorskip("transformers")


def _tiny(kind):
    torch.manual_seed(0)
    common = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)
    if kind == "llama":
        cfg = transformers.LlamaConfig(intermediate_size=64, num_key_value_heads=2,
                                       max_position_embeddings=128, **common)
        return transformers.LlamaForCausalLM(cfg).eval()
    if kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4,
                                      n_positions=128)
        return transformers.GPT2LMHeadModel(cfg).eval()
    cfg = transformers.Qwen2Config(intermediate_size=64, num_key_value_heads=2,
                                   max_position_embeddings=128, **common)
    return transformers.Qwen2ForCausalLM(cfg).eval()


def check_a_forward_returning_a_dynamic_cache(kind="llama", device="cpu"):
    """``model(ids)`` of a causal LM in eval returns a new ``DynamicCache`` (``use_cache``
    on): the call replays (it ran eagerly: the cache is no pytree), the logits and every
    cache tensor equal eager's, and decoding on from the returned cache works."""
    model = _tiny(kind).to(device)
    g = autograph.graphed(model)
    with torch.no_grad():
        for _ in range(6):
            ids = torch.randint(1, 96, (2, 7), device=device)
            with autograph.disabled():
                want = model(ids)
            got = g(ids)
            # (on CUDA a graph's kernels may round otherwise than the eager run's)
            torch.testing.assert_close(got.logits, want.logits)
            cache, expect = got.past_key_values, want.past_key_values
            assert type(cache) is type(expect) and len(cache.layers) == len(expect.layers)
            for a, b in zip(cache.layers, expect.layers):
                assert type(a) is type(b) and vars(a).keys() == vars(b).keys()
                torch.testing.assert_close(a.keys, b.keys)
                torch.testing.assert_close(a.values, b.values)
            step = want.logits[:, -1:].argmax(-1)
            with autograph.disabled():
                on = model(step, past_key_values=cache).logits
                ref = model(step, past_key_values=expect).logits
            torch.testing.assert_close(on, ref)
    s = autograph.stats(g)
    assert s["replays"] >= 3, (s["eager_reasons"], s["eager_details"])


def check_training_a_model_that_returns_a_dynamic_cache(device="cpu"):
    """Training a causal LM with its default ``use_cache`` (the forward returns a new
    ``DynamicCache``, which ran eagerly): forward and backward graphs replay, losses
    and gradients equal eager's, and the cache's tensors have their autograd history
    (a grad-on ``eval()`` call replays too)."""
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4,
                                  n_positions=128, resid_pdrop=0.0, embd_pdrop=0.0,
                                  attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg).to(device).train()
    twin = copy.deepcopy(model)
    g = autograph.graphed(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, twin)]
    for _ in range(6):
        ids = torch.randint(1, 96, (2, 9), device=device)
        got, want = g(ids, labels=ids), twin(ids, labels=ids)
        torch.testing.assert_close(got.loss, want.loss)
        layer = got.past_key_values.layers[0]
        assert layer.keys.requires_grad and layer.keys.grad_fn is not None
        got.loss.backward()
        want.loss.backward()
        for p, q in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    s = autograph.stats(g)
    assert s["replays"] >= 3 and s["backward_replays"] >= 3, s
    model.eval()
    twin.eval()
    for _ in range(5):
        ids = torch.randint(1, 96, (2, 9), device=device)
        got, want = g(ids), twin(ids)
        torch.testing.assert_close(got.logits, want.logits)
    assert autograph.stats(g)["replays"] >= s["replays"] + 2


def test_training_a_model_that_returns_a_dynamic_cache():
    check_training_a_model_that_returns_a_dynamic_cache()


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_a_forward_returning_a_dynamic_cache(kind):
    check_a_forward_returning_a_dynamic_cache(kind)


@pytest.mark.parametrize("kind", ["llama", "gpt2", "qwen2"])
@pytest.mark.parametrize("batch", [1, 3])
def test_generate_with_a_static_cache_in_a_region(kind, batch):
    model = _tiny(kind)
    ids = torch.randint(1, 96, (batch, 5))
    mask = torch.ones(batch, 5, dtype=torch.long)
    if batch > 1:
        mask[0, :2] = 0  # left padding
    kw = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0,
              cache_implementation="static", disable_compile=True)
    want = model.generate(ids, **kw)
    with autograph.capture_region() as region:
        got = model.generate(ids, **kw)
    assert torch.equal(got, want)
    (s,) = region.stats().values()
    assert s["calls"] == 10 and s["captures"] == 1 and s["replays"] == 6, s


def test_graphed_model_generate_is_graphed():
    model = _tiny("llama")
    ids = torch.randint(1, 96, (1, 4))
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0,
              cache_implementation="static", disable_compile=True)
    want = model.generate(ids, **kw)
    g = autograph.graphed(model)
    assert torch.equal(g.generate(ids, **kw), want)
    s = autograph.stats(g)
    assert s["calls"] == 8 and s["replays"] == 4, s


def test_one_static_cache_reset_between_generates_replays_across_them():
    """A cache passed to every generate (reset between them) keeps its addresses: the
    later generates replay their decode steps without capturing them again, and the
    prefill too once it has repeated (usage.md); each generate's own new cache would be
    captured anew."""
    model = _tiny("llama")
    model.generation_config.eos_token_id = model.config.eos_token_id = None  # all 8 tokens
    g = autograph.graphed(model)
    cache = transformers.StaticCache(config=model.config, max_cache_len=64)
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, disable_compile=True)
    for n in range(4):
        ids = torch.randint(1, 96, (1, 4))
        want = model.generate(ids, cache_implementation="static", **kw)
        cache.reset()
        assert torch.equal(g.generate(ids, past_key_values=cache, **kw), want)
        if n == 0:
            first = dict(autograph.stats(g))
    s = autograph.stats(g)  # the decode step once; the prefill at its third generate
    assert first["captures"] == 1 and s["captures"] == 2, (first, s)
    assert s["replays"] - first["replays"] >= 3 * 7 - 2, (first, s)


def test_each_generate_captures_its_new_cache_without_warming_up():
    """transformers makes a new cache per ``generate()``: its decode step is a new key
    (the cache's addresses), of the structure captured before, so after the first
    generate only the prefill runs eagerly; tokens as eager's."""
    model = _tiny("llama")
    model.generation_config.eos_token_id = model.config.eos_token_id = None  # all 8 tokens
    g = autograph.graphed(model)
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0,
              cache_implementation="static", disable_compile=True)
    before = None
    for _ in range(4):
        ids = torch.randint(1, 96, (1, 4))
        want = model.generate(ids, **kw)
        assert torch.equal(g.generate(ids, **kw), want)
        s = dict(autograph.stats(g))
        if before is not None:  # the prefill eager; the first decode step captured
            assert s["eager"] - before["eager"] == 1, (before, s)
            assert s["replays"] - before["replays"] >= 6, (before, s)
        before = s


def test_a_static_cache_tensor_turned_into_a_subclass_is_not_replayed():
    """The keyer's record of a ``StaticCache`` compares its values by identity; a tensor
    whose ``__class__`` is reassigned is the same object, and the tensors' check finds it."""

    class Marked(torch.Tensor):
        pass

    model = _tiny("llama")
    kw = dict(max_new_tokens=2, do_sample=False, pad_token_id=0,
              cache_implementation="static", disable_compile=True, return_dict_in_generate=True)
    cache = model.generate(torch.randint(1, 96, (1, 4)), **kw).past_key_values
    g = autograph.graphed(lambda x, c: x + c.layers[0].keys.sum())
    x = torch.randn(3)
    with torch.no_grad():
        for _ in range(4):
            g(x, cache)
        assert autograph.stats(g)["replays"] == 1
        cache.layers[0].keys.__class__ = Marked
        g(x, cache)
    s = autograph.stats(g)
    assert s["replays"] == 1 and s["eager_reasons"].get("unkeyable_argument"), s


def test_an_argument_sharing_memory_with_a_new_cache_is_warmed_up():
    """A new cache of a captured structure is captured at its first call only where no
    tensor argument shares its memory: one that does is warmed up, which finds that the
    call's write reaches that argument (as for the first cache), so nothing is written
    twice and the argument reads the write."""
    model = _tiny("llama")
    kw = dict(max_new_tokens=2, do_sample=False, pad_token_id=0,
              cache_implementation="static", disable_compile=True, return_dict_in_generate=True)
    caches = [model.generate(torch.randint(1, 96, (1, 4)), **kw).past_key_values
              for _ in range(2)]  # both alive: the second at other addresses

    def f(x, c, ref):
        c.layers[0].keys.add_(x)
        return ref * 2

    g = autograph.graphed(f)
    with torch.no_grad():
        for c in caches:
            keys = c.layers[0].keys
            start = keys.clone()
            for i in range(4):
                torch.testing.assert_close(g(torch.ones(()), c, keys), (start + i + 1) * 2)
            torch.testing.assert_close(keys, start + 4)
    assert autograph.stats(g)["replays"] >= 2


def check_argument_that_is_an_objects_tensor(view, device):
    """Calls of one structure that alternate between a separate tensor and one of the
    object's own tensors (or a view of it) as an argument: a call passing the object's
    tensor is another key, captured with that argument in place, so it reads what the
    call writes through the object first (a private copy would read it stale)."""
    class Pair:
        def __init__(self):
            self.k = torch.zeros(4, device=device)
            self.v = torch.zeros(6, device=device)

    pick = {"whole": lambda c: c.k, "slice": lambda c: c.k[1:3],
            "other tensor's storage": lambda c: c.v[:4]}[view]

    def f(x, cache):
        cache.k.add_(1)
        return x * 2

    g = autograph.graphed(f)
    mine, eager = Pair(), Pair()
    separate = torch.zeros(2 if view == "slice" else 4, device=device)
    with torch.no_grad():
        for i in range(12):
            aliased = i % 3 != 0
            got = g(pick(mine) if aliased else separate, mine)
            want = f(pick(eager) if aliased else separate, eager)
            assert torch.equal(got, want), (i, got, want)
            assert torch.equal(mine.k, eager.k)
    s = autograph.stats(g)
    assert s["captures"] == 2 and s["replays"] >= 5, s


@pytest.mark.parametrize("view", ["whole", "slice", "other tensor's storage"])
def test_an_argument_that_is_an_objects_tensor_reads_the_objects_write(view):
    check_argument_that_is_an_objects_tensor(view, "cpu")


def check_output_that_is_an_objects_tensor(outputs, device):
    """``return cache.keys`` (or a view of it) hands back the call's own object's
    tensor, as eager does, not a copy: a write through the output reaches the cache."""
    def f(x, cache):
        cache.keys.add_(x)
        return cache.keys, cache.keys[1:3], x * 2

    g = autograph.graphed(f, outputs=outputs)
    cache, eager = KV(), KV()
    for c in (cache, eager):
        c.keys, c.length = c.keys.to(device), c.length.to(device)
    with torch.no_grad():
        for _ in range(6):
            x = torch.randn(4, device=device)
            keys, part, y = g(x, cache)
            _, epart, ey = f(x, eager)
            assert keys is cache.keys
            assert part.data_ptr() == cache.keys[1:3].data_ptr() and part.shape == (2, 4)
            torch.testing.assert_close(y, ey)
            part.mul_(0.5)  # through the output, into the cache
            epart.mul_(0.5)
            torch.testing.assert_close(cache.keys, eager.keys)
            del keys, part, y  # (reuse: an output held at the next call protects it)
    s = autograph.stats(g)
    assert s["replays"] >= 2, s


@pytest.mark.parametrize("outputs", ["clone", "reuse"])
def test_an_output_that_is_an_objects_tensor_is_that_tensor(outputs):
    check_output_that_is_an_objects_tensor(outputs, "cpu")


def test_generate_with_verify_every_replays_and_stays_exact():
    """Decode steps take a cache object, which an eager rerun would advance twice: they
    are replayed but not verified (and a verified attention graph would be, see
    test_usage); before, every attention graph counted as random and nothing was."""
    model = _tiny("llama")
    ids = torch.randint(1, 96, (1, 4))
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0,
              cache_implementation="static", disable_compile=True)
    want = model.generate(ids, **kw)
    g = autograph.graphed(model, verify_every=2)
    assert torch.equal(g.generate(ids, **kw), want)
    s = autograph.stats(g)
    assert s["replays"] > 0 and s["verifications"] == 0 and s["verify_failures"] == 0, s


def test_sentence_transformers_encode_with_buckets(monkeypatch):
    pytest.importorskip("sentence_transformers")
    import transformers.masking_utils as masking

    from .gpu.models import sentence_transformer, sentences

    # a real capture makes transformers skip its data-dependent mask check
    # (is_cuda_stream_capturing); the stand-in's capture is no CUDA capture
    monkeypatch.setattr(masking, "is_tracing", lambda tensor=None: True)
    st = sentence_transformer()
    batches = [sentences(n, seed=n) for n in (3, 2, 3, 4)]
    want = [st.encode(b, convert_to_tensor=True) for b in batches]
    with autograph.capture_region(buckets=[4]) as region:
        got = [st.encode(b, convert_to_tensor=True) for b in batches for _ in range(2)]
    for i, w in enumerate(want):
        torch.testing.assert_close(got[2 * i], w)
        torch.testing.assert_close(got[2 * i + 1], w)
    (s,) = region.stats().values()
    assert s["replays"] >= 1 and s["eager_reasons"].keys() <= {"warmup"}, s


def _static_cache(layers=2):
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=64, max_position_embeddings=128)
    cache = transformers.StaticCache(config=cfg, max_cache_len=8)
    cache.early_initialization(batch_size=1, num_heads=2, head_dim=8, dtype=torch.float32,
                               device=torch.device("cpu"))
    return cache


def _mutations():
    """Changes to a StaticCache between two keyings, each named, with whether the key
    must change (every one must be seen by the memo of the last keying)."""
    def rebind(c):
        c.layers[0].keys = torch.zeros_like(c.layers[0].keys)

    def same_view(c):  # a new tensor object at the same address and geometry
        c.layers[1].values = c.layers[1].values.view(c.layers[1].values.shape)

    def resize(c):
        c.layers[0].values.resize_(1, 2, 4, 8)

    def transpose(c):
        c.layers[1].keys.transpose_(2, 3)

    def data_dtype(c):
        c.layers[0].keys.data = c.layers[0].keys.data.to(torch.float64)

    def set_storage(c):
        c.layers[1].keys.set_(torch.zeros_like(c.layers[1].keys))

    def scalar(c):
        c.layers[0].max_cache_len = 9

    def equal_new_int(c):  # equal but another object: a miss, the same key
        c.layers[1].max_cache_len = int("8")

    def flag(c):
        c.layers[1].is_initialized = False

    def rename(c):  # the last attribute deleted and another with its value added
        layer = c.layers[0]
        last = list(vars(layer))[-1]
        value = vars(layer).pop(last)
        layer.other = value

    def subclass(c):
        class Sub(torch.Tensor):
            pass
        c.layers[0].keys.__class__ = Sub

    def layer_list(c):
        c.layers.append(c.layers[0])

    def layer_swap(c):
        c.layers[0], c.layers[1] = c.layers[1], c.layers[0]

    def attribute(c):
        c.offloading = True

    def new_attribute(c):
        c.extra = 1

    return {f.__name__: (f, f not in (same_view, equal_new_int)) for f in (
        rebind, same_view, resize, transpose, data_dtype, set_storage, scalar, equal_new_int,
        flag, rename, subclass, layer_list, layer_swap, attribute, new_attribute)}


@pytest.mark.parametrize("name", list(_mutations()))
def test_static_cache_key_memo_sees_every_change(name):
    """A repeat keying of a StaticCache reuses its last keying while nothing it read
    changed (known_types.Memo); any change gives the key the full keying gives."""
    from autograph import known_types

    change, differs = _mutations()[name]
    cache = _static_cache()
    x = torch.ones(1)
    with torch.no_grad():
        before = _key(x, cache)
        assert _key(x, cache) == before and id(cache) in known_types._memos
        try:
            change(cache)
            memo = _key(x, cache)
        except Exception as exc:  # noqa: BLE001 - unkeyable now: so must the full keying be
            memo = type(exc)
        known_types._memos.clear()
        try:
            full = _key(x, cache)
        except Exception as exc:  # noqa: BLE001
            full = type(exc)
    assert memo == full
    assert (memo != before) is differs


def test_static_cache_key_memo_goes_with_the_cache():
    import gc

    from autograph import known_types

    cache = _static_cache()
    with torch.no_grad():
        _key(torch.ones(1), cache)
    assert id(cache) in known_types._memos
    del cache
    gc.collect()
    assert not known_types._memos


def test_an_encoder_with_padding_masks_replays():
    """A BERT encoder under masks of varying padding: transformers skips its mask
    check while a stream captures (the stand-in's capture says so, as CUDA's does),
    so one graph serves every mask of the shape, equal to eager."""
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=64)
    model = transformers.BertModel(cfg).eval()
    g = autograph.graphed(model)
    with torch.no_grad():
        for i in range(8):
            ids = torch.randint(0, 96, (2, 8))
            mask = torch.ones(2, 8, dtype=torch.long)
            mask[0, 8 - i % 4:] = 0
            got = g(input_ids=ids, attention_mask=mask).last_hidden_state
            want = model(input_ids=ids, attention_mask=mask).last_hidden_state
            torch.testing.assert_close(got, want)
    s = autograph.stats(g)
    assert s["replays"] >= 4 and s["eager_reasons"].keys() <= {"warmup"}, s


def check_a_graphed_sentence_transformer_fills_the_callers_features(device: str = "cpu"
                                                                    ) -> None:
    """sentence-transformers' modules add their outputs to the features mapping (a
    ``BatchEncoding``) they are given and return it: graphed, the caller's mapping gets
    them too, on replays as in eager mode, with eager's values."""
    from .gpu.models import sentence_transformer, sentences

    st = sentence_transformer(device)
    batch = sentences(3, seed=1)
    want = st.encode(batch, convert_to_tensor=True)
    g = autograph.graphed(st)
    with torch.no_grad():
        for _ in range(5):
            features = st.tokenize(batch).to(device)
            out = g(features)
            assert out is features and "token_embeddings" in features
            torch.testing.assert_close(features["sentence_embedding"], want)
    assert autograph.stats(g)["replays"] >= 2, autograph.stats(g)


def test_a_graphed_sentence_transformer_fills_the_callers_features(standin, monkeypatch):
    pytest.importorskip("sentence_transformers")
    import transformers.masking_utils as masking

    monkeypatch.setattr(masking, "is_tracing", lambda tensor=None: True)  # as above
    check_a_graphed_sentence_transformer_fills_the_callers_features()


def check_a_cache_moved_every_call_runs_eagerly_without_giving_up(device="cpu"):
    """Beam search reorders its cache every step (new tensors: new addresses, new
    keys): a graph per step would never replay.  Once a structure's latest key never
    replayed, a new one runs its first call plainly eagerly (no capture, no count
    towards giving up); a cache that then stays put is captured and replays."""
    model = Step().to(device)
    g = autograph.graphed(model)
    x = torch.randn(1, 4, device=device)
    cache, mine = KV(), KV()
    for kv in (cache, mine):
        kv.keys, kv.length = kv.keys.to(device), kv.length.to(device)
    kept = []  # old caches kept alive: no new one takes an old one's address
    with torch.no_grad():
        for _ in range(100):  # reordered after each step, as beam search's cache
            torch.testing.assert_close(g(x, cache)[0], model(x, mine)[0])
            torch.testing.assert_close(cache.keys, mine.keys)
            kept.append(cache.keys)
            cache.keys = cache.keys.flip(0).clone()
            mine.keys = mine.keys.flip(0).clone()
            cache.length.zero_()
            mine.length.zero_()
        s = autograph.stats(g)
        assert s["captures"] <= 2 and "given_up" not in s["eager_reasons"], s
        for _ in range(8):  # a cache that stays put
            torch.testing.assert_close(g(x, cache)[0], model(x, mine)[0])
            torch.testing.assert_close(cache.keys, mine.keys)
    assert autograph.stats(g)["replays"] >= 2, autograph.stats(g)


def test_a_cache_moved_every_call_runs_eagerly_without_giving_up():
    check_a_cache_moved_every_call_runs_eagerly_without_giving_up()


class _Request:
    def __init__(self, scale):
        self.scale = scale


class _Answer:
    def __init__(self, value, request):
        self.value, self.request = value, request


def _answer(x, request):
    return _Answer(x * request.scale, request)


def check_an_argument_object_inside_a_returned_object_is_the_calls_own(device="cpu"):
    """An object argument held by an object the call returns came back as the capture
    call's object (its old values, kept alive) on every replay; eager returns the
    caller's own."""
    import gc
    import weakref

    g = autograph.graphed(_answer)
    first = None
    with torch.no_grad():
        for _ in range(6):
            request = _Request(2.0)
            first = first or weakref.ref(request)
            x = torch.randn(3, device=device)
            got = g(x, request)
            assert got.request is request
            torch.testing.assert_close(got.value, x * request.scale)
    del got, request
    gc.collect()
    assert first() is None, "a replay keeps the capture call's argument alive"
    assert autograph.stats(g)["replays"] >= 2, autograph.stats(g)


def test_an_argument_object_inside_a_returned_object_is_the_calls_own(standin):
    check_an_argument_object_inside_a_returned_object_is_the_calls_own()


class _ImageList:
    """As torchvision's ``ImageList`` (a plain object of a library named torch-something)."""

    def __init__(self, tensors, image_sizes):
        self.tensors, self.image_sizes = tensors, image_sizes


_ImageList.__module__ = "torchvision.models.detection.image_list"


def check_objects_of_libraries_named_torch_something_are_plain(device="cpu"):
    """An object of torchvision's, torchaudio's or torch_geometric's returned by a call
    is made again per replay as any plain object (its module name starting with
    "torch" made it ``unsupported_output``: ``graphed(model.transform)`` never
    replayed)."""
    g = autograph.graphed(lambda x: _ImageList(x * 2, [tuple(x.shape[-2:])]))
    for _ in range(5):
        x = torch.randn(1, 3, 4, 4, device=device)
        out = g(x)
        assert type(out) is _ImageList and out.image_sizes == [(4, 4)]
        torch.testing.assert_close(out.tensors, x * 2)
    assert autograph.stats(g)["replays"] >= 2, autograph.stats(g)


def test_objects_of_libraries_named_torch_something_are_plain(standin):
    check_objects_of_libraries_named_torch_something_are_plain()


def check_transformers_collecting_hooks_are_inert_until_a_caller_collects(device="cpu"):
    """transformers (5.x) leaves a hook on each layer once a model was asked for its
    hidden states: every later call ran eagerly (``hooks``).  They do nothing while
    no collector is active: calls replay, a call asking for hidden states gets eager's
    (its collector is its own), and a graphed layer called while its model collects
    runs eagerly, so that the model's hidden states are complete (and replays while
    the model collects nothing)."""
    model = _tiny("llama").to(device).model
    twin = copy.deepcopy(model)
    ids = torch.randint(0, 96, (1, 6), device=device)
    with torch.no_grad():
        model(ids, output_hidden_states=True)  # installs the hooks
        assert any(m._forward_hooks for m in model.modules())
        g = autograph.graphed(model)
        for hidden in (False, True):
            for _ in range(5):
                ids = torch.randint(0, 96, (1, 6), device=device)
                got = g(ids, output_hidden_states=hidden, use_cache=False)
                want = twin(ids, output_hidden_states=hidden, use_cache=False)
                torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state)
                if hidden:
                    assert len(got.hidden_states) == len(want.hidden_states) == 3
                    for a, b in zip(got.hidden_states, want.hidden_states):
                        torch.testing.assert_close(a, b)
        assert autograph.stats(g)["replays"] >= 4, autograph.stats(g)
        layer = autograph.graphed(model.layers[1])
        model.layers[1] = layer
        for _ in range(4):
            ids = torch.randint(0, 96, (1, 6), device=device)
            got = model(ids, output_hidden_states=True, use_cache=False)
            want = twin(ids, output_hidden_states=True, use_cache=False)
            assert len(got.hidden_states) == len(want.hidden_states) == 3
            for a, b in zip(got.hidden_states, want.hidden_states):
                torch.testing.assert_close(a, b)
        assert autograph.stats(layer)["replays"] == 0
        assert autograph.stats(layer)["eager_reasons"].get("hooks"), autograph.stats(layer)
        for _ in range(5):  # the parent asks for nothing: its collector is empty
            ids = torch.randint(0, 96, (1, 6), device=device)
            got = model(ids, use_cache=False).last_hidden_state
            torch.testing.assert_close(got, twin(ids, use_cache=False).last_hidden_state)
        assert autograph.stats(layer)["replays"] >= 2, autograph.stats(layer)


def test_transformers_collecting_hooks_are_inert_until_a_caller_collects(standin):
    check_transformers_collecting_hooks_are_inert_until_a_caller_collects()


def test_a_tensor_requiring_grad_inside_an_object_names_the_real_reason():
    """A soft prompt in a dataclass argument, requiring grad, under grad mode: eager,
    counted as ``autograd``, whose text said the callable is not graphed for training
    (``backward=False``); it is counted as ``backward_unsupported``, naming the tensor."""

    @dataclasses.dataclass
    class Prompt:
        embeds: torch.Tensor

    lin = nn.Linear(4, 4)
    prompt = Prompt(torch.randn(2, 4, requires_grad=True))

    def call(p):
        return lin(p.embeds)

    gc_ = autograph.graphed(call)
    for _ in range(3):
        torch.testing.assert_close(gc_(prompt), call(prompt))
    s = autograph.stats(gc_)
    assert "autograd" not in s["eager_reasons"], s
    assert "inside an argument object" in str(s["eager_details"]), s


class _Batch(dict):
    pass


class _Items(list):
    pass


class _Pair(tuple):
    __slots__ = ()


class _Tagged(dict):
    def __init__(self, tag, **items):
        super().__init__(**items)
        self.tag = tag


def check_subclasses_of_dict_list_and_tuple_arguments(device="cpu"):
    """Arguments of a user's subclass of ``dict``, ``list`` or ``tuple`` (a batch
    class): their items were neither keyed nor copied in, so with the tensors of the
    capture call still alive (a dataset) every replay read those (stale results), and an
    item of another shape replayed too.  They are walked as objects are, items and
    attributes: keyed by their tensors' addresses (captured anew where those move,
    replayed where the same tensors are refilled in place)."""
    data = [torch.randn(3 + (i > 5), device=device) for i in range(10)]
    for make, read in ((lambda t: _Batch(a=t), lambda b: b["a"]),
                       (lambda t: _Items([t]), lambda b: b[0]),
                       (lambda t: _Pair((t,)), lambda b: b[0]),
                       (lambda t: _Tagged("x", a=t), lambda b: b["a"] * len(b.tag))):
        def f(x, b, read=read):
            return x.sum() + read(b) * 2

        g = autograph.graphed(f)
        for t in data:
            x = torch.randn(2, device=device)
            torch.testing.assert_close(g(x, make(t)), f(x, make(t)))
        held = torch.empty(3, device=device)
        batch = make(held)
        for t in data[:6]:
            held.copy_(t)
            x = torch.randn(2, device=device)
            torch.testing.assert_close(g(x, batch), f(x, batch))
        assert autograph.stats(g)["replays"] >= 2, autograph.stats(g)


def test_subclasses_of_dict_list_and_tuple_arguments(standin):
    check_subclasses_of_dict_list_and_tuple_arguments()


class _Public(dict):
    """Hides its ``_``-prefixed items from iteration (as a config class might)."""

    def __iter__(self):
        return (k for k in dict.__iter__(self) if not k.startswith("_"))

    def keys(self):
        return list(iter(self))


class _Head(list):
    def __iter__(self):
        return iter(list.__getitem__(self, slice(0, 1)))


class _OneSlot:
    __slots__ = "scale"

    def __init__(self, scale):
        self.scale = scale


class _PrivateSlot:
    __slots__ = ("__scale", "name")

    def __init__(self, scale):
        self.__scale = scale
        self.name = "s"

    def scale(self):
        return self.__scale


class _PrivateScaler:
    __slots__ = ("__scale",)

    def __init__(self):
        self.__scale = 2.0

    def set_scale(self, value):
        self.__scale = value

    @autograph.graphed
    def apply(self, x):
        return x * self.__scale


def check_values_argument_walks_used_to_miss(device="cpu"):
    """Values an argument object holds where the walk did not look, so a replay kept
    the capture's (stale results): the values of a dict with other keys than strings
    and ints (keyed by the dict's identity), items hidden by a subclass's overridden
    ``__iter__``/``keys``, a ``__slots__`` given as one string, a private slot (its
    mangled name), also of a graphed method's own object."""
    import types

    objects = (types.SimpleNamespace(scales={("q", 0): 2.0}), _Public(a=1.0, _s=2.0),
               _Head([1.0, 2.0]), _OneSlot(2.0), _PrivateSlot(2.0))
    reads = (lambda o: o.scales[("q", 0)], lambda o: dict.__getitem__(o, "_s"),
             lambda o: list.__getitem__(o, 1), lambda o: o.scale, lambda o: o.scale())
    sets = (lambda o, s: o.scales.__setitem__(("q", 0), s),
            lambda o, s: dict.__setitem__(o, "_s", s),
            lambda o, s: list.__setitem__(o, 1, s),
            lambda o, s: setattr(o, "scale", s),
            lambda o, s: setattr(o, "_PrivateSlot__scale", s))
    for obj, read, put in zip(objects, reads, sets):
        def f(x, o, read=read):
            return x * read(o)

        g = autograph.graphed(f)
        for i in range(8):
            s = 2.0 if i < 4 else float(i)
            put(obj, s)
            x = torch.randn(3, device=device)
            torch.testing.assert_close(g(x, obj), x * s)
        assert autograph.stats(g)["replays"] >= 1, autograph.stats(g)
    ordered = types.SimpleNamespace(w=OrderedDict(a=2.0, b=3.0))
    first = autograph.graphed(lambda x, ns: x * next(iter(ns.w.values())))
    for i in range(8):
        if i == 5:
            ordered.w.move_to_end("a")  # its order read: keyed
        x = torch.randn(3, device=device)
        torch.testing.assert_close(first(x, ordered), x * next(iter(ordered.w.values())))
    lin = nn.Linear(3, 3).to(device)
    names = types.SimpleNamespace(names={m: n for n, m in lin.named_modules()})
    named = autograph.graphed(lambda x, ns: x * len(ns.names))  # modules as keys: replays
    for _ in range(6):
        x = torch.randn(3, device=device)
        torch.testing.assert_close(named(x, names), x)
    for g in (first, named):
        assert autograph.stats(g)["replays"] >= 2, autograph.stats(g)
    obj = _PrivateScaler()
    for i in range(8):
        if i >= 4:
            obj.set_scale(float(i))
        x = torch.randn(3, device=device)
        torch.testing.assert_close(obj.apply(x), x * (2.0 if i < 4 else float(i)))
    assert autograph.stats(obj.apply)["replays"] >= 1, autograph.stats(obj.apply)


def test_values_argument_walks_used_to_miss(standin):
    check_values_argument_walks_used_to_miss()



def test_an_object_no_longer_keyable_after_the_call_is_said_to_be_changed(standin):
    """Under grad mode a decode loop passes a fresh ``DynamicCache`` that the call fills
    with tensors requiring grad: the eager count ``assigns_attribute`` named the keying
    error alone ("... requires grad", ``backward_unsupported``'s words), not that the
    call changed the object."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=64, max_position_embeddings=128)
    g = autograph.graphed(transformers.LlamaForCausalLM(cfg).eval())
    for _ in range(2):
        ids = torch.randint(3, 96, (2, 6))
        mask, pos = torch.ones_like(ids), torch.arange(6)
        cache = transformers.DynamicCache(config=cfg)
        for _ in range(3):
            out = g(input_ids=ids, attention_mask=mask, past_key_values=cache,
                    cache_position=pos, use_cache=True)
            ids = out.logits[:, -1:].argmax(-1)
            mask, pos = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1), pos[-1:] + 1
    details = autograph.stats(g)["eager_details"].get("assigns_attribute", {})
    assert details and all("changed an argument object" in d for d in details
                           if "requires grad" in d), details
