"""The model zoo: GPTs (nanoGPT's shape) that train on a CPU in minutes, Llama-shaped decoders (RMSNorm,
rotary embeddings, SwiGLU) from CPU-sized to 1B parameters, and small CNNs that classify images.

Vocabulary: the 256 byte values by default, so any UTF-8 text works without a tokenizer file; a prepared
corpus with a BPE (``prepare.py``) sets its own size.

The Llama models are Hugging Face's ``LlamaForCausalLM`` computed the same way (the same parameter names, the
same rotary convention, RMSNorm in float32), written here so that training needs no ``transformers``:
``export.py`` writes a folder that ``LlamaForCausalLM.from_pretrained`` opens, with the same logits.
"""

from __future__ import annotations

import math
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


@dataclass(frozen=True)
class CNNShape:
    channels: tuple[int, int]
    """Channels of the two convolution stages (each: two 3x3 convolutions, then a 2x2 max-pool)."""
    hidden: int
    """Width of the classifier's hidden layer."""


@dataclass(frozen=True)
class LlamaShape:
    n_layer: int
    n_head: int
    n_kv_head: int
    """Key/value heads (grouped-query attention: n_head is a multiple of it)."""
    n_embd: int
    intermediate: int
    """SwiGLU's hidden width."""
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = True


ZOO: dict[str, GPTShape | LlamaShape | CNNShape] = {
    "gpt-nano": GPTShape(n_layer=2, n_head=2, n_embd=64),  # ~0.1M params: tests
    "gpt-micro": GPTShape(n_layer=4, n_head=4, n_embd=128),  # ~0.8M params: the demo
    "gpt-mini": GPTShape(n_layer=6, n_head=6, n_embd=192),  # ~2.7M params
    "gpt-small": GPTShape(n_layer=8, n_head=8, n_embd=320),  # ~10M params
    # Llama-shaped; params with a byte vocabulary (the CPU sizes) or one of 32,000 ids (the GPU sizes).
    "llama-nano": LlamaShape(n_layer=2, n_head=2, n_kv_head=2, n_embd=64, intermediate=176),  # ~0.1M: tests
    "llama-micro": LlamaShape(n_layer=4, n_head=4, n_kv_head=2, n_embd=128, intermediate=352),  # ~0.8M: a CPU
    "llama-mini": LlamaShape(n_layer=6, n_head=6, n_kv_head=2, n_embd=192, intermediate=512),  # ~2.4M
    "llama-small": LlamaShape(n_layer=8, n_head=8, n_kv_head=4, n_embd=320, intermediate=864),  # ~9.2M
    "llama-100m": LlamaShape(n_layer=12, n_head=12, n_kv_head=4, n_embd=768, intermediate=2048),  # ~100M
    "llama-300m": LlamaShape(n_layer=24, n_head=16, n_kv_head=8, n_embd=1024, intermediate=2816),  # ~316M
    "llama-1b": LlamaShape(
        n_layer=16, n_head=32, n_kv_head=8, n_embd=2048, intermediate=8192, rope_theta=5e5
    ),  # ~1.04B (Llama 3.2 1B's body)
    # Image classifiers; params for 8x8 grey digits / 28x28 MNIST.
    "cnn-tiny": CNNShape(channels=(8, 16), hidden=32),  # 6.6k / 30k: tests
    "cnn-small": CNNShape(channels=(32, 64), hidden=128),  # 0.1M / 0.47M: digits, MNIST
    "cnn-medium": CNNShape(channels=(64, 128), hidden=256),  # 0.39M / 1.9M (2.4M at 32x32 RGB)
}

