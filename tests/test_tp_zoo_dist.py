"""The zoo Llama under plans/zoo-llama-tp.plan (sequence and loss parallel on) in real processes.

One launch of 4 gloo ranks, a 2 x 2 mesh (2 data-parallel x 2 tensor-parallel), fp32,
`planc.zoo:llama_tiny` (4 query heads, 2 KV heads), 3 AdamW steps. Every check reads the
results of that one launch:

* the losses equal one unsharded process within 1e-5 relative: sequence parallel norms,
  gathered attention and feed-forward inputs, reduce-scattered outputs, the loss on
  vocabulary-sharded logits inside `applied.loss_parallel()`;
* each parameter's placements and local shape, read back from its DTensor, are what planc
  predicts: the tensor-parallel dim of `planc.lower.lowering.tensor_dims` on the tensor
  axis, FSDP's dim-0 shard on the data-parallel axis (strided where both split dim 0), and
  per mesh axis exactly what `planc explain` prints (`parameter_placements`); the bytes each
  rank holds equal the memory estimate's sharded bytes;
* torchtitan's Llama 3 `apply_tp` + `apply_fsdp` written by hand in this file (one
  `parallelize_module` per block, `fully_shard` per block and the root) builds the same
  placements and trains to bitwise-equal losses and parameters; so does the code
  `planc emit` prints for the plan;
* DCP: a checkpoint saved under a 1-D FSDP plan loads under the 2-D plan, and one saved under
  the 2-D plan loads under the 1-D plan, every model and optimizer entry equal bit for bit;
  the resumed runs continue as the never-interrupted one does;
* `planc.materialize` of the model built on meta and sharded 2-D allocates 2-D DTensors, runs
  the model's own initialiser (finite, the norms' ones as in an eager build) and trains;
  loaded with the eager model's full state dict, or materialized with `reproducible=True`
  and the eager seed, it holds exactly the eager parameters and trains to losses bitwise
  equal to the eagerly built run.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.nn.functional as F
from distributed import run, train_example
from training import batches

import planc
from planc import zoo

pytestmark = pytest.mark.dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLAN_PATH = os.path.join(ROOT, "plans", "zoo-llama-tp.plan")
DP, TP = 2, 2

# The same units on a 1-D mesh, no tensor parallelism: the other side of the DCP checks.
ONE_D_PLAN = """
model planc.zoo:llama_tiny
mesh (shard = *)

unit tok_embeddings
unit layers.*
unit [norm, output] { reshard after_forward = false }
root { reshard after_forward = false }
"""


def tp_plan():
    """The shipped plan, pointed at the tiny model (every other line as shipped)."""
    with open(PLAN_PATH, encoding="utf-8") as f:
        text = f.read()
    assert "\nmodel planc.zoo:llama\n" in text
    return planc.loads(text.replace("\nmodel planc.zoo:llama\n", "\nmodel planc.zoo:llama_tiny\n"), filename=PLAN_PATH)


def build(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return zoo.llama_tiny()


def steps(model, data, dp_rank: int = 0, dp: int = 1, *, context=contextlib.nullcontext, optimizer=None):
    """AdamW steps on this data-parallel rank's slice of each global batch; (mean losses, optimizer).

    The loss and its backward run inside `context` (loss parallel: the logits are a DTensor
    sharded on the vocabulary). Tensor-parallel ranks hold equal losses, so the mean over all
    ranks is the mean over the data-parallel ones.
    """
    import torch.distributed as dist

    optimizer = optimizer or torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    losses = []
    for tokens in data:
        per = tokens.shape[0] // dp
        local = tokens[dp_rank * per:(dp_rank + 1) * per]
        logits = model(local)
        with context():
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), local[:, 1:].flatten(0, 1))
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        value = loss.detach()
        value = (value.full_tensor() if hasattr(value, "full_tensor") else value).clone()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(value)
            value /= dist.get_world_size()
        losses.append(value.item())
    return losses, optimizer


def read_placements(model) -> dict:
    """name -> (mesh dims, placements as torch prints them, local shape), for DTensor parameters."""
    from torch.distributed.tensor import DTensor

    return {n: (tuple(p.device_mesh.mesh_dim_names), tuple(str(x) for x in p.placements), tuple(p.to_local().shape))
            for n, p in model.named_parameters() if isinstance(p, DTensor)}


def predicted_placements(compiled, model) -> dict:
    """What planc's compiled plan says each parameter becomes, in `read_placements`' form.

    The tensor axis: the dim `tensor_dims` names (Shard) or Replicate. The data-parallel axis:
    FSDP's default Shard(0), printed strided (`_S(0, tp)`) when tensor parallelism split dim 0
    too. Local shape: the tensor-parallel split, then FSDP's dim-0 split (every dim divides).
    """
    from planc.lower.lowering import tensor_dims

    dims = tensor_dims(compiled.program, compiled.graph)
    out = {}
    for name, p in model.named_parameters():
        d = dims.get(name)
        shape = list(p.shape)
        if d is not None:
            shape[d] //= TP
        shape[0] //= DP
        dp_placement = f"_S(0, {TP})" if d == 0 else "S(0)"
        out[name] = (("shard", "tensor"), (dp_placement, "R" if d is None else f"S({d})"), tuple(shape))
    return out


# --------------------------------------------------------------------- written by hand (torchtitan)


def torchtitan_style(model, mesh):
    """torchtitan's Llama 3 `apply_tp` (sequence and loss parallel on) and `apply_fsdp`, by hand."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    tp_mesh, dp_mesh = mesh["tensor"], mesh["shard"]
    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    })
    for block in model.layers:
        parallelize_module(block, tp_mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        })
    fully_shard(model.tok_embeddings, mesh=dp_mesh)
    for block in model.layers:
        fully_shard(block, mesh=dp_mesh)
    fully_shard([model.norm, model.output], mesh=dp_mesh, reshard_after_forward=False)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False)
    return model


