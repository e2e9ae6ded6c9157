"""Pipeline stages built from the whole model by pass-throughs (planc/model/split.py).

Oracle: the unsplit model. Chained, the stages compute exactly its forward; each stage keeps
the very modules of its part under their paths in the whole model, and nothing else that trains.
"""

from __future__ import annotations

import pytest
import torch

from planc import zoo
from planc.model.split import PassThrough, SplitError, check_chain, check_split, split

STAGES = [("tok_embeddings", "layers.0"), ("layers.1",), ("norm", "output")]


def _tokens(model, batch=2, seq=8):
    return torch.randint(0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))


def test_chained_stages_equal_the_whole_model():
    torch.manual_seed(0)
    model = zoo.llama_tiny()
    x = _tokens(model)
    h = x
    for mods in STAGES:
        h = split(model, mods)(h)
    assert torch.equal(h, model(x))


def test_a_stage_keeps_its_modules_under_their_paths():
    model = zoo.llama_tiny()
    stage = split(model, STAGES[1])
    assert stage is not model and type(stage) is type(model)
    assert stage.layers[1] is model.layers[1]
    assert [n for n, _ in stage.named_parameters()] == [n for n, _ in model.named_parameters()
                                                         if n.startswith("layers.1.")]
    assert isinstance(stage.tok_embeddings, PassThrough) and isinstance(stage.layers[0], PassThrough)
    assert model.layers[0] is not None and not isinstance(model.tok_embeddings, PassThrough)  # the model is untouched
    assert split(model, ("",)) is model


def test_split_on_meta_allocates_nothing_and_checks_the_chain():
    with torch.device("meta"):
        model = zoo.llama_tiny()
    h = _tokens(model)
    for mods in STAGES:
        stage = split(model, mods)
        assert all(p.is_meta for p in stage.parameters())
        h = check_chain(stage, [h])
    assert h.shape == (2, 8, model.config.vocab_size)


def test_a_forward_that_is_not_a_chain_is_refused():
    """GPT adds the position embedding to the token embedding: a pass-through for `wpe` is wrong."""
    with torch.device("meta"):
        model = zoo.gpt_tiny()
    hidden = torch.empty(2, 8, model.wte.weight.shape[1], device="meta")
    with pytest.raises(SplitError, match="`wpe` is outside this pipeline stage and the forward passes it a torch.int64"):
        check_chain(split(model, ("blocks.1", "ln_f")), [hidden])


def test_unknown_module_and_parameters_across_stages_are_refused():
    model = zoo.llama_tiny()
    with pytest.raises(SplitError, match="not a module"):
        split(model, ("layers.7",))
    model.layers.register_parameter("scale", torch.nn.Parameter(torch.ones(1)))
    with pytest.raises(SplitError, match="`layers` owns parameters"):
        split(model, ("layers.0",))


def test_a_hugging_face_llama_splits_into_stages():
    """HF's forward builds masks and positions from the hidden state's shape and loops over
    `self.layers[:n]`: with pass-throughs the chained stages give its logits exactly."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    x = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    cut = [("model.embed_tokens",), ("model.layers.0", "model.layers.1"), ("model.norm", "lm_head")]
    h = x
    for mods in cut:
        stage = split(model, mods)
        h = stage(h)
        assert isinstance(h, torch.Tensor)
        assert stage.model.rotary_emb is model.model.rotary_emb  # no parameters: shared by every stage
    assert torch.equal(h, model(x).logits)
    assert model.config.use_cache  # the stages' copies turned it off, not the model


def test_check_split_runs_every_stage_chained_on_meta():
    with torch.device("meta"):
        llama, gpt = zoo.llama_tiny(), zoo.gpt_tiny()
    assert check_split(llama, STAGES, [_tokens(llama)]).shape == (2, 8, llama.config.vocab_size)
    tokens = torch.randint(0, 64, (2, 8))
    with pytest.raises(SplitError, match=r"^stage 1 \(blocks.1, ln_f\): `wpe` is outside .* torch.int64 tensor of shape \(8,\)"):
        check_split(gpt, [("wte", "wpe", "blocks.0"), ("blocks.1", "ln_f")], [tokens])


def test_a_pass_through_refuses_token_ids_at_run_time():
    """On real tensors too: GPT's later stage would add `wpe(positions)`, positions passed through."""
    model = zoo.gpt_tiny()
    stage = split(model, ("blocks.1", "ln_f"))
    with pytest.raises(SplitError, match="`wpe` is outside this pipeline stage and the forward passes it a torch.int64"):
        stage(torch.randn(2, 8, model.wte.weight.shape[1]))