IMAGE_MODELS = tuple(name for name, shape in ZOO.items() if isinstance(shape, CNNShape))


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


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()  # in float32 under autocast too, as Llama does
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, shape: LlamaShape):
        super().__init__()
        if shape.n_embd % shape.n_head or shape.n_head % shape.n_kv_head:
            raise ValueError(f"{shape}: n_embd must divide by n_head, n_head by n_kv_head")
        self.n_head, self.n_kv_head = shape.n_head, shape.n_kv_head
        self.head_dim = shape.n_embd // shape.n_head
        self.q_proj = nn.Linear(shape.n_embd, shape.n_head * self.head_dim, bias=False)
        self.k_proj = nn.Linear(shape.n_embd, shape.n_kv_head * self.head_dim, bias=False)
        self.v_proj = nn.Linear(shape.n_embd, shape.n_kv_head * self.head_dim, bias=False)
        self.o_proj = nn.Linear(shape.n_head * self.head_dim, shape.n_embd, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv_head != self.n_head)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class LlamaMLP(nn.Module):
    def __init__(self, shape: LlamaShape):
        super().__init__()
        self.gate_proj = nn.Linear(shape.n_embd, shape.intermediate, bias=False)
        self.up_proj = nn.Linear(shape.n_embd, shape.intermediate, bias=False)
        self.down_proj = nn.Linear(shape.intermediate, shape.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # SwiGLU


class LlamaLayer(nn.Module):
    def __init__(self, shape: LlamaShape):
        super().__init__()
        self.input_layernorm = RMSNorm(shape.n_embd, shape.rms_norm_eps)
        self.self_attn = LlamaAttention(shape)
        self.post_attention_layernorm = RMSNorm(shape.n_embd, shape.rms_norm_eps)
        self.mlp = LlamaMLP(shape)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBody(nn.Module):
    """``LlamaForCausalLM.model``: the same submodule names, so that state dicts match key for key."""

    def __init__(self, shape: LlamaShape, vocab_size: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, shape.n_embd)
        self.layers = nn.ModuleList(LlamaLayer(shape) for _ in range(shape.n_layer))
        self.norm = RMSNorm(shape.n_embd, shape.rms_norm_eps)


class Llama(nn.Module):
    """A Llama-shaped decoder: pre-RMSNorm, rotary position embeddings, SwiGLU, no biases."""

    inv_freq: torch.Tensor

    def __init__(self, shape: LlamaShape, context_length: int, vocab_size: int = VOCAB_SIZE):
        super().__init__()
        self.shape, self.context_length, self.vocab_size = shape, context_length, vocab_size
        self.model = LlamaBody(shape, vocab_size)
        self.lm_head = nn.Linear(shape.n_embd, vocab_size, bias=False)
        if shape.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        head_dim = shape.n_embd // shape.n_head
        inv_freq = 1.0 / shape.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                # LlamaConfig.initializer_range, and GPT-2's smaller init of the projections into the residual.
                residual = name.endswith(("o_proj", "down_proj"))
                nn.init.normal_(module.weight, std=0.02 / math.sqrt(2 * shape.n_layer) if residual else 0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """idx: (B, T) int64 token ids -> logits (B, T, vocab_size)."""
        T = idx.shape[1]
        freqs = torch.outer(torch.arange(T, device=idx.device, dtype=torch.float32), self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        x = self.model.embed_tokens(idx)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.model.norm(x))


class CNN(nn.Module):
    """A small VGG-style image classifier: two stages of (3x3 conv, ReLU, 3x3 conv, ReLU, 2x2 max-pool), then
    a hidden layer. No batch norm: its running statistics are buffers, which DiLoCo does not average, so every
    peer's would drift apart from the shared weights."""

    def __init__(
        self, shape: CNNShape, num_classes: int, channels: int, image_size: tuple[int, int], dropout: float
    ):
        super().__init__()
        height, width = image_size
        if height < 4 or width < 4:
            raise ValueError(f"images of {height}x{width} pixels are too small for {shape} (4x4 at least)")
        c1, c2 = shape.channels
        self.image_size, self.channels = (height, width), channels
        self.features = nn.Sequential(
            nn.Conv2d(channels, c1, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(c1, c1, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(c1, c2, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(c2, c2, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Dropout(dropout),
            nn.Linear(c2 * (height // 4) * (width // 4), shape.hidden),
            nn.ReLU(),
            nn.Linear(shape.hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, channels, H, W) float images, normalized -> logits (B, num_classes)."""
        return self.classifier(self.features(x))

    def flops_per_sample(self) -> float:
        """Forward and backward: 6 FLOPs per multiply-add of each weight at each place it is applied."""
        height, width = self.image_size
        total = 0.0
        for layer in self.features:
            if isinstance(layer, nn.Conv2d):
                total += 6.0 * layer.weight.numel() * height * width
            elif isinstance(layer, nn.MaxPool2d):
                height, width = height // 2, width // 2
        return total + 6.0 * sum(m.weight.numel() for m in self.classifier if isinstance(m, nn.Linear))


def flops_per_sample(model: nn.Module) -> float:
    """Training FLOPs per sample: a transformer's 6 x params x tokens (attention left out), or a CNN's count."""
    if isinstance(model, CNN):
        return model.flops_per_sample()
    context_length = int(getattr(model, "context_length", 1))
    return 6.0 * sum(p.numel() for p in model.parameters() if p.requires_grad) * context_length


# Initialization draws from torch's global generator: two threads building models at once (peers of an
# in-process test swarm) would interleave their draws and get different "deterministic" weights. Whoever else
# touches that generator while another thread may be building takes this lock too: the device benchmark's
# fork_rng, which sets the generator's state back as it ends (that reset, landing in the middle of another
# peer's build, once gave that peer other initial weights and a needless rebase at round 0).
GLOBAL_RNG_LOCK = threading.Lock()


def build_model(
    name: str,
    context_length: int,
    dropout: float = 0.0,
    seed: int = 0,
    vocab_size: int = VOCAB_SIZE,
    *,
    num_classes: int | None = None,
    channels: int = 1,
    image_size: tuple[int, int] = (8, 8),
) -> GPT | Llama | CNN:
    """Build a zoo model with deterministic initial weights (same seed, same weights on every peer).

    A language model's vocabulary, or an image classifier's classes, channels and image size, follow the data:
    callers pass ``**data.model_args()``.
    """
    if name not in ZOO:
        raise ValueError(f"unknown model {name!r}; the zoo has {', '.join(ZOO)}")
    shape = ZOO[name]
    with GLOBAL_RNG_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if isinstance(shape, CNNShape):
            if num_classes is None:
                raise ValueError(f"model {name} classifies images: it needs image data (data.source)")
            return CNN(shape, num_classes, channels, image_size, dropout)
        if num_classes is not None:
            raise ValueError(f"model {name} models text: image data (data.source) needs a cnn-* model")
        if isinstance(shape, LlamaShape):
            if dropout:
                raise ValueError(f"model.dropout: {name} has no dropout (Llama trains without); set 0")
            return Llama(shape, context_length, vocab_size)
        return GPT(shape, context_length, dropout, vocab_size)


def num_params(model: nn.Module) -> int:
    # Tied weights appear once in parameters().
    return sum(p.numel() for p in model.parameters())
