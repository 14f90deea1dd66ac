"""The model zoo: small GPTs (nanoGPT's shape) that train on a CPU in minutes.

Vocabulary: the 256 byte values by default, so any UTF-8 text works without a tokenizer file; a prepared
corpus with a BPE (``prepare.py``) sets its own size.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB_SIZE = 256


@dataclass(frozen=True)
class GPTShape:
    n_layer: int
    n_head: int
    n_embd: int


ZOO: dict[str, GPTShape] = {
    "gpt-nano": GPTShape(n_layer=2, n_head=2, n_embd=64),  # ~0.1M params: tests
    "gpt-micro": GPTShape(n_layer=4, n_head=4, n_embd=128),  # ~0.8M params: the demo
    "gpt-mini": GPTShape(n_layer=6, n_head=6, n_embd=192),  # ~2.7M params
    "gpt-small": GPTShape(n_layer=8, n_head=8, n_embd=320),  # ~10M params
}


class Block(nn.Module):
    def __init__(self, shape: GPTShape, dropout: float):
        super().__init__()
        self.n_head = shape.n_head
        self.ln_1 = nn.LayerNorm(shape.n_embd)
        self.qkv = nn.Linear(shape.n_embd, 3 * shape.n_embd)
        self.proj = nn.Linear(shape.n_embd, shape.n_embd)
        self.ln_2 = nn.LayerNorm(shape.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(shape.n_embd, 4 * shape.n_embd),
            nn.GELU(),
            nn.Linear(4 * shape.n_embd, shape.n_embd),
            nn.Dropout(dropout),
        )
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(
        self, shape: GPTShape, context_length: int, dropout: float = 0.0, vocab_size: int = VOCAB_SIZE
    ):
        super().__init__()
        self.context_length = context_length
        self.tok_emb = nn.Embedding(vocab_size, shape.n_embd)
        self.pos_emb = nn.Embedding(context_length, shape.n_embd)
        self.blocks = nn.ModuleList(Block(shape, dropout) for _ in range(shape.n_layer))
        self.ln_f = nn.LayerNorm(shape.n_embd)
        self.head = nn.Linear(shape.n_embd, vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # weight tying, as in GPT-2
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """idx: (B, T) int64 token ids -> logits (B, T, vocab_size)."""
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


# Initialization draws from torch's global generator: two threads building models at once (peers of an
# in-process test swarm) would interleave their draws and get different "deterministic" weights.
_BUILD_LOCK = threading.Lock()


def build_model(
    name: str, context_length: int, dropout: float = 0.0, seed: int = 0, vocab_size: int = VOCAB_SIZE
) -> GPT:
    """Build a zoo model with deterministic initial weights (same seed, same weights on every peer)."""
    if name not in ZOO:
        raise ValueError(f"unknown model {name!r}; the zoo has {', '.join(ZOO)}")
    with _BUILD_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPT(ZOO[name], context_length, dropout, vocab_size)


def num_params(model: nn.Module) -> int:
    # Tied weights appear once in parameters().
    return sum(p.numel() for p in model.parameters())
