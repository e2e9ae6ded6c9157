"""Pipeline plans: the `pipeline`/`stage` lines resolved, the automatic split, the lowered Job.

Oracles: torchtitan's own `_generate_llm_fqn_per_model_part` for the automatic split of equal
blocks; a brute force over every cut for `partition`; `planc.lower.pipeline.pipeline_job` and
`planc.lower.schedules.schedule` (torch's own orders) for the lowered job.
"""

from __future__ import annotations

import itertools
import random

import pytest
from torch import nn

import planc
import planc.resolve.pipeline
from planc import zoo
from planc.checks.pipeline import bubble
from planc.lower.pipeline import pipeline_job
from planc.lower.schedules import schedule
from planc.model.graph import ModelGraph
from planc.resolve.split import auto_split, block_list, partition

HEAD = "model planc.zoo:llama_tiny\nmesh (pipeline = 2, shard = *)\n"


def _compile(text: str, model=None, world: int = 4):
    return planc.compile(planc.loads(text, filename="pp.plan"), model or zoo.llama_tiny(), world, strict=False)


@pytest.mark.parametrize("stages,layers", [(2, 2), (4, 8), (3, 7), (8, 30), (16, 126)])
def test_the_automatic_split_is_torchtitans_on_equal_blocks(stages, layers):
    titan = pytest.importorskip("torchtitan.distributed.pipeline_parallel")
    import torch
    with torch.device("meta"):
        model = zoo.llama(zoo.LlamaConfig(vocab_size=64, dim=32, n_layers=layers, n_heads=4, n_kv_heads=2,
                                          hidden_dim=64))
    expected = titan._generate_llm_fqn_per_model_part(stages, layers)
    expected = [[{"lm_head": "output"}.get(m, m) for m in stage] for stage in expected]
    assert [list(s) for s in auto_split(ModelGraph.from_module(model), stages)] == expected


def test_partition_minimises_the_heaviest_stage():
    rng = random.Random(0)
    for _ in range(40):
        weights = [rng.randint(1, 9) for _ in range(rng.randint(2, 9))]
        k = rng.randint(1, len(weights))
        sizes = partition(weights, k)
        assert len(sizes) == k and sum(sizes) == len(weights) and min(sizes) >= 1

        def worst(cut):
            bounds = (0, *cut, len(weights))
            return max(sum(weights[a:b]) for a, b in zip(bounds, bounds[1:]))
        best = min(worst(c) for c in itertools.combinations(range(1, len(weights)), k - 1))
        cut = tuple(itertools.accumulate(sizes))[:-1]
        assert worst(cut) == best, (weights, k, sizes)


def test_the_blocks_of_each_zoo_family():
    assert block_list(ModelGraph.from_module(zoo.gpt_tiny())) == "blocks"
    assert block_list(ModelGraph.from_module(zoo.seed_transformer_tiny())) == "transformer_layers"
    assert block_list(ModelGraph.from_module(zoo.llama_tiny())) == "layers"


def test_stage_lines_lower_to_the_pipeline_job():
    text = HEAD + ("pipeline Interleaved1F1B { microbatches 4, stages_per_rank = 2 }\nunit layers.*\n"
                   "stage 0: tok_embeddings\nstage 1: layers[0:1]\nstage 2: layers.1\nstage 3: norm, output\n")
    c = _compile(text, world=8)
    assert c.ok, c.diagnostics
    job = c.job
    stages = [("tok_embeddings",), ("layers.0",), ("layers.1",), ("norm", "output")]
    assert [p.modules for p in job.parts] == stages
    expected = schedule("Interleaved1F1B", 2, 4, 2)
    assert job.schedule.actions == expected.actions and job.schedule.stages == ((0, 2), (1, 3))
    # the same cut of the same plan without the pipeline lines, by the stage contract
    plain = _compile("model planc.zoo:llama_tiny\nmesh (shard = *)\nunit layers.*\n", world=4).job
    by_contract = pipeline_job(plain, stages, expected)
    assert [[u.name for u in p.program.units] for p in job.parts] == \
        [[u.name for u in p.program.units] for p in by_contract.parts]


