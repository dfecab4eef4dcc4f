"""A small GPT-style model for the training benches: decoder-only, pre-LayerNorm,
causal self-attention, GELU MLP, token embedding tied to the output head.

Presets are sized for CPU ranks (a step in tens to hundreds of milliseconds
on one core), so communication is a visible share of the step; the larger
ones are for GPUs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .common import UsageError


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    block_size: int
    n_layer: int
    n_head: int
    n_embd: int


PRESETS = {
    "gpt-nano": GPTConfig(vocab_size=512, block_size=64, n_layer=2, n_head=2, n_embd=64),
    "gpt-tiny": GPTConfig(vocab_size=2048, block_size=128, n_layer=4, n_head=4, n_embd=256),
    "gpt-small": GPTConfig(vocab_size=8192, block_size=256, n_layer=6, n_head=6, n_embd=384),
    "gpt2": GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768),
}


class Block(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.n_head = c.n_head
        self.ln1, self.ln2 = nn.LayerNorm(c.n_embd), nn.LayerNorm(c.n_embd)
        self.qkv = nn.Linear(c.n_embd, 3 * c.n_embd)
        self.proj = nn.Linear(c.n_embd, c.n_embd)
        self.fc = nn.Linear(c.n_embd, 4 * c.n_embd)
        self.fc_proj = nn.Linear(4 * c.n_embd, c.n_embd)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)  # each (B, T, C)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, H, T, C/H)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(y)
        return x + self.fc_proj(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.config = c
        self.wte = nn.Embedding(c.vocab_size, c.n_embd)
        self.wpe = nn.Embedding(c.block_size, c.n_embd)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.n_embd)
        self.head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        self.head.weight = self.wte.weight
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, idx, targets=None):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))  # (B, T, vocab)
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def make_gpt(name: str, seed: int = 0) -> GPT:
    if name not in PRESETS:
        raise UsageError(f"--model: expected one of {list(PRESETS)}, got {name!r}")
    torch.manual_seed(seed)
    return GPT(PRESETS[name])


def check_seq(config: GPTConfig, seq: int, model: str | None = None) -> None:
    """--seq within the model's position table (`model`: the preset's name, for the message)."""
    if not 1 <= seq <= config.block_size:
        raise UsageError(f"--seq: expected 1..{config.block_size} for {f'--model {model}' if model else 'this model'}"
                         f", got {seq}")


def random_batch(config: GPTConfig, batch: int, seq: int, seed: int):
    """(inputs, targets) of random token ids, shape (batch, seq)."""
    check_seq(config, seq)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.vocab_size, (batch, seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
