"""Bodies of the trainer-integration tests: one Trainer (or Lightning) run, sharded or not.

`hf_trainer_run(rank, world, accumulate)` trains hf:llama-tiny with transformers' `Trainer`
for STEPS optimizer steps over the same global batches whatever the world size: on `world`
ranks each rank's micro-batch is GLOBAL_BATCH / world / accumulate sequences, taken in order
(`train_sampling_strategy="sequential"`; accelerate deals consecutive micro-batches to ranks
in turn), so the sharded run and the one-process reference step on the same tokens. With
world > 1 the model is sharded by plans/llama.plan in fp32 (planc.integrations.hf).
"""

from __future__ import annotations

import os
import pathlib
import tempfile

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
STEPS = 3
GLOBAL_BATCH = 4
SEQ = 16
LR = 1e-2
FP32 = "\ndefaults { precision param = fp32, reduce = fp32 }\n"


def llama_fp32_plan(accumulate: int = 1):
    """plans/llama.plan with fp32 params and reductions (the exact comparison needs fp32), and
    `accumulate` microbatches per step (`step { accumulate N }`, synced on the last)."""
    import planc
    path = ROOT / "plans" / "llama.plan"
    step = f"step {{ accumulate {accumulate}, sync = last }}\n" if accumulate > 1 else ""
    return planc.loads(path.read_text() + FP32 + step, filename=str(path))


def dataset(vocab: int) -> list[dict]:
    """STEPS global batches of counting sequences from random starts, as one flat list."""
    gen = torch.Generator().manual_seed(1234)
    starts = torch.randint(0, vocab, (STEPS * GLOBAL_BATCH, 1), generator=gen)
    tokens = (starts + torch.arange(SEQ)) % vocab
    return [{"input_ids": t, "labels": t} for t in tokens]


def placements(model: torch.nn.Module) -> dict[str, tuple]:
    """Parameter name -> (mesh dim names, placements as strings); plain tensors -> ()."""
    from torch.distributed.tensor import DTensor
    return {n: ((p.device_mesh.mesh_dim_names, tuple(str(x) for x in p.placements))
                if isinstance(p, DTensor) else ()) for n, p in model.named_parameters()}


def hf_trainer_run(rank: int, world: int, accumulate: int = 1) -> dict:
    """One Trainer run; the logged losses, placements and FSDP modules after training."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import Trainer, TrainingArguments

    from planc.model.hf import build_hf_model
    torch.manual_seed(0)
    model = build_hf_model("llama-tiny", device="cpu")
    units = []
    accumulation = {"gradient_accumulation_steps": accumulate}
    if world > 1:  # the accumulation comes from the plan's `step` line
        from planc.integrations.hf import shard_for_trainer, trainer_arguments
        applied = shard_for_trainer(model, llama_fp32_plan(accumulate))
        units = sorted(applied.unit_of_module)
        accumulation = trainer_arguments(applied)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, use_cpu=True, report_to=[], save_strategy="no", logging_steps=1,
            max_steps=STEPS, learning_rate=LR, seed=0, dataloader_num_workers=0,
            per_device_train_batch_size=GLOBAL_BATCH // world // accumulate,
            train_sampling_strategy="sequential", **accumulation)
        trainer = Trainer(model=model, args=args, train_dataset=dataset(model.config.vocab_size))
        trainer.train()
    from torch.distributed.fsdp import FSDPModule
    return {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "grad_norms": [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h],
            "placements": placements(trainer.model), "units": units,
            "fsdp": sorted(n for n, m in trainer.model.named_modules() if isinstance(m, FSDPModule)),
            "wrapped": type(trainer.model_wrapped).__name__}


def hf_trainer_both(rank: int, world: int) -> dict:
    """The sharded run without and with gradient accumulation (one launch for both)."""
    return {acc: hf_trainer_run(rank, world, acc) for acc in (1, 2)}


def lightning_run(rank: int, world: int) -> dict:
    """hf:llama-tiny trained STEPS steps by Lightning; per-rank losses, placements after.

    world > 1: `ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)` and
    plans/llama.plan (fp32) applied in `configure_model`; world 1: Lightning's default strategy
    on one CPU process, unsharded.
    """
    os.environ["HF_HUB_OFFLINE"] = "1"
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, DistributedSampler

    from planc.model.hf import build_hf_model

    class LitLlama(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.model = build_hf_model("llama-tiny", device="cpu")
            self.losses: list[float] = []
            self.units: list[str] = []
            self.seen: list = []

        def configure_model(self):
            if world > 1:
                from planc.integrations.lightning import shard_in_configure_model
                applied = shard_in_configure_model(self.model, llama_fp32_plan(), self.device_mesh)
                self.units = sorted(applied.unit_of_module)

        def training_step(self, batch, _):
            loss = self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
            self.losses.append(loss.item())
            self.seen.append(batch["input_ids"][:, 0].tolist())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=LR)

    module = LitLlama()
    # Lightning's own DistributedSampler shuffles training data (seeded); this one deals the
    # samples in order, rank r taking r, r + world, ...: each global batch is the reference's.
    samples = dataset(module.model.config.vocab_size)
    sampler = DistributedSampler(samples, num_replicas=world, rank=rank, shuffle=False) if world > 1 else None
    data = DataLoader(samples, batch_size=GLOBAL_BATCH // world, sampler=sampler, shuffle=False)
    if world > 1:
        from lightning.pytorch.strategies import ModelParallelStrategy
        strategy = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    else:
        strategy = "auto"
    with tempfile.TemporaryDirectory() as out:
        trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=STEPS,
                             logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, default_root_dir=out,
                             use_distributed_sampler=False)
        trainer.fit(module, data)
    from torch.distributed.fsdp import FSDPModule
    return {"losses": module.losses, "seen": module.seen, "units": module.units, "placements": placements(module.model),
            "fsdp": sorted(n for n, m in module.model.named_modules() if isinstance(m, FSDPModule))}
