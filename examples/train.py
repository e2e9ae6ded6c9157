"""Train a zoo model sharded by a plan: build on meta, `planc.apply`, materialise, AdamW.

The same script runs on CPUs (gloo) and GPUs (nccl), under torchrun:

    torchrun --nproc_per_node=2 examples/train.py --plan plans/gpt.plan --model planc.zoo:gpt_tiny
    torchrun --nproc_per_node=8 examples/train.py --plan plans/seed.plan      # 8 GPUs, full size
    torchrun --nproc_per_node=4 examples/train.py --plan plans/zoo-llama-tp.plan --model planc.zoo:llama_tiny
    torchrun --nproc_per_node=2 examples/train.py --plan plans/llama.plan --model hf:llama-tiny   # Hugging Face
    torchrun --nproc_per_node=4 examples/train.py --plan plans/zoo-llama-context.plan --model planc.zoo:llama_tiny
    torchrun --nproc_per_node=4 examples/train.py --plan plans/zoo-llama-pp.plan --model planc.zoo:llama_tiny
    torchrun --nproc_per_node=4 examples/train.py --plan plans/routed-moe-ep.plan --model planc.zoo:routed_moe_tiny

A plan with a tensor axis (FSDP x tensor parallelism) works the same: the ranks of one
tensor-parallel group take the same slice of the batch, and the loss and its backward run in
`applied.loss_parallel()` (torch's `loss_parallel()` when the plan keeps the logits sharded
on the vocabulary, else nothing). With a context axis the ranks of one context group take
the same slice too, and `applied.shard_batch` cuts it along the sequence (head-tail) and
gives the global positions the model's forward takes; the loss is the plain mean over the
rank's tokens. With a pipeline axis each rank trains its stages: `applied.step(inputs,
targets, loss_fn)` runs torch's schedule and returns the loss on the ranks holding the last
stage; `applied.clip_grad_norm_` clips by the whole model's gradient norm.

The data is synthetic and learnable (counting sequences `t, t+1, ...` mod the vocabulary
from random starts), so a falling loss shows the sharded model really trains. Each rank
takes its slice of every global batch; FSDP averages the gradients, as DDP would.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import planc
from planc.backends.pipelining import PipelinedPlan
from planc.model.build import ModelLoadError, build_model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plan", required=True, help="the .plan file")
    p.add_argument("--model", help="model reference (default: the plan's `model` line); "
                                   "on CPUs use a tiny one, e.g. planc.zoo:gpt_tiny")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences over all ranks)")
    p.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--max-norm", type=float, default=1.0, help="gradient clipping norm")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def setup() -> torch.device:
    """Initialise the process group from torchrun's environment; pick this rank's device."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
        dist.init_process_group("gloo")
    return device


def batch(step: int, global_batch: int, seq: int, vocab: int, rank: int, world: int, seed: int) -> torch.Tensor:
    """This rank's slice of global batch `step` (the same global batch on every rank)."""
    gen = torch.Generator().manual_seed(seed * 100_003 + step)
    starts = torch.randint(0, vocab, (global_batch, 1), generator=gen)
    tokens = (starts + torch.arange(seq)) % vocab
    per_rank = global_batch // world
    return tokens[rank * per_rank:(rank + 1) * per_rank]


def sync_and_clip(model: torch.nn.Module, max_norm: float, world: int) -> torch.Tensor:
    """Clip gradients to `max_norm` in total; returns the total norm before clipping.

    With every parameter sharded this is `clip_grad_norm_` on the sharded model. Parameters
    a plan `ignore`s stay plain replicated tensors whose gradients FSDP does not reduce:
    average them over ranks here, as DDP would, and fold them into the norm by hand
    (`clip_grad_norm_` refuses a mix of DTensor and plain gradients).
    """
    params = [p for p in model.parameters() if p.grad is not None]
    plain = [p for p in params if not isinstance(p, DTensor)]
    if not plain:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm
    for p in plain:
        dist.all_reduce(p.grad)
        p.grad /= world
    sharded = [p.grad for p in params if isinstance(p, DTensor)]
    parts = [torch.nn.utils.get_total_norm([p.grad for p in plain])]
    if sharded:
        parts.append(torch.nn.utils.get_total_norm(sharded).full_tensor().to(parts[0].device))
    norm = torch.linalg.vector_norm(torch.stack(parts))
    scale = min(1.0, max_norm / (norm.item() + 1e-6))
    for p in params:
        p.grad.mul_(scale)
    return norm


