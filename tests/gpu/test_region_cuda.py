"""capture_region() with real CUDA graphs.  Skipped without CUDA."""

import pytest
import torch

import autograph
from autograph.cli.models import Decoder

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

FP16 = {"rtol": 2e-2, "atol": 2e-2}


def one(stats):
    (value,) = stats.values()
    return value


def test_region_replays_inside_runs_eager_outside_and_is_reused():
    torch.manual_seed(0)
    model = Decoder(layers=2, d=128, heads=4, vocab=1000, max_len=64).cuda().half().eval()
    cache, ref = model.new_cache(2), model.new_cache(2)

    def steps(positions, region):
        outs = []
        with torch.inference_mode():
            for pos in positions:
                t = torch.randint(0, 1000, (2, 1), device="cuda")
                p = torch.tensor([pos], device="cuda")
                if region is not None:
                    with region:
                        out = model(t, p, *cache)
                else:
                    out = model(t, p, *cache)
                torch.testing.assert_close(out, model.forward(t, p, *ref), **FP16)
                outs.append(out)
        torch.testing.assert_close(cache[0], ref[0], **FP16)
        return outs

    first = autograph.capture_region()
    steps(range(0, 10), first)
    s = one(first.stats())
    assert (s["captures"], s["replays"]) == (1, 7)
    steps(range(10, 15), None)  # outside: eager, nothing counted
    assert one(first.stats())["calls"] == 10
    second = autograph.capture_region()
    steps(range(15, 25), second)
    s = one(second.stats())
    assert (s["captures"], s["replays"], s["eager"]) == (0, 10, 0)


def test_transformers_model_in_a_region():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(config).cuda().eval()
    prompt = torch.randint(0, 512, (1, 6), device="cuda")

    def greedy(region):
        tokens = torch.zeros(1, 20, dtype=torch.long, device="cuda")
        tokens[0, :6] = prompt[0]
        with torch.inference_mode():
            for n in range(6, 20):
                if region is None:
                    logits = model(input_ids=tokens, use_cache=False).logits
                else:
                    with region:
                        logits = model(input_ids=tokens, use_cache=False).logits
                tokens[0, n] = logits[0, n - 1].argmax()
        return tokens

    region = autograph.capture_region()
    fast = greedy(region)
    assert torch.equal(fast, greedy(None))
    s = one(region.stats())
    assert s["replays"] >= 10, s
    with torch.inference_mode(), autograph.capture_region() as cached:
        out = model.generate(prompt, max_new_tokens=4, do_sample=False)
    assert torch.equal(out, model.generate(prompt, max_new_tokens=4, do_sample=False))
    s = one(cached.stats())
    # a DynamicCache grows every step: each call is a new key, warmed up, never replayed
    assert s["replays"] == 0 and s["eager"] == s["calls"], s