def test_fsdp_does_not_reshard_after_forward_under_a_pipeline():
    c = _compile(HEAD + "pipeline 1F1B { microbatches 4 }\nunit tok_embeddings\nunit layers.*\n"
                 "unit [norm, output]\n")
    assert c.ok, c.diagnostics
    units = [u for p in c.job.parts for u in p.program.units]
    assert units and all(u.policy.reshard_after_forward is False and u.policy.reshard_argument is False
                         for u in units)
    # without the pipeline FSDP2's own default (None: True for inner units) stands
    plain = _compile("model planc.zoo:llama_tiny\nmesh (shard = *)\nunit layers.*\n")
    assert [u.policy.reshard_argument for u in plain.job.program.units] == [None, None, None]
    # a plan that asks for it keeps it where torch trains right (1F1B: tests/test_pipeline_facts_dist.py)
    asked = _compile(HEAD + "pipeline 1F1B { microbatches 4 }\nunit layers.* { reshard after_forward = true }\n")
    assert asked.ok and [u.policy.reshard_after_forward for u in asked.job.parts[0].program.units] == [True, False]


def test_defaults_and_the_gradient_sync():
    c = _compile(HEAD + "pipeline GPipe\nunit layers.*\n")
    pp = c.resolution.pipeline
    assert (pp.stages_per_rank, pp.microbatch_count, pp.split) == (1, 2, "parameters")
    sched = c.job.schedule
    assert sched.name == "GPipe" and sched.microbatches == 2 and sched.gradient_sync == "last"
    reducing = [str(a) for row in sched.actions for a in row if sched.reduces(a)]
    assert reducing == ["0REDUCE_GRAD", "1REDUCE_GRAD"]
    v = _compile(HEAD + "pipeline DualPipeV { microbatches 4 }\nunit layers.*\n", world=8)
    assert v.resolution.pipeline.stages_per_rank == 2 and v.job.schedule.stages == ((0, 3), (1, 2))


def test_the_bubble_is_the_closed_form():
    c = _compile(HEAD.replace("2", "4") + "pipeline 1F1B { microbatches 2 }\nunit layers.*\n", world=8)
    assert c.ok and bubble(c.resolution.pipeline) == pytest.approx(3 / 5)  # (p-1)/(m+p-1), p=4 m=2
    inter = _compile(HEAD + "pipeline Interleaved1F1B { microbatches 1 }\nunit layers.*\n", world=8)
    assert bubble(inter.resolution.pipeline) == pytest.approx(1 / 3)  # (p-1)/(v m + p - 1), p=2 v=2 m=1


class _Block(nn.Module):
    """A block that applies its one projection `reps` times: equal parameters, `reps` x the compute."""

    def __init__(self, dim: int, reps: int):
        super().__init__()
        self.proj, self.reps = nn.Linear(dim, dim, bias=False), reps

    def forward(self, x):
        for _ in range(self.reps):
            x = self.proj(x)
        return x