def logits_of(output) -> torch.Tensor:
    """The logits a forward returned: a tensor (zoo models), or a Hugging Face output object or tuple."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    return logits if logits is not None else output[0]


def memory_bytes(applied: planc.AppliedPlan, device: torch.device) -> tuple[str, int]:
    """What to report per rank: peak allocated on GPUs; parameter bytes held on CPUs."""
    if device.type == "cuda":
        return "max_memory_allocated", torch.cuda.max_memory_allocated(device)
    return "param bytes held", applied.local_param_bytes()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = setup()
    rank, world = dist.get_rank(), dist.get_world_size()
    log = print if rank == 0 else (lambda *a, **k: None)
    try:
        plan = planc.load(args.plan)
        ref = args.model or plan.model_ref
        if ref is None:
            log("error: the plan has no `model` line; pass --model", file=sys.stderr)
            return 2
        # NOTE: build on meta so no rank ever holds the whole model; shard, then allocate.
        model = build_model(ref, device="meta")
        applied = planc.apply(model, plan)
        pipelined = isinstance(applied, PipelinedPlan)  # this rank trains its stages only
        torch.manual_seed(args.seed)
        planc.materialize(applied if pipelined else model, device)
        log(applied.summary())

        vocab = model.config.vocab_size
        if getattr(model.config, "use_cache", False):
            # NOTE: Hugging Face models default to `use_cache=True`: every forward builds a KV
            # cache training never reads, and with activation checkpointing the recomputation
            # fills it again, so the recomputed tensors' shapes differ and backward fails.
            model.config.use_cache = False
        # The ranks of one tensor-parallel or context group see the same tokens; data
        # parallelism is over the groups (replicate x shard).
        dp_rank, dp_world = applied.data_parallel_rank()
        if args.batch % dp_world:
            log(f"error: --batch {args.batch} is not divisible by {dp_world} data-parallel ranks", file=sys.stderr)
            return 2
        context = applied.compiled.mesh.axis_name("context") is not None
        opt = torch.optim.AdamW(applied.parameters() if pipelined else model.parameters(), lr=args.lr)
        # ranks whose losses are summed below: every rank, or those holding the last stage
        holders = world // (len(applied.job.schedule.stages) if pipelined else 1)
        start = time.perf_counter()
        for step in range(args.steps):
            if context:  # --seq inputs and their next tokens, each cut along the sequence
                tokens = batch(step, args.batch, args.seq + 1, vocab, dp_rank, dp_world, args.seed).to(device)
                part = applied.shard_batch(tokens[:, :-1], tokens[:, 1:])
                logits = logits_of(model(part.tokens, positions=part.positions))
                with applied.loss_parallel():  # with a tensor axis too, the logits may be sharded on the vocabulary
                    loss = F.cross_entropy(logits.reshape(-1, vocab).float(), part.labels.reshape(-1))
                    loss.backward()
            elif pipelined:  # the schedule runs forward and backward; the loss only where the last stage is
                tokens = batch(step, args.batch, args.seq + 1, vocab, dp_rank, dp_world, args.seed).to(device)

                def loss_fn(output, labels):
                    return F.cross_entropy(logits_of(output).reshape(-1, vocab).float(), labels.reshape(-1))
                loss = applied.step(tokens[:, :-1], tokens[:, 1:], loss_fn)
                loss = torch.zeros((), device=device) if loss is None else loss
            else:
                tokens = batch(step, args.batch, args.seq, vocab, dp_rank, dp_world, args.seed).to(device)
                logits = logits_of(model(tokens))
                with applied.loss_parallel():  # logits sharded on the vocabulary: loss and backward inside
                    loss = F.cross_entropy(logits[:, :-1].reshape(-1, vocab).float(), tokens[:, 1:].reshape(-1))
                    loss.backward()
            if pipelined or applied.expert_mesh is not None:  # stages or experts: torch's clipping refuses two meshes
                norm = applied.clip_grad_norm_(args.max_norm)
            else:
                norm = sync_and_clip(model, args.max_norm, world)
            opt.step()
            opt.zero_grad(set_to_none=True)
            total = loss.detach()
            total = (total.full_tensor() if isinstance(total, DTensor) else total).clone()
            dist.all_reduce(total)  # SUM: gloo has no AVG; TP ranks hold equal losses
            log(f"step {step + 1:>4}/{args.steps}  loss {total.item() / holders:.4f}  grad norm {norm.item():.3f}")
        elapsed = time.perf_counter() - start

        what, mine = memory_bytes(applied, device)
        per_rank = [None] * world
        dist.all_gather_object(per_rank, mine)
        log(f"{what} per rank: " + ", ".join(f"rank {r}: {b / 2**20:.3f} MiB" for r, b in enumerate(per_rank)))
        log(f"{args.steps} steps in {elapsed:.1f} s")
        return 0
    except (planc.PlanError, ModelLoadError) as err:
        log(f"error: {err}", file=sys.stderr)  # every rank compiles the same plan: all stop here
        return 2
    finally:
        # NOTE: without this barrier a rank that is done first tears gloo down under a peer
        # still finishing its last collective; the peer then aborts ("terminate called without
        # an active exception", exit -6) in about half the runs on 2 CPU ranks.
        if sys.exc_info()[0] is None:
            dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    code = main()
    # NOTE: even after the barrier, a loaded machine sometimes aborts a rank at interpreter
    # exit ("terminate called without an active exception", -6: a gloo thread still joinable
    # when C++ statics are destroyed; seen in the full suite on 2 busy cores). The process
    # group is gone and the output flushed, so leave without running those destructors.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
