"""Small built-in models for the benchmark, the examples and the GPU tests.

``Decoder`` is a GPT-2 decoder, written with the operators of the reference GPT-2
implementation (``addmm`` linears, the tanh GELU spelled out, heads split with
``view``/``permute``), whose ``forward`` is one decode step over a static KV cache written
in place (``index_copy_``): the pattern that serving engines graph and that
``torch.compile(mode="reduce-overhead")`` refuses to graph.  ``mlp`` is a tiny
model whose step is all launch overhead.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class Conv1D(nn.Module):
    """GPT-2's linear layer: ``addmm`` on a (in, out) weight, as in the reference code."""

    def __init__(self, nx: int, nf: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.02)
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's tanh GELU, written out as in the reference implementation."""
    inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))
    return 0.5 * x * (1.0 + torch.tanh(inner))


class Block(nn.Module):
    """A GPT-2 block (reference-implementation operators) attending over a static cache."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.head_dim = d // heads
        self.ln_1 = nn.LayerNorm(d)
        self.c_attn = Conv1D(d, 3 * d)
        self.c_proj = Conv1D(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.c_fc = Conv1D(d, 4 * d)
        self.mlp_proj = Conv1D(4 * d, d)

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.size()[:-1] + (self.heads, self.head_dim)).permute(0, 2, 1, 3)

    def _attend(self, x: torch.Tensor, pos: torch.Tensor, visible: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        q, k, v = self._split_heads(q), self._split_heads(k), self._split_heads(v)
        k_cache.index_copy_(2, pos, k)  # the static cache, written in place
        v_cache.index_copy_(2, pos, v)
        w = torch.matmul(q, k_cache.transpose(-1, -2))
        w = w / torch.full([], self.head_dim ** 0.5, dtype=w.dtype, device=w.device)
        low = torch.full([], torch.finfo(w.dtype).min, dtype=w.dtype, device=w.device)
        w = torch.where(visible, w, low)
        w = nn.functional.softmax(w, dim=-1).type(v_cache.dtype)
        out = torch.matmul(w, v_cache).permute(0, 2, 1, 3).contiguous()
        return self.c_proj(out.view(b, t, d))

    def forward(self, x: torch.Tensor, pos: torch.Tensor, visible: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        x = x + self._attend(self.ln_1(x), pos, visible, k_cache, v_cache)
        return x + self.mlp_proj(gelu_new(self.c_fc(self.ln_2(x))))


class Decoder(nn.Module):
    """GPT-2-small shapes by default: 12 layers, d=768, 12 heads, vocabulary 50257."""

    def __init__(self, layers: int = 12, d: int = 768, heads: int = 12, vocab: int = 50257,
                 max_len: int = 1024) -> None:
        super().__init__()
        self.layers, self.d, self.heads, self.max_len = layers, d, heads, max_len
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def new_cache(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Zeroed key and value caches: (layers, batch, heads, max_len, head_dim)."""
        p = self.lm_head.weight
        shape = (self.layers, batch, self.heads, self.max_len, self.d // self.heads)
        return (torch.zeros(shape, dtype=p.dtype, device=p.device),
                torch.zeros(shape, dtype=p.dtype, device=p.device))

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor) -> torch.Tensor:
        """One decode step: ``tokens`` (batch, 1) at position ``pos`` (a 1-element
        tensor, so the step does not bake the position in); returns the logits."""
        x = self.wte(tokens) + self.wpe(pos)
        visible = torch.arange(self.max_len, device=pos.device) <= pos
        for i, block in enumerate(self.blocks):
            x = block(x, pos, visible, k_cache[i], v_cache[i])
        return self.lm_head(self.ln_f(x))


def mlp(width: int = 256, layers: int = 4) -> nn.Sequential:
    """A tiny MLP whose forward is all launch overhead."""
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*mods)
