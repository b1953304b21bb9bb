"""Models built from configs with random weights (no download), shared by the GPU model
tests, the CPU tests and examples: transformers decoders and a SentenceTransformer."""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(300)]


def decoder(kind: str, *, layers: int = 2, hidden: int = 64, vocab: int = 256,
            dtype: torch.dtype = torch.float32, device: str = "cpu",
            sliding_window: int | None = None) -> Any:
    """A Llama-, GPT-2-, Qwen2-, Mistral- or Gemma-shaped causal LM with random weights
    (Mistral's sliding window as given, else its config's default)."""
    import transformers as tf

    torch.manual_seed(0)
    heads = max(2, hidden // 64)
    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, max_position_embeddings=1024)
    if kind == "gpt2":
        cfg = tf.GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=heads,
                            n_positions=1024)
        model = tf.GPT2LMHeadModel(cfg)
    else:
        config_cls, model_cls = {
            "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
            "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
            "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
            "gemma": (tf.GemmaConfig, tf.GemmaForCausalLM),
        }[kind]
        if sliding_window is not None:
            common["sliding_window"] = sliding_window
        cfg = config_cls(intermediate_size=hidden * 2, num_key_value_heads=max(1, heads // 2),
                         **common)
        model = model_cls(cfg)
    # no end-of-sequence token: every generate runs its full length
    model.config.eos_token_id = model.generation_config.eos_token_id = None
    model.config.bos_token_id = model.generation_config.bos_token_id = None
    return model.to(device=device, dtype=dtype).eval()


def prompt(batch: int, length: int = 8, vocab: int = 256, device: str = "cpu"
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and an attention mask, left-padded (rows of several lengths) at batch > 1."""
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(3, vocab, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    for row in range(1, batch):
        mask[row, : row % length] = 0
        ids[row, : row % length] = 0
    return ids.to(device), mask.to(device)


def sentence_transformer(device: str = "cpu") -> Any:
    """A SentenceTransformer (BERT-shaped Transformer + mean Pooling) with random weights
    and a word-level tokenizer written to a temporary directory."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules.transformer import Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling
    from transformers import BertConfig, BertModel, BertTokenizerFast

    torch.manual_seed(0)
    path = tempfile.mkdtemp(prefix="autograph-st-")
    with open(os.path.join(path, "vocab.txt"), "w") as f:
        f.write("\n".join(WORDS))
    BertTokenizerFast(vocab_file=os.path.join(path, "vocab.txt")).save_pretrained(path)
    BertModel(BertConfig(vocab_size=len(WORDS), hidden_size=64, num_hidden_layers=2,
                         num_attention_heads=4, intermediate_size=128)).save_pretrained(path)
    transformer = Transformer(path)
    return SentenceTransformer(modules=[transformer, Pooling(64)], device=device).eval()


def sentences(n: int, seed: int = 0) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        k = int(torch.randint(3, 12, (1,), generator=g))
        out.append(" ".join(f"w{int(i)}" for i in torch.randint(0, 300, (k,), generator=g)))
    return out
