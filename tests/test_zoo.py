"""Tests for planc.zoo: shapes, parameter counts, training signal and the GPT weight tie."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
import torch.nn.functional as F

from planc import zoo

TINY_BUILDERS = [zoo.seed_transformer_tiny, zoo.gpt_tiny, zoo.moe_transformer_tiny, zoo.llama_tiny]


# --- expected parameter counts, derived from the configs --------------------------------------


def _linear(n_in: int, n_out: int, bias: bool = True) -> int:
    return n_in * n_out + (n_out if bias else 0)


def _seed_params(c: zoo.SeedConfig) -> int:
    d, f = c.dim, c.ffn_mult * c.dim
    layer_norms = 2 * (2 * d)
    attention = 4 * d * d + 4 * d  # packed in_proj (3d x d + 3d) plus out_proj (d x d + d)
    mlp = _linear(d, f) + _linear(f, d)
    block = layer_norms + attention + mlp
    return c.vocab_size * d + c.n_layers * block + 2 * d + _linear(d, c.vocab_size, bias=False)


def _gpt_params(c: zoo.GPTConfig) -> int:
    d, f = c.dim, c.ffn_mult * c.dim
    block = 2 * (2 * d) + _linear(d, 3 * d) + _linear(d, d) + _linear(d, f) + _linear(f, d)
    # lm_head shares wte's weight, so it adds nothing.
    return c.vocab_size * d + c.context_length * d + c.n_layers * block + 2 * d


def _moe_params(c: zoo.MoEConfig) -> int:
    d, e, h = c.dim, c.num_experts, c.hidden_dim
    attention = _linear(d, 3 * d, bias=False) + _linear(d, d, bias=False)
    block = 2 * d + attention + _linear(d, e, bias=False) + 3 * e * d * h
    return c.vocab_size * d + c.n_layers * block + d + _linear(d, c.vocab_size, bias=False)


def _llama_params(c: zoo.LlamaConfig) -> int:
    d, kv = c.dim, c.n_kv_heads * c.head_dim
    attention = 2 * d * d + 2 * d * kv  # wq, wo (d x d) and wk, wv (kv x d), no biases
    block = 2 * d + attention + 3 * d * c.hidden_dim
    return 2 * c.vocab_size * d + c.n_layers * block + d  # untied output


def _num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    "builder, config, expected",
    [
        (zoo.seed_transformer, zoo.SeedConfig(), _seed_params),
        (zoo.gpt, zoo.GPTConfig(), _gpt_params),
        (zoo.moe_transformer, zoo.MoEConfig(), _moe_params),
        (zoo.seed_transformer_tiny, zoo.SEED_TINY_CONFIG, _seed_params),
        (zoo.gpt_tiny, zoo.GPT_TINY_CONFIG, _gpt_params),
        (zoo.moe_transformer_tiny, zoo.MOE_TINY_CONFIG, _moe_params),
        (zoo.llama, zoo.LlamaConfig(), _llama_params),
        (zoo.llama_tiny, zoo.LLAMA_TINY_CONFIG, _llama_params),
    ],
)
def test_builds_on_meta_with_expected_parameter_count(builder, config, expected):
    with torch.device("meta"):
        model = builder()
    assert model.config == config
    assert all(p.is_meta for p in model.parameters())
    assert list(model.buffers()) == []
    assert _num_params(model) == expected(config)


def test_seed_transformer_is_about_1_41b_and_builds_fast_on_meta():
    # The first normal_ on meta in a process pays for torch's lazy imports; keep it out of
    # the measurement.
    with torch.device("meta"):
        zoo.seed_transformer_tiny()
    start = time.perf_counter()
    with torch.device("meta"):
        model = zoo.seed_transformer()
    elapsed = time.perf_counter() - start
    assert 1.40e9 <= _num_params(model) <= 1.42e9
    assert elapsed < 0.5


def test_seed_transformer_module_tree():
    model = zoo.seed_transformer_tiny()
    c = model.config
    assert isinstance(model.embedding, torch.nn.Embedding)
    assert isinstance(model.norm, torch.nn.LayerNorm)
    assert model.output.weight.shape == (c.vocab_size, c.dim) and model.output.bias is None
    assert len(model.transformer_layers) == c.n_layers
    block = model.transformer_layers[0]
    assert isinstance(block, zoo.Block)
    assert isinstance(block.attention, torch.nn.MultiheadAttention)
    assert block.attention.num_heads == c.n_heads and block.attention.batch_first
    assert isinstance(block.mlp, zoo.MLP)
    assert block.mlp.w_in.weight.shape == (c.ffn_mult * c.dim, c.dim)


def test_full_seed_transformer_has_32_heads_and_4x_mlp():
    with torch.device("meta"):
        model = zoo.seed_transformer()
    block = model.transformer_layers[0]
    assert (model.config.vocab_size, model.config.dim, len(model.transformer_layers)) == (
        50000,
        2048,
        24,
    )
    assert block.attention.num_heads == 32
    assert block.mlp.w_out.weight.shape == (2048, 4 * 2048)


@pytest.mark.parametrize("builder", TINY_BUILDERS)
def test_tiny_forward_backward_gives_finite_loss_and_gradients_everywhere(builder):
    torch.manual_seed(0)
    model = builder()
    tokens = zoo.example_input(model, batch=2, seq=16)
    logits = model(tokens)
    assert logits.shape == (2, 16, model.config.vocab_size)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    assert torch.isfinite(loss)
    loss.backward()
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        assert torch.isfinite(param.grad).all(), name
        assert param.grad.abs().sum() > 0, name


@pytest.mark.parametrize("builder", TINY_BUILDERS)
def test_models_are_causal(builder):
    torch.manual_seed(0)
    model = builder()
    tokens = zoo.example_input(model, batch=1, seq=8)
    changed = tokens.clone()
    changed[0, -1] = (changed[0, -1] + 1) % model.config.vocab_size
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    torch.testing.assert_close(before[:, :-1], after[:, :-1])
    assert not torch.allclose(before[:, -1], after[:, -1])


@pytest.mark.parametrize("builder", TINY_BUILDERS)
def test_tiny_forward_runs_on_meta(builder):
    with torch.device("meta"):
        model = builder()
        tokens = torch.zeros(2, 16, dtype=torch.long)
        logits = model(tokens)
    assert logits.is_meta and logits.shape == (2, 16, model.config.vocab_size)


@pytest.mark.parametrize("builder", TINY_BUILDERS)
def test_tiny_parameter_dims_shard_evenly_over_2_and_4_ranks(builder):
    for name, param in builder().named_parameters():
        assert all(size % 4 == 0 for size in param.shape), (name, tuple(param.shape))


def test_gpt_ties_output_to_input_embedding():
    model = zoo.gpt_tiny()
    assert model.lm_head.weight is model.wte.weight
    names = [name for name, _ in model.named_parameters()]
    assert "wte.weight" in names and "lm_head.weight" not in names


def test_gpt_tie_survives_to_empty_and_assign_load():
    with torch.device("meta"):
        model = zoo.gpt_tiny()
    model.to_empty(device="cpu")
    assert not model.wte.weight.is_meta
    assert model.lm_head.weight is model.wte.weight

    model.load_state_dict(zoo.gpt_tiny().state_dict(), assign=True)
    assert model.lm_head.weight is model.wte.weight


def test_gpt_rejects_sequences_longer_than_context():
    model = zoo.gpt_tiny()
    too_long = model.config.context_length + 1
    with pytest.raises(ValueError, match="context_length"):
        zoo.example_input(model, seq=too_long)
    with pytest.raises(ValueError, match="context_length"):
        model(torch.zeros(1, too_long, dtype=torch.long))


def test_full_gpt_is_gpt2_small():
    with torch.device("meta"):
        model = zoo.gpt()
    c = model.config
    assert (c.vocab_size, c.dim, c.n_layers, c.n_heads, c.context_length) == (
        50257,
        768,
        12,
        12,
        1024,
    )
    assert model.lm_head.weight is model.wte.weight


def test_moe_expert_weights_have_leading_expert_dimension():
    with torch.device("meta"):
        model = zoo.moe_transformer()
    c = model.config
    assert (c.dim, c.n_layers, c.num_experts, c.hidden_dim, c.vocab_size, c.n_heads) == (
        1024,
        8,
        8,
        2816,
        32000,
        16,
    )
    for layer in model.layers:
        experts = layer.moe.experts
        assert isinstance(experts, zoo.GroupedExperts)
        assert experts.w1.shape == (c.num_experts, c.dim, c.hidden_dim)
        assert experts.w2.shape == (c.num_experts, c.hidden_dim, c.dim)
        assert experts.w3.shape == (c.num_experts, c.dim, c.hidden_dim)
        assert layer.moe.router.weight.shape == (c.num_experts, c.dim)
        assert isinstance(layer.attention, zoo.CausalSelfAttention)


def test_moe_matches_per_token_top_k_reference():
    torch.manual_seed(0)
    c = zoo.MOE_TINY_CONFIG
    moe = zoo.MoE(c.dim, c.num_experts, c.hidden_dim, c.top_k)
    x = torch.randn(2, 3, c.dim)
    experts = moe.experts

    expected = torch.zeros_like(x)
    for index in torch.cartesian_prod(torch.arange(2), torch.arange(3)):
        b, s = index.tolist()
        token = x[b, s]
        probs = moe.router(token).softmax(-1)
        weights, chosen = probs.topk(c.top_k)
        weights = weights / weights.sum()
        for weight, e in zip(weights, chosen.tolist()):
            hidden = F.silu(token @ experts.w1[e]) * (token @ experts.w3[e])
            expected[b, s] += weight * (hidden @ experts.w2[e])

    torch.testing.assert_close(moe(x), expected)


def test_grouped_experts_reset_parameters_is_deterministic():
    experts = zoo.GroupedExperts(4, 8, 16)
    torch.manual_seed(123)
    experts.reset_parameters()
    first = [p.clone() for p in experts.parameters()]
    torch.manual_seed(123)
    experts.reset_parameters()
    for before, after in zip(first, experts.parameters()):
        torch.testing.assert_close(before, after, rtol=0, atol=0)
    assert experts.w2.abs().max() <= 1 / 16**0.5  # fan_in of w2 is hidden_dim


def test_example_input_shape_dtype_range_and_generator():
    model = zoo.moe_transformer_tiny()
    tokens = zoo.example_input(model, batch=3, seq=5)
    assert tokens.shape == (3, 5) and tokens.dtype == torch.long
    assert 0 <= tokens.min() and tokens.max() < model.config.vocab_size

    first, second = (
        zoo.example_input(model, generator=torch.Generator().manual_seed(7)) for _ in range(2)
    )
    assert torch.equal(first, second)


def test_example_input_is_real_even_for_meta_models():
    with torch.device("meta"):
        model = zoo.seed_transformer()
        tokens = zoo.example_input(model)
    assert tokens.device.type == "cpu" and tokens.shape == (2, 16)
    assert tokens.max() < 50000


def test_zoo_registry_and_frozen_configs():
    assert set(zoo.ZOO) == {
        "seed_transformer",
        "seed_transformer_tiny",
        "gpt",
        "gpt_tiny",
        "moe_transformer",
        "moe_transformer_tiny",
        "llama",
        "llama_tiny",
        "llama3_405b",
        "llama3_8b",
        "routed_moe",
        "routed_moe_tiny",
        "moe_llama",
        "moe_llama_tiny",
    }
    with torch.device("meta"):
        for name, builder in zoo.ZOO.items():
            model = builder()
            assert dataclasses.is_dataclass(model.config), name
            with pytest.raises(dataclasses.FrozenInstanceError):
                model.config.dim = 1


def test_llama3_405b_is_the_405b_shape_on_meta():
    model = zoo.llama3_405b()
    assert all(p.is_meta for p in model.parameters())
    assert 405e9 < sum(p.numel() for p in model.parameters()) < 406e9  # Llama 3.1 405B: 405.85B


def test_moe_llama_is_qwen3_moe_shaped_on_meta():
    """128 experts of top-8 over 48 blocks of width 2048: about 30.1B parameters (Qwen3-30B-A3B: 30.5B,
    its attention wider: head dim 128)."""
    with torch.device("meta"):
        model = zoo.moe_llama()
    assert 30.0e9 < sum(p.numel() for p in model.parameters()) < 30.2e9
    assert tuple(model.layers[0].moe.experts.w1.shape) == (128, 768, 2048) and model.layers[0].moe.router.top_k == 8
    with pytest.raises(ValueError, match="top_k"):
        zoo.moe_llama(dataclasses.replace(zoo.MOE_LLAMA_TINY_CONFIG, top_k=5))


def test_configs_reject_inconsistent_shapes():
    with pytest.raises(ValueError, match="n_heads"):
        zoo.SeedConfig(dim=30, n_heads=4)
    with pytest.raises(ValueError, match="top_k"):
        zoo.MoEConfig(num_experts=2, top_k=3)
    with pytest.raises(ValueError, match="n_kv_heads"):
        zoo.LlamaConfig(n_heads=32, n_kv_heads=5)
    with pytest.raises(ValueError, match="even"):
        zoo.LlamaConfig(dim=96, n_heads=32)


# --- the tensor-parallel-ready Llama ------------------------------------------------------------


def test_llama_has_torchtitans_module_names_and_full_size_shape():
    with torch.device("meta"):
        model = zoo.llama()
    assert _num_params(model) == 1_498_482_688  # Llama 3.2 1B with an untied output
    names = {n for n, _ in model.named_parameters()}
    assert {"tok_embeddings.weight", "norm.weight", "output.weight"} <= names
    block = {n.split(".", 2)[2] for n in names if n.startswith("layers.0.")}
    assert block == {"attention_norm.weight", "ffn_norm.weight", *(f"attention.{w}.weight" for w in ("wq", "wk", "wv", "wo")),
                     *(f"feed_forward.{w}.weight" for w in ("w1", "w2", "w3"))}
    attention = model.layers[0].attention
    assert attention.wq.weight.shape == (2048, 2048) and attention.wk.weight.shape == (512, 2048)  # 32 q / 8 kv heads
    assert model.layers[0].feed_forward.w2.weight.shape == (2048, 8192)


def test_llama_attention_split_by_heads_sums_to_the_whole():
    """The tensor-parallel math in one process: each half of the heads (q/k/v rows, wo columns)
    run through the same module code gives a partial output; the two sum to the whole. A model
    that viewed projections with the global head count would fail here, as it does under TP."""
    torch.manual_seed(0)
    config = zoo.LLAMA_TINY_CONFIG
    whole = zoo.Attention(config)
    x = torch.randn(2, 16, config.dim)
    parts = []
    for half in range(2):
        part = zoo.Attention(config)
        with torch.no_grad():
            for name in ("wq", "wk", "wv"):
                w = getattr(whole, name).weight
                rows = w.shape[0] // 2
                setattr(part, name, torch.nn.Linear(config.dim, rows, bias=False))
                getattr(part, name).weight.copy_(w[half * rows:(half + 1) * rows])
            cols = whole.wo.weight.shape[1] // 2
            part.wo = torch.nn.Linear(cols, config.dim, bias=False)
            part.wo.weight.copy_(whole.wo.weight[:, half * cols:(half + 1) * cols])
        parts.append(part(x))
    torch.testing.assert_close(parts[0] + parts[1], whole(x), rtol=1e-5, atol=1e-6)


def test_llama_matches_hugging_face_llama_with_the_same_weights():
    """The zoo Llama is a real Llama: Hugging Face's LlamaForCausalLM given the same weights gives
    the same logits (HF rotates halves, the zoo rotates adjacent pairs as Meta's and torchtitan's
    code do: q/k rows are permuted per head as HF's conversion script does)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    c = zoo.LLAMA_TINY_CONFIG
    model = zoo.llama_tiny()
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.dim, intermediate_size=c.hidden_dim, num_hidden_layers=c.n_layers,
        num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads, rms_norm_eps=c.norm_eps,
        rope_theta=c.rope_theta, tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
        max_position_embeddings=64))

    def permute(w: torch.Tensor) -> torch.Tensor:  # adjacent pairs -> halves, per head
        heads = w.shape[0] // c.head_dim
        return w.view(heads, c.head_dim // 2, 2, c.dim).transpose(1, 2).reshape(w.shape)

    sd = {"model.embed_tokens.weight": model.tok_embeddings.weight, "model.norm.weight": model.norm.weight,
          "lm_head.weight": model.output.weight}
    for i, block in enumerate(model.layers):
        p, a, f = f"model.layers.{i}.", block.attention, block.feed_forward
        sd |= {p + "self_attn.q_proj.weight": permute(a.wq.weight), p + "self_attn.k_proj.weight": permute(a.wk.weight),
               p + "self_attn.v_proj.weight": a.wv.weight, p + "self_attn.o_proj.weight": a.wo.weight,
               p + "mlp.gate_proj.weight": f.w1.weight, p + "mlp.up_proj.weight": f.w3.weight,
               p + "mlp.down_proj.weight": f.w2.weight, p + "input_layernorm.weight": block.attention_norm.weight,
               p + "post_attention_layernorm.weight": block.ffn_norm.weight}
    missing, unexpected = hf.load_state_dict({k: v.detach() for k, v in sd.items()}, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    tokens = zoo.example_input(model, batch=2, seq=16)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf(input_ids=tokens).logits, rtol=1e-4, atol=1e-5)


def test_llama3_8b_has_the_published_shape():
    """Meta's Llama 3 8B: 8.03B parameters (embedding and output untied)."""
    with torch.device("meta"):
        model = zoo.llama3_8b()
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248