class _Uneven(nn.Module):
    def __init__(self, reps=(3, 3, 1, 1, 1, 1), dim=16, vocab=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(_Block(dim, r) for r in reps)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        h = self.emb(tokens)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def test_split_by_compute_weighs_each_blocks_flops():
    text = ("mesh (pipeline = 2, shard = *)\npipeline 1F1B { microbatches 2, split = %s }\n"
            "expect memory.peak <= 1GiB at world = 4, input = 2x8\n")
    blocks = [f"blocks.{i}" for i in range(6)]
    by_params = _compile(text % "parameters", _Uneven()).resolution.pipeline.stages
    assert by_params == (("emb", *blocks[:3]), (*blocks[3:], "head"))  # 8 equal pieces: 4 | 4
    # FLOPs 3,3,1,1,1,1 (x 2 B S d^2 each), the embedding and the head one mean block each (10/6):
    # {emb, 3, 3} = 7.7 | {1, 1, 1, 1, head} = 5.7 is the lightest heaviest stage (by hand)
    by_compute = _compile(text % "compute", _Uneven()).resolution.pipeline.stages
    assert by_compute == (("emb", *blocks[:2]), (*blocks[2:], "head"))


def test_editors_know_the_pipeline_lines():
    from pygments.token import Keyword, Name, Number

    from planc.lang.lexer import PlanLexer
    from planc.lsp.completion import complete
    tokens = [(t, v) for t, v in PlanLexer().get_tokens("pipeline 1F1B { microbatches 8 }\nstage 0: layers[0:2]\n")
              if v.strip()]
    assert tokens[:3] == [(Keyword, "pipeline"), (Name.Class, "1F1B"), (tokens[2][0], "{")]
    assert (Name.Builtin, "microbatches") in tokens and (Number.Integer, "0") in tokens
    assert (Name.Class, "layers") not in tokens  # `stage 0:` is not a class guard
    mesh = [(t, v) for t, v in PlanLexer().get_tokens("mesh (pipeline = 2, shard = *)\n") if v.strip()]
    assert (Name.Attribute, "pipeline") in mesh  # an axis word there, not the statement
    g = ModelGraph.from_module(zoo.llama_tiny())
    assert [i.label for i in complete(["pipeline "], 1, 10, g)] == list(planc.resolve.pipeline.SCHEDULES)
    assert [i.label for i in complete(["pipeline 1F1B { "], 1, 17, g)] == ["microbatches", "stages_per_rank", "split"]
    assert "layers" in [i.label for i in complete(["stage 0: tok_embeddings, la"], 1, 28, g)]


def test_the_405b_recipe_lowers_to_torchtitans_stages(capsys):
    """plans/llama3-405b-pp.plan: 16 stages as torchtitan cuts 126 layers, loop placement, torch's
    Interleaved1F1B over 32 microbatches, every tensor-parallel op in the stage holding its module."""
    titan = pytest.importorskip("torchtitan.distributed.pipeline_parallel")
    import pathlib

    from planc.cli.main import main
    from planc.lower.pipeline import inside
    from planc.lower.program import Parallelize
    from planc.model.build import build_model
    path = pathlib.Path(__file__).resolve().parent.parent / "plans" / "llama3-405b-pp.plan"
    c = planc.compile(planc.load(path), build_model("planc.zoo:llama3_405b"), 512)
    assert c.ok, c.errors
    job = c.job
    expected = [tuple({"lm_head": "output"}.get(m, m) for m in s) for s in titan._generate_llm_fqn_per_model_part(16, 126)]
    assert [p.modules for p in job.parts] == expected
    assert job.schedule.stages == tuple((r, r + 8) for r in range(8))
    assert job.schedule.actions == schedule("Interleaved1F1B", 8, 32, 2).actions
    for part in job.parts:
        ops = part.program.of_type(Parallelize)
        assert ops and all(inside(op.module, part.modules) for op in ops)
    assert sum(len(p.program.of_type(Parallelize)) for p in job.parts) == len(c.resolution.parallel)
    assert main(["explain", str(path), "--world-size", "512"]) == 0
    out = capsys.readouterr().out
    assert "   15     7  24.42B      8  layers[119:126], norm, output" in out


@pytest.mark.parametrize("name", list(planc.resolve.pipeline.SCHEDULES))
def test_every_accepted_pipeline_lowers(name):
    """Over a grid of sizes, stages per rank and microbatches: compiling never raises, and every plan
    without errors lowers to a job whose schedule places each of its parts (no error at run time
    that the checks let through)."""
    graph = ModelGraph.from_module(zoo.llama_tiny())
    for pp, spr, m in itertools.product((2, 4), (None, 1, 3), (None, 1, 5)):
        opts = "; ".join([f"microbatches {m}"] * (m is not None) + [f"stages_per_rank {spr}"] * (spr is not None))
        text = (f"model planc.zoo:llama_tiny\nmesh (pipeline = {pp}, shard = *)\npipeline {name} {{ {opts} }}\n"
                "unit layers.*\n")
        c = planc.compile(planc.loads(text, filename="grid.plan"), graph, pp * 2, strict=False)
        if c.ok:
            job = c.job
            assert len(job.parts) == pp * c.resolution.pipeline.stages_per_rank
            assert sorted(s for row in job.schedule.stages for s in row) == list(range(len(job.parts)))
        else:
            assert all(d.code.startswith("P46") or d.code.startswith("P47") for d in c.errors), c.errors


def test_explain_and_simulate_check_the_batch_against_the_microbatches(capsys, monkeypatch):
    import pathlib

    from planc.cli.main import main
    plan = "tests/ui/ok_pipeline.plan"  # 4 microbatches
    monkeypatch.chdir(pathlib.Path(__file__).resolve().parent.parent)
    assert main(["explain", plan, "--world-size", "8", "--input-shape", "6x16"]) == 1
    assert "error[P466]: a batch of 6 does not divide into the pipeline's 4 microbatches" in capsys.readouterr().err
    assert main(["explain", plan, "--world-size", "8", "--input-shape", "8x16"]) == 0
    out = capsys.readouterr()
    # estimated per pipeline rank (planc/estimate/role_memory.py, roles.py): no P476
    assert "P476" not in out.err and "layers.1, norm, output" in out.out
    assert "binding rank" in out.out and "bubble" in out.out
    assert main(["check", plan, "--world-size", "8", "--simulate", "--input-shape", "6x16"]) == 1
    assert "P466" in capsys.readouterr().out