def _identity_split(model, keep):
    """torchtitan-style: a deep copy with every block and embedding outside `keep` an `nn.Identity`."""
    import copy

    part = copy.deepcopy(model)
    for name in ("wte", "wpe", "ln_f", "lm_head"):
        if name not in keep:
            setattr(part, name, torch.nn.Identity())
    for i in range(len(part.blocks)):
        if f"blocks.{i}" not in keep:
            part.blocks[i] = torch.nn.Identity()
    return part


def test_fact_gpt_split_by_identities_trains_another_function():
    """What torch does with GPT cut the torchtitan way (modules outside a stage replaced by
    `nn.Identity`): stage 1 adds the token positions (`wpe` gone) to its hidden state. When the
    sequence is as long as the hidden size nothing fails and the logits are silently another
    function's; otherwise the forward fails deep inside, on a broadcast. P456 refuses it statically."""
    torch.manual_seed(0)
    model = zoo.gpt_tiny()
    first, second = _identity_split(model, ("wte", "wpe", "blocks.0")), _identity_split(model, ("blocks.1", "ln_f", "lm_head"))
    dim = model.wte.weight.shape[1]
    x = torch.randint(0, 128, (2, dim), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        chained, whole = second(first(x)), model(x)
    assert chained.shape == whole.shape and (chained - whole).abs().max() > 1e-2  # no error, wrong logits
    with pytest.raises(RuntimeError, match="size of tensor"):
        second(first(x[:, :8]))


def test_check_refuses_a_forward_that_is_not_a_chain_p456():
    """`planc check` runs the stages chained on meta: GPT's stage 1 is P456 on its `stage` line;
    the same check passes the zoo Llama (a chain); a real (CPU) model is probed on a meta copy."""
    import planc

    text = ("model planc.zoo:gpt_tiny\nmesh (pipeline = 2, shard = *)\npipeline 1F1B { microbatches 4 }\n"
            "stage 0: wte, wpe, blocks.0\nstage 1: blocks.1, ln_f, lm_head\nunit blocks.*\n")
    model = zoo.gpt_tiny()
    compiled = planc.compile(planc.loads(text, filename="gpt-pp.plan"), model, 4, strict=False)
    (found,) = [d for d in compiled.diagnostics if d.code == "P456"]
    assert found.span.line == 5 and "`wpe` is outside this pipeline stage" in found.message
    assert not model.wte.weight.is_meta  # the model checked is untouched
    llama = text.replace("gpt_tiny", "llama_tiny").replace("wte, wpe, blocks.0", "tok_embeddings, layers.0").replace(
        "blocks.1, ln_f, lm_head", "layers.1, norm, output").replace("blocks.*", "layers.*")
    compiled = planc.compile(planc.loads(llama, filename="llama-pp.plan"), zoo.llama_tiny(), 4, strict=False)
    assert [d.code for d in compiled.diagnostics if d.is_error] == []


def test_a_hugging_face_llama_passes_the_chain_check():
    """HF's stage forward calls `.item()`, which fails on meta: not judged, no P456 (it splits soundly)."""
    transformers = pytest.importorskip("transformers")
    import planc

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    text = ("mesh (pipeline = 2, shard = *)\npipeline 1F1B { microbatches 4 }\n"
            "stage 0: model.embed_tokens, model.layers.0\nstage 1: model.layers.1, model.norm, lm_head\n"
            "unit model.layers.*\n")
    compiled = planc.compile(planc.loads(text, filename="hf-pp.plan"), transformers.LlamaForCausalLM(config), 4,
                             strict=False)
    assert [d.code for d in compiled.diagnostics if d.is_error] == []