# --------------------------------------------------------------------- the ranks


def _ranks(rank: int, world: int, path: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from proof_workers import full_params, full_state, sharded_load
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_model_state_dict
    from torch.distributed.tensor.parallel import loss_parallel

    from planc.estimate.memory import unit_memory

    out: dict = {}
    model = build()
    data = batches(model)
    eager_state = {k: v.clone() for k, v in model.state_dict().items()}
    applied = planc.apply(model, tp_plan())
    mesh = applied.mesh
    dp_rank = mesh["shard"].get_local_rank()
    out["mesh"] = (tuple(mesh.mesh_dim_names), tuple(mesh.shape))
    out["placements"] = read_placements(model)
    out["predicted"] = predicted_placements(applied.compiled, build())
    from planc.analysis.explain import parameter_placements, placement_text

    out["explained"] = parameter_placements(applied.compiled, world)  # what `planc explain` prints
    out["read_back_texts"] = {n: {d: placement_text(x) for d, x in zip(p.device_mesh.mesh_dim_names, p.placements)}
                              for n, p in model.named_parameters()}
    out["plain"] = [n for n, p in model.named_parameters() if n not in out["placements"]]
    out["loss_parallel_on"] = not isinstance(applied.loss_parallel(), contextlib.nullcontext)
    out["estimated"] = sum(m.sharded for m in unit_memory(applied.compiled.program, applied.compiled.graph, world))
    out["local"] = applied.local_param_bytes()
    # sequence parallel really is on: the residual stream between blocks is a sequence shard
    seen = {}
    hook = model.layers[0].register_forward_hook(lambda m, a, o: seen.update(block_out=tuple(o.shape)))
    out["losses"], _ = steps(model, data, dp_rank, DP, context=applied.loss_parallel)
    hook.remove()
    out["block_output_shape"] = seen["block_out"]
    out["params"] = full_params(model)

    # (c) the same sharding written by hand
    by_hand = torchtitan_style(build(), mesh)
    out["by_hand_placements"] = read_placements(by_hand)
    out["by_hand_losses"], _ = steps(by_hand, data, dp_rank, DP, context=loss_parallel)
    out["by_hand_params"] = full_params(by_hand)

    # the code `planc emit` prints for the plan (the sequence-parallel styles written out), run
    from planc.backends.emit import emit_python

    namespace: dict = {}
    exec(emit_python(planc.compile(tp_plan(), zoo.llama_tiny(), world)), namespace)
    emitted = namespace["apply_plan"](build(), mesh)
    out["emitted_placements"] = read_placements(emitted)
    out["emitted_losses"], _ = steps(emitted, data, dp_rank, DP, context=loss_parallel)

    # (d) DCP: 1-D FSDP -> 2-D -> 1-D
    one_d = build(0)
    planc.apply(one_d, planc.loads(ONE_D_PLAN, filename="one_d.plan"))
    out["one_d_placements"] = read_placements(one_d)
    first, opt_one_d = steps(one_d, data[:1], rank, world)
    msd, osd = get_state_dict(one_d, opt_one_d)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(path, "one_d"))
    out["saved_one_d"] = full_state(one_d, opt_one_d)
    two_d = build(1)  # another init: every loaded value must come from the checkpoint
    lp = planc.apply(two_d, tp_plan(), mesh=mesh)
    opt_two_d = torch.optim.AdamW(two_d.parameters(), lr=1e-2, foreach=True)
    out["two_d_before_load"] = full_params(two_d)
    sharded_load(two_d, opt_two_d, os.path.join(path, "one_d"))
    out["loaded_two_d"] = full_state(two_d, opt_two_d)
    out["resumed_two_d_losses"], _ = steps(two_d, data[1:2], dp_rank, DP, context=lp.loss_parallel, optimizer=opt_two_d)
    out["uninterrupted_one_d_losses"], _ = steps(one_d, data[1:2], rank, world, optimizer=opt_one_d)
    msd, osd = get_state_dict(two_d, opt_two_d)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(path, "two_d"))
    out["saved_two_d"] = full_state(two_d, opt_two_d)
    back = build(2)
    planc.apply(back, planc.loads(ONE_D_PLAN, filename="one_d.plan"))
    opt_back = torch.optim.AdamW(back.parameters(), lr=1e-2, foreach=True)
    sharded_load(back, opt_back, os.path.join(path, "two_d"))
    out["loaded_back"] = full_state(back, opt_back)
    out["first_one_d_losses"] = first

    # (e) meta build -> 2-D apply -> materialize
    with torch.device("meta"):
        meta = zoo.llama_tiny()
    planc.apply(meta, tp_plan(), mesh=mesh)
    out["meta_on_meta"] = all(p.device.type == "meta" for p in meta.parameters())
    torch.manual_seed(0)
    planc.materialize(meta, "cpu")
    out["meta_placements"] = read_placements(meta)
    out["meta_devices"] = sorted({p.to_local().device.type for p in meta.parameters()})
    out["meta_finite"] = all(bool(torch.isfinite(p.to_local()).all()) for p in meta.parameters())
    out["meta_params"] = full_params(meta)
    out["meta_losses"], _ = steps(meta, data, dp_rank, DP, context=applied.loss_parallel)
    with torch.device("meta"):
        loaded = zoo.llama_tiny()
    lp_loaded = planc.apply(loaded, tp_plan(), mesh=mesh)
    planc.materialize(loaded, "cpu")
    set_model_state_dict(loaded, eager_state, options=StateDictOptions(full_state_dict=True))
    out["loaded_params"] = full_params(loaded)
    with torch.device("meta"):
        exact = zoo.llama_tiny()
    lp_exact = planc.apply(exact, tp_plan(), mesh=mesh)
    torch.manual_seed(0)  # the eager build's seed
    planc.materialize(exact, "cpu", reproducible=True)
    out["reproducible_params"] = full_params(exact)
    out["reproducible_losses"], _ = steps(exact, data, dp_rank, DP, context=lp_exact.loss_parallel)
    out["loaded_losses"], _ = steps(loaded, data, dp_rank, DP, context=lp_loaded.loss_parallel)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run(_ranks, DP * TP, str(tmp_path_factory.mktemp("dcp_tp")), timeout=900)


