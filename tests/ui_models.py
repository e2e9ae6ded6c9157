"""Tiny models for the golden diagnostic cases (`model tests.ui_models:...` in tests/ui/*.plan).

Each model exists to provoke one diagnostic the zoo cannot: a 0-dim parameter (P303), or
modules named like plan keywords (a selector must still reach them). Importable from the
repository root, where `planc check` and the tests run.
"""

from __future__ import annotations

import torch
from torch import nn


class Scaled(nn.Module):
    """A linear layer times a learned scalar: `scale` is a 0-dim parameter FSDP2 rejects."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * self.scale


class ScalarNet(nn.Module):
    """Two `Scaled` blocks in a ModuleList and an output head."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Scaled(dim) for _ in range(2))
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def scalar_net() -> ScalarNet:
    return ScalarNet()


class KeywordNet(nn.Module):
    """Children named like plan keywords: `unit`, `model`, `root`, `mesh`, `where`, `except`."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.model = nn.Linear(dim, dim)
        self.unit = nn.ModuleList(nn.Linear(dim, dim) for _ in range(2))
        self.root = nn.Linear(dim, dim)
        self.mesh = nn.Linear(dim, dim)
        self.where = nn.Linear(dim, dim)
        setattr(self, "except", nn.Linear(dim, dim))
        self.none = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.model(x)
        for u in self.unit:
            x = u(x)
        return getattr(self, "except")(self.where(self.mesh(self.root(x))))


def keyword_net() -> KeywordNet:
    return KeywordNet()


# ===================================================================== resolver fixtures


class Attention(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wo(self.wq(x) * self.wk(x) + self.wv(x))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.relu(self.w1(x)))


class Experts(nn.Module):
    """Expert weights with a leading expert dimension (3-D parameters)."""

    def __init__(self, n: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(n, hidden, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bd,edh,ehk->bk", x, self.w1, self.w2)


class DenseBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = Attention(dim)
        self.mlp = FeedForward(dim, 4 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm(x))
        return x + self.mlp(x)


class SparseBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = Attention(dim)
        self.experts = Experts(4, dim, 2 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm(x))
        return x + self.experts(x)


class FixtureNet(nn.Module):
    """Six alternating dense/sparse blocks between tied input and output embeddings.

    `output.weight` is `tok_embeddings.weight`; `scale` is a 1-D parameter on the root. Sizes
    (dim 8): attention 256, dense MLP 512, experts 1024, norm 16, embeddings 256.
    """

    def __init__(self, dim: int = 8, vocab: int = 32, n_layers: int = 6) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(DenseBlock(dim) if i % 2 == 0 else SparseBlock(dim) for i in range(n_layers))
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        self.output.weight = self.tok_embeddings.weight
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens).mean(1)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x) * self.scale)


def fixture_net() -> FixtureNet:
    return FixtureNet()


# ===================================================================== hostile and odd models


class LongNames(nn.Module):
    """Children with 60-character names of one letter and a tail: a backtracking regex
    (`re"(a|aa)+$"`) takes exponential time on them (P212)."""

    def __init__(self, dim: int = 4) -> None:
        super().__init__()
        for tail in "bcd":
            self.add_module("a" * 60 + tail, nn.Linear(dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for child in self.children():
            x = child(x)
        return x


def long_names() -> LongNames:
    return LongNames()


class SharedBlock(nn.Module):
    def __init__(self, mlp: nn.Module, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class SharedNet(nn.Module):
    """ALBERT-style sharing: one `FeedForward` object registered in both blocks (at
    `blocks.0.mlp` and `blocks.1.mlp`), a three-way tie of one embedding weight between
    `embed`, `head` and `extra_head`, and a root with a `model.`-prefixed child as Hugging
    Face models have (`model.embed_tokens`)."""

    def __init__(self, dim: int = 8, vocab: int = 16) -> None:
        super().__init__()
        shared = FeedForward(dim, 2 * dim)
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(SharedBlock(shared, dim) for _ in range(2))
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.extra_head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.extra_head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.model.embed_tokens(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x) + self.extra_head(x)


def shared_net() -> SharedNet:
    return SharedNet()


class HeadsAttention(nn.Module):
    """Self-attention whose forward splits q/k/v into heads, either with the global head count
    (`view(b, s, n_heads, head_dim)`, which breaks under colwise tensor parallelism) or with the
    local one (`view(b, s, -1, head_dim)`, which works when tp divides the heads). The local kind
    keeps only `head_dim`, so no static check can read its head count: only the simulation finds it."""

    def __init__(self, dim: int, heads: int, global_heads: bool) -> None:
        super().__init__()
        self.head_dim = dim // heads
        if global_heads:
            self.n_heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        n = getattr(self, "n_heads", -1)
        q, k, v = (p(x).view(b, s, n, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, s, -1))


class HeadsNet(nn.Module):
    """Embedding -> 2 x (norm, attention) -> norm -> output: a language model for the TP simulation cases."""

    def __init__(self, vocab: int = 32, dim: int = 64, heads: int = 4, global_heads: bool = False,
                 max_positions: int | None = None) -> None:
        super().__init__()
        self.max_positions = max_positions
        self.embed = nn.Embedding(vocab, dim)
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(2))
        self.attns = nn.ModuleList(HeadsAttention(dim, heads, global_heads) for _ in range(2))
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.max_positions is not None and tokens.shape[1] > self.max_positions:
            raise ValueError(f"sequence of {tokens.shape[1]} tokens is longer than the {self.max_positions} positions")
        x = self.embed(tokens)
        for norm, attn in zip(self.norms, self.attns):
            x = x + attn(norm(x))
        return self.output(self.norm(x))


def global_heads_net() -> HeadsNet:
    """4 heads, the forward viewing with the global count 4 (fails under colwise at any tp > 1)."""
    return HeadsNet(global_heads=True)


def local_heads_net() -> HeadsNet:
    """4 heads, the forward viewing with -1 (works at tp 2 and 4; fails at tp 8)."""
    return HeadsNet(global_heads=False)


def short_context_net() -> HeadsNet:
    """Refuses sequences longer than 8 tokens, in its own forward (no tensor-parallel module involved)."""
    return HeadsNet(max_positions=8)
# ===================================================================== tensor-parallel fixtures


class TPAttention(nn.Module):
    """Grouped-query attention with torchtitan's attribute names (`n_heads`, `n_kv_heads`)."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim).repeat_interleave(q.shape[2] // (self.wk.out_features // self.head_dim), 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).repeat_interleave(q.shape[2] // (self.wv.out_features // self.head_dim), 2)
        out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                               is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class TPFeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))


class TPBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, hidden: int) -> None:
        super().__init__()
        self.attention = TPAttention(dim, n_heads, n_kv_heads)
        self.feed_forward = TPFeedForward(dim, hidden)
        self.attention_norm = nn.RMSNorm(dim)
        self.ffn_norm = nn.RMSNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class TPNet(nn.Module):
    """A torchtitan-shaped Llama: embedding, blocks, norm, output projection (untied unless `tied`)."""

    def __init__(self, dim: int = 32, n_heads: int = 4, n_kv_heads: int = 2, hidden: int = 64, vocab: int = 64,
                 n_layers: int = 2, tied: bool = False) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(TPBlock(dim, n_heads, n_kv_heads, hidden) for _ in range(n_layers))
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def tp_net() -> TPNet:
    """4 query heads, 2 KV heads, hidden 64, vocabulary 64: clean at tensor = 2."""
    return TPNet()


def tp_net_uneven() -> TPNet:
    """Hidden size 42 and vocabulary 50: neither splits over 4 ranks (heads 4 / 4 do)."""
    return TPNet(n_kv_heads=4, hidden=42, vocab=50)


def tp_net_tied() -> TPNet:
    """`output.weight` is `tok_embeddings.weight`."""
    return TPNet(tied=True)


def tp_net_odd_vocab() -> TPNet:
    """Vocabulary 50: not a multiple of 4 (everything else splits over 4 ranks)."""
    return TPNet(n_kv_heads=4, vocab=50)


def no_blocks_net() -> nn.Module:
    """A language model with no repeated block: nothing for `planc suggest` to search over (P951)."""
    return nn.Sequential(nn.Embedding(128, 8), nn.Linear(8, 128))


def routed_moe_top6():
    """The routed MoE tiny whose routers keep 6 experts of 4 (P486's golden; a model without
    the config's own check, as a hand-built one may be)."""
    from planc.zoo.routed import routed_moe_tiny

    model = routed_moe_tiny()
    for layer in model.layers:
        layer.moe.router.top_k = 6
    return model
