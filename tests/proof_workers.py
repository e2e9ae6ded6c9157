"""Per-rank bodies of the distributed proofs: torchtitan equivalence, HSDP, DCP checkpoints.

Each `*_worker(rank, world_size, ...)` runs inside one gloo rank started by
`tests.distributed.run` and returns plain, picklable results (floats, shapes, CPU tensors);
the tests compare them in the pytest process. Everything is real: `fully_shard`, DTensors on
a CPU device mesh, collectives and AdamW steps. The hand-written reference code here is what a
user would write without planc (torchtitan's `apply_fsdp`), so it must not import planc's
runtime.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

import planc
from planc import zoo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHTITAN_PLAN = os.path.join(ROOT, "plans", "torchtitan.plan")

# Sequences per rank and tokens per sequence (plus one for the shifted targets).
BATCH, SEQ = 2, 16


# ------------------------------------------------------------------------------ reference code


def torchtitan_fsdp(model: nn.Module, mesh, *, embedding: str = "embedding",
                    layers: str = "transformer_layers",
                    param_dtype: torch.dtype | None = torch.bfloat16) -> nn.Module:
    """torchtitan's `apply_fsdp` (default reshard policy, no pipelining), written by hand.

    Args:
        model: a decoder with `embedding`, `layers`, `norm` and `output` children.
        mesh: the 1-D data-parallel device mesh.
        embedding: attribute name of the token embedding (`tok_embeddings` in torchtitan).
        layers: attribute name of the block list (`layers` in torchtitan).
        param_dtype: compute dtype of the parameters (torchtitan's default: bf16).
    """
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32,
                                     cast_forward_inputs=False)
    fsdp_config = {"mesh": mesh, "mp_policy": mp_policy}
    fully_shard(getattr(model, embedding), **fsdp_config, reshard_after_forward=True)
    for block in getattr(model, layers):
        fully_shard(block, **fsdp_config, reshard_after_forward=True)
    # As in torchtitan: the last layers would be all-gathered again at once for backward.
    fully_shard([model.norm, model.output], **fsdp_config, reshard_after_forward=False)
    fully_shard(model, **fsdp_config)
    return model


# ------------------------------------------------------------------------------ observations


def fsdp_units(model: nn.Module) -> dict[tuple[str, ...], dict]:
    """What `fully_shard` actually built, read back from FSDP2's own state.

    Call after one forward: FSDP2 settles the root's resharding in its lazy init.

    Returns:
        {module names of the unit (root: `("",)`): {"params", "mp", "reshard_after_forward",
        "offload", "mesh", "placements"}}, one entry per `fully_shard` call.
    """
    module_names = {id(m): name for name, m in model.named_modules()}
    units: dict[tuple[str, ...], dict] = {}
    seen: set[int] = set()
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        if id(state) in seen:
            continue
        seen.add(id(state))
        key = tuple(module_names[id(m)] for m in state._modules)
        params, placements = [], {}
        policy = state._mp_policy
        mp = (policy.param_dtype, policy.reduce_dtype, policy.output_dtype, policy.cast_forward_inputs)
        # A unit without parameters (an empty root) has no group, hence no resharding to do.
        reshard = offload = mesh = None
        for group in state._fsdp_param_groups:
            reshard = group.post_forward_mesh_info is not None
            offload = type(group.offload_policy).__name__
            for fsdp_param in group.fsdp_params:
                info = fsdp_param._module_info
                prefix = module_names[id(info.module)]
                name = f"{prefix}.{info.param_name}" if prefix else info.param_name
                params.append(name)
                dtensor = fsdp_param.sharded_param
                placements[name] = tuple(str(p) for p in dtensor.placements)
                mesh = tuple(dtensor.device_mesh.shape)
        units[key] = {"params": tuple(sorted(params)), "mp": mp, "reshard_after_forward": reshard,
                      "offload": offload, "mesh": mesh, "placements": placements}
    return units


def fsdp_module_names(model: nn.Module) -> list[str]:
    """Names of the modules `fully_shard` turned into `FSDPModule`s, in module order."""
    return [name for name, m in model.named_modules() if isinstance(m, FSDPModule)]


def batches(steps: int, rank: int, world_size: int, vocab: int, *, seed: int = 1234) -> list[torch.Tensor]:
    """Token batches `[BATCH, SEQ + 1]` for one rank: a different slice of the data per rank."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        everyone = torch.randint(0, vocab, (world_size, BATCH, SEQ + 1), generator=gen)
        out.append(everyone[rank])
    return out


def global_batches(steps: int, world_size: int, vocab: int, *, seed: int = 1234) -> list[torch.Tensor]:
    """The union of every rank's `batches` per step, `[world_size * BATCH, SEQ + 1]`."""
    per_rank = [batches(steps, r, world_size, vocab, seed=seed) for r in range(world_size)]
    return [torch.cat([per_rank[r][s] for r in range(world_size)]) for s in range(steps)]


def train(model: nn.Module, data: list[torch.Tensor], *, lr: float = 1e-2,
          optimizer: torch.optim.Optimizer | None = None,
          grads: list | None = None) -> tuple[list[float], torch.optim.Optimizer]:
    """Runs one AdamW step per batch (next-token cross entropy); returns the local losses.

    Args:
        grads: if given, each step's full gradients (`{name: tensor}`) are appended to it.
    """
    optimizer = optimizer or torch.optim.AdamW(model.parameters(), lr=lr, foreach=True)
    losses = []
    for tokens in data:
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        if grads is not None:
            grads.append({name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
                          for name, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, optimizer


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gathered to a full CPU tensor (a collective: call on every rank)."""
    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if isinstance(p, DTensor) else p
        out[name] = t.detach().clone()
    return out


def mean_over_ranks(values: list[float]) -> list[float]:
    """The all-reduced mean of per-rank values (the global loss under equal batch sizes)."""
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


# ------------------------------------------------------------------------------ workers


def equivalence_worker(rank: int, world_size: int, steps: int) -> dict:
    """Trains seed_transformer_tiny under plans/torchtitan.plan and under `torchtitan_fsdp`.

    Both models start from the same seed and see the same data; returns their unit
    structures, local losses and final full parameters, plus the losses of an fp32 control.
    """
    data = batches(steps, rank, world_size, zoo.SEED_TINY_CONFIG.vocab_size)

    torch.manual_seed(0)
    planned = zoo.seed_transformer_tiny()
    planc.apply(planned, TORCHTITAN_PLAN)

    torch.manual_seed(0)
    by_hand = zoo.seed_transformer_tiny()
    torchtitan_fsdp(by_hand, init_device_mesh("cpu", (world_size,), mesh_dim_names=("shard",)))

    # Control: the same recipe in fp32, to show that the comparison can tell precisions apart.
    torch.manual_seed(0)
    fp32 = zoo.seed_transformer_tiny()
    torchtitan_fsdp(fp32, init_device_mesh("cpu", (world_size,), mesh_dim_names=("shard",)),
                    param_dtype=None)

    planned_losses, _ = train(planned, data)
    by_hand_losses, _ = train(by_hand, data)
    fp32_losses, _ = train(fp32, data)
    return {
        "planned_fsdp_modules": fsdp_module_names(planned), "by_hand_fsdp_modules": fsdp_module_names(by_hand),
        "fp32_losses": fp32_losses,
        "planned_units": fsdp_units(planned), "by_hand_units": fsdp_units(by_hand),
        "planned_losses": planned_losses, "by_hand_losses": by_hand_losses,
        "planned_params": full_params(planned), "by_hand_params": full_params(by_hand),
    }


HSDP_PLAN = """
model planc.zoo:seed_transformer
mesh (replicate = 2, shard = *)
unit embedding
unit transformer_layers.*
unit [norm, output] { reshard after_forward = false }
"""


def hsdp_worker(rank: int, world_size: int, steps: int) -> dict:
    """HSDP (2 replicas x 2 shards) against unsharded training on the union of the batches.

    Returns per-parameter placements, mesh coordinates, local shard shapes and values, the
    global (rank-mean) losses and each step's full gradients, and the same for the reference.
    """
    vocab = zoo.SEED_TINY_CONFIG.vocab_size
    torch.manual_seed(0)
    model = zoo.seed_transformer_tiny()
    torch.manual_seed(0)
    reference = zoo.seed_transformer_tiny()
    full_shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}

    planc.apply(model, planc.loads(HSDP_PLAN, filename="hsdp.plan"))

    shards = {}
    for name, p in model.named_parameters():
        shards[name] = {
            "placements": tuple(p.placements),
            "mesh": tuple(p.device_mesh.shape),
            "coordinate": tuple(p.device_mesh.get_coordinate()),
            "local_shape": tuple(p.to_local().shape),
            "full_shape": full_shapes[name],
        }

    grads, reference_grads = [], []
    losses, _ = train(model, batches(steps, rank, world_size, vocab), grads=grads)
    reference_losses, _ = train(reference, global_batches(steps, world_size, vocab), grads=reference_grads)
    for name, p in model.named_parameters():
        shards[name]["local"] = p.to_local().detach().clone()
    return {"shards": shards, "losses": mean_over_ranks(losses), "reference_losses": reference_losses,
            "grads": grads, "reference_grads": reference_grads}


# Plan B differs from the torchtitan plan in units (attention and MLP apart, `output` alone),
# precision (fp32 throughout) and placement (one weight sharded on dim 1).
CHECKPOINT_PLAN_B = """
model planc.zoo:seed_transformer
mesh (replicate = 1, shard = *)
unit transformer_layers.*.attention
unit transformer_layers.*.mlp
unit output { reshard after_forward = false }
place transformer_layers.*.mlp.w_out.weight Shard(1)
"""


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict | None:
    """Full (unsharded, CPU) model and optimizer state dicts on rank 0; None elsewhere."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    msd, osd = get_state_dict(model, optimizer,
                              options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # Copies: plain tensors (AdamW's `step`) come back as the live objects training mutates.
    state = torch.utils._pytree.tree_map_only(torch.Tensor, torch.clone, {"model": msd, "optim": osd})
    return state if dist.get_rank() == 0 else None


def sharded_load(model: nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
    """Loads a DCP checkpoint into a sharded (or 1-rank) model and its optimizer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    msd, osd = get_state_dict(model, optimizer)  # initialises empty optimizer state first
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def checkpoint_save_load_worker(rank: int, world_size: int, path: str) -> dict:
    """Trains one step under the torchtitan plan, saves with DCP, loads under plan B.

    Returns (on rank 0) the full state right after saving and the full state after loading
    into a fresh, differently seeded model under plan B; plus each plan's unit names. Also
    resumes: a fresh model under the torchtitan plan loads the checkpoint and takes the
    second step next to the never-interrupted model (losses and parameters returned).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    data = batches(2, rank, world_size, zoo.SEED_TINY_CONFIG.vocab_size)
    torch.manual_seed(0)
    model_a = zoo.seed_transformer_tiny()
    planc.apply(model_a, TORCHTITAN_PLAN)
    _, optim_a = train(model_a, data[:1])
    msd, osd = get_state_dict(model_a, optim_a)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    saved = full_state(model_a, optim_a)

    torch.manual_seed(1)  # different init: every loaded value must come from the checkpoint
    model_b = zoo.seed_transformer_tiny()
    planc.apply(model_b, planc.loads(CHECKPOINT_PLAN_B, filename="plan_b.plan"))
    optim_b = torch.optim.AdamW(model_b.parameters(), lr=1e-2, foreach=True)
    sharded_load(model_b, optim_b, path)
    loaded = full_state(model_b, optim_b)

    torch.manual_seed(3)
    resumed = zoo.seed_transformer_tiny()
    planc.apply(resumed, TORCHTITAN_PLAN)
    optim_resumed = torch.optim.AdamW(resumed.parameters(), lr=1e-2, foreach=True)
    sharded_load(resumed, optim_resumed, path)
    uninterrupted_losses, _ = train(model_a, data[1:], optimizer=optim_a)
    resumed_losses, _ = train(resumed, data[1:], optimizer=optim_resumed)
    return {"saved": saved, "loaded": loaded, "units_a": sorted(fsdp_units_names(model_a)),
            "units_b": sorted(fsdp_units_names(model_b)),
            "placements_b": {n: tuple(p.placements) for n, p in model_b.named_parameters()},
            "uninterrupted_losses": uninterrupted_losses, "resumed_losses": resumed_losses,
            "uninterrupted_params": full_params(model_a), "resumed_params": full_params(resumed)}


def fsdp_units_names(model: nn.Module) -> set[tuple[str, ...]]:
    """The module names of each `fully_shard` call (works before the first forward)."""
    module_names = {id(m): name for name, m in model.named_modules()}
    return {tuple(module_names[id(m)] for m in mod._get_fsdp_state()._modules)
            for mod in model.modules() if isinstance(mod, FSDPModule)}


def checkpoint_load_worker(rank: int, world_size: int, path: str) -> dict:
    """Loads the checkpoint under plan B on however many ranks this runs with."""
    torch.manual_seed(2)
    model = zoo.seed_transformer_tiny()
    planc.apply(model, planc.loads(CHECKPOINT_PLAN_B, filename="plan_b.plan"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    sharded_load(model, optimizer, path)
    return {"loaded": full_state(model, optimizer)}