@pytest.fixture(scope="module")
def unsharded():
    model = build()
    data = batches(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    losses, _ = steps(model, data)
    return {"losses": losses, "init": state}


# --------------------------------------------------------------------- (a) losses


def test_losses_match_one_unsharded_process_with_sequence_and_loss_parallel(results, unsharded):
    expected = unsharded["losses"]
    assert len(expected) == 3 and expected[-1] < expected[0]  # it trains
    for r in results:
        assert r["mesh"] == (("shard", "tensor"), (DP, TP))
        assert r["loss_parallel_on"]
        assert r["losses"] == pytest.approx(expected, rel=1e-5)
        # between blocks each rank holds its half of the 16 tokens (its dp slice: 2 sequences)
        assert r["block_output_shape"] == (2, 16 // TP, zoo.LLAMA_TINY_CONFIG.dim)


# --------------------------------------------------------------------- (b) placements


def test_placements_and_local_shapes_are_what_planc_predicts(results):
    for r in results:
        assert r["plain"] == []
        assert r["placements"] == r["predicted"]
        assert r["read_back_texts"] == r["explained"]  # per mesh axis, as `planc explain` prints them
    got = results[0]["placements"]
    # spot checks against torchtitan's plan, independent of planc's prediction
    assert got["layers.0.attention.wq.weight"] == (("shard", "tensor"), ("_S(0, 2)", "S(0)"), (16, 64))
    assert got["layers.0.attention.wk.weight"][1:] == (("_S(0, 2)", "S(0)"), (8, 64))  # 2 KV heads x 16: one per rank
    assert got["layers.0.attention.wo.weight"][1:] == (("S(0)", "S(1)"), (32, 32))
    assert got["layers.0.feed_forward.w2.weight"][1:] == (("S(0)", "S(1)"), (32, 64))
    assert got["tok_embeddings.weight"][1:] == (("_S(0, 2)", "S(0)"), (32, 64))  # the vocabulary over tp
    assert got["output.weight"][1:] == (("_S(0, 2)", "S(0)"), (32, 64))
    assert got["layers.1.ffn_norm.weight"][1:] == (("S(0)", "R"), (32,))  # sequence: replicated on tp
    assert got["norm.weight"][1:] == (("S(0)", "R"), (32,))


def test_bytes_per_rank_equal_the_estimate(results):
    for r in results:
        assert r["local"] == r["estimated"]


# --------------------------------------------------------------------- (c) by hand


def test_hand_written_torchtitan_sharding_is_identical_and_bitwise_equal(results):
    for r in results:
        assert r["by_hand_placements"] == r["placements"]
        assert r["by_hand_losses"] == r["losses"]  # exact float equality
        for name, value in r["by_hand_params"].items():
            assert torch.equal(r["params"][name], value), name


def test_emitted_code_shards_identically_and_trains_bitwise_equal(results):
    for r in results:
        assert r["emitted_placements"] == r["placements"]
        assert r["emitted_losses"] == r["losses"]


# --------------------------------------------------------------------- (d) DCP


def _assert_identical(actual, expected, where=""):
    from test_checkpoint_dist import assert_identical

    assert_identical(actual, expected, where)


def test_dcp_one_d_checkpoint_loads_under_the_2d_plan_and_back(results):
    r = results[0]
    # really another sharding: 1-D shards on dim 0 over 4 ranks, 2-D splits heads over tp
    assert r["one_d_placements"]["layers.0.attention.wo.weight"] == (("shard",), ("S(0)",), (16, 64))
    saved = r["saved_one_d"]
    assert set(saved["optim"]["state"]) == set(saved["model"]) and len(saved["model"]) == 21
    assert all(float(s["step"]) == 1.0 for s in saved["optim"]["state"].values())
    # the values come from the checkpoint: the model they were loaded into started elsewhere
    assert not torch.equal(r["two_d_before_load"]["output.weight"], saved["model"]["output.weight"])
    _assert_identical(r["loaded_two_d"]["model"], saved["model"], "1-D -> 2-D model")
    _assert_identical(r["loaded_two_d"]["optim"], saved["optim"], "1-D -> 2-D optim")
    _assert_identical(r["loaded_back"]["model"], r["saved_two_d"]["model"], "2-D -> 1-D model")
    _assert_identical(r["loaded_back"]["optim"], r["saved_two_d"]["optim"], "2-D -> 1-D optim")
    assert all(float(s["step"]) == 2.0 for s in r["saved_two_d"]["optim"]["state"].values())
    for x in results:  # resumed under 2-D, the second step is the uninterrupted 1-D run's
        assert x["resumed_two_d_losses"] == pytest.approx(x["uninterrupted_one_d_losses"], rel=1e-5)
        assert x["first_one_d_losses"] == pytest.approx(results[0]["losses"][:1], rel=1e-5)


# --------------------------------------------------------------------- (e) materialize


def test_materialize_on_a_2d_sharded_meta_model(results, unsharded):
    for r in results:
        assert r["meta_on_meta"] and r["meta_finite"] and r["meta_devices"] == ["cpu"]
        assert r["meta_placements"] == r["placements"]
        # the model's own init ran: RMSNorm weights are ones as in the eager build, the rest random
        for name, value in r["meta_params"].items():
            if name.endswith("norm.weight"):
                assert torch.equal(value, unsharded["init"][name]), name
            else:
                assert value.std() > 0, name
        assert r["meta_losses"][-1] < r["meta_losses"][0]
        assert r["meta_losses"] == results[0]["meta_losses"]  # the ranks agree
        # loaded with the eager model's full state dict: exactly the eager parameters, and the
        # same run as the eagerly built model under the same plan, bit for bit
        for name, value in unsharded["init"].items():
            assert torch.equal(r["loaded_params"][name], value), name
        assert r["loaded_losses"] == r["losses"]


def test_reproducible_materialize_gives_the_eager_parameters_under_2d_sharding(results, unsharded):
    """`materialize(..., reproducible=True)`: each module initialised at full size, each rank keeps
    its shard of it: with the eager build's seed, the eager parameters bit for bit, and the same run."""
    for r in results:
        for name, value in unsharded["init"].items():
            assert torch.equal(r["reproducible_params"][name], value), name
        assert r["reproducible_losses"] == r["losses"]
    # the default initialiser draws each shard from the rank's own generator: not the eager values
    assert not torch.equal(results[0]["meta_params"]["layers.0.attention.wq.weight"],
                           unsharded["init"]["layers.0.attention.wq.weight"])


# --------------------------------------------------------------------- the example script


def test_example_trains_the_2d_plan_under_torchrun():
    """examples/train.py with the shipped 2-D plan: TP groups share a batch slice, loss parallel on."""
    stdout, losses = train_example("--plan", "plans/zoo-llama-tp.plan", "--model", "planc.zoo:llama_tiny", "--steps", "4",
                                   procs=DP * TP, timeout=600)
    assert "on mesh {'shard': 2, 'tensor': 2}" in stdout
    assert len(losses) == 4 and losses[-1] < losses[0], stdout

