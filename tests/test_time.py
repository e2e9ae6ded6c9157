"""The step-time model: collective bytes against a fake-process-group run, FLOPs against
FlopCounterMode on the real CPU step, group units against FSDP2, the schedule and profiles.

Every shipped plan is run on its model's tiny config (the plans' own model when it is small)
as rank 0 of 8 in a fake process group; the collectives its step issues (recorded per FSDP
unit by `planc.analysis.comms`) must equal, byte for byte, what `planc.estimate.time` derives
from the lowered program.
"""

from __future__ import annotations

import collections
import json
import pathlib
import sys

import pytest
import torch

import planc
from planc import zoo
from planc.analysis.comms import record_collectives
from planc.analysis.simulate import simulate, zoo_inputs
from planc.estimate import memory
from planc.estimate.flops import count_step, step_profile
from planc.estimate.hardware import PROFILES, HardwareError, hardware
from planc.estimate.time import estimate_step_time, main_dtype, owners, tp_collectives, unit_collectives
from planc.estimate.trace import Example
from planc.model.build import build_model

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
import shipped  # noqa: E402
import step_inputs  # noqa: E402

PLANS = sorted((ROOT / "plans").glob("*.plan"))
TINY = {"hf:bert-base": "hf:bert-tiny", "hf:gpt2": "hf:gpt2-tiny", "hf:llama-3-8b": "hf:llama-tiny",
        "hf:mixtral-8x7b": "hf:mixtral-tiny", "hf:t5-base": "hf:t5-tiny", "planc.zoo:llama3_8b": "planc.zoo:llama_tiny"}
WORLD = 8


def tiny_ref(ref: str) -> str:
    """The small model a plan's model line stands for in tests (torchtitan's debug models are small)."""
    if ref in TINY:
        return TINY[ref]
    if ref.startswith("planc.zoo:") and not ref.endswith("_tiny"):
        return ref + "_tiny"
    return ref


def lm_inputs(model):
    """One step's inputs: token ids 2 x 16 (encoder and decoder ids for T5)."""
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return step_inputs.t5_inputs(model)
    vocab = next(m.num_embeddings for m in model.modules() if isinstance(m, torch.nn.Embedding))
    return (torch.randint(0, vocab, (2, 16)),)


def _needs(ref: str) -> None:
    import importlib.util
    for prefix, module in (("hf:", "transformers"), ("planc.model.torchtitan:", "torchtitan")):
        if ref.startswith(prefix) and importlib.util.find_spec(module) is None:
            pytest.skip(f"{ref} needs {module}")


# ===================================================================== bytes, exact


@pytest.mark.parametrize("path", shipped.params(PLANS, ids=[p.name for p in PLANS], world=WORLD))
def test_collective_bytes_per_unit_equal_a_fake_process_group_step(path):
    plan = planc.load(path)
    ref = tiny_ref(plan.model_ref)
    _needs(ref)
    model = build_model(ref)
    compiled = planc.compile(plan, model, WORLD)
    predicted = {u.name: sorted((c.kind, c.phase, c.bytes, c.ranks) for c in cs if c.axis != "host")
                 for u, cs in zip(compiled.program.units, unit_collectives(compiled.program, compiled.graph, WORLD))}
    with torch.device("cpu"):
        example = Example.of(lm_inputs(build_model(ref, device="meta")))
    profile = step_profile(compiled.graph, example, dtype=main_dtype(compiled.program, compiled.graph))
    predicted["tensor"] = []
    cp = (compiled.mesh.sizes(WORLD) or {}).get("context", 1)  # a context rank's activations: 1 / cp of them
    tp = tp_collectives(compiled.program, compiled.graph, profile, WORLD, cp)
    own = owners(compiled.program, compiled.graph, tp)
    for path, cs in tp.items():  # sequence norms' gradient all-reduces run in their unit's post-backward
        where = compiled.program.units[own[path]].name if _style(compiled.program, path) == "sequence" else "tensor"
        predicted[where] = sorted(predicted[where] + [(c.kind, c.phase, c.bytes, c.ranks) for c in cs])
    if compiled.mesh.axis_name("context") is not None:  # outside any unit's FSDP calls; local heads under TP
        st = estimate_step_time(compiled, world=WORLD, inputs=example)
        predicted["other"] = sorted((c.kind, c.phase, c.bytes, c.ranks) for u in st.per_unit for c in u.collectives
                                    if c.axis == "context")
    recorded = collections.defaultdict(list)
    for r in record_collectives(plan, lambda: build_model(ref), WORLD, inputs=lm_inputs):
        recorded[r.unit].append((r.kind, r.phase, r.bytes, r.ranks))
    assert set(recorded) <= set(predicted), set(recorded) - set(predicted)
    for name, expected in predicted.items():
        assert sorted(recorded.get(name, [])) == expected, name
    assert sum(len(v) for v in recorded.values()) > 0


class _FFN(torch.nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.w1 = torch.nn.Linear(d, 4 * d, bias=False)
        self.w2 = torch.nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        return self.w2(torch.relu(self.w1(x)))


class _Block(torch.nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.ffn = _FFN(d)

    def forward(self, x):
        return x + self.ffn(self.norm(x))


class SequenceParallelModel(torch.nn.Module):
    """A decoder small enough to run sequence parallelism on a fake process group."""

    def __init__(self, vocab: int = 64, d: int = 32, n: int = 2):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList([_Block(d) for _ in range(n)])
        self.norm = torch.nn.LayerNorm(d)
        self.out = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, tokens):
        x = self.emb(tokens)
        for b in self.blocks:
            x = b(x)
        return self.out(self.norm(x))


SEQUENCE_PARALLEL = """mesh (shard = *, tensor = 2)
unit blocks.*
root {}
parallel emb rowwise {
  input replicate
  output shard(1)
}
parallel blocks.*.norm sequence
parallel blocks.*.ffn prepare_input {
  input shard(1)
  desired_input replicate
}
parallel blocks.*.ffn.w1 colwise
parallel blocks.*.ffn.w2 rowwise { output shard(1) }
parallel norm sequence
parallel out colwise {
  input shard(1)
  output replicate
}
"""


def test_sequence_parallel_chain_bytes_equal_a_fake_process_group_step():
    """Embedding rowwise -> shard(1), sequence norms, prepare_input shard(1) -> replicate, colwise,
    rowwise -> shard(1), output colwise from shard(1): every activation collective and every
    FSDP one, per unit, as recorded (the norms' gradient all-reduces run in their unit's post-backward)."""
    plan = planc.loads(SEQUENCE_PARALLEL, filename="sp.plan")
    compiled = planc.compile(plan, SequenceParallelModel(), WORLD)
    program, graph = compiled.program, compiled.graph
    predicted = {u.name: [(c.kind, c.phase, c.bytes, c.ranks) for c in cs]
                 for u, cs in zip(program.units, unit_collectives(program, graph, WORLD))}
    predicted["tensor"] = []
    profile = step_profile(graph, (torch.zeros(2, 16, dtype=torch.long),))
    tp = tp_collectives(program, graph, profile, WORLD)
    own = owners(program, graph, tp)
    for path, cs in tp.items():
        for c in cs:
            where = program.units[own[path]].name if _style(program, path) == "sequence" else "tensor"
            predicted[where].append((c.kind, c.phase, c.bytes, c.ranks))
    recorded = collections.defaultdict(list)
    for r in record_collectives(plan, SequenceParallelModel, WORLD, inputs=lambda m: (torch.randint(0, 64, (2, 16)),)):
        recorded[r.unit].append((r.kind, r.phase, r.bytes, r.ranks))
    assert {k: sorted(v) for k, v in recorded.items() if v} == {k: sorted(v) for k, v in predicted.items() if v}
    kinds = {(c[0], c[1]) for c in predicted["tensor"]}
    assert {("all_gather", "forward"), ("reduce_scatter", "backward"), ("reduce_scatter", "forward"),
            ("all_gather", "backward")} <= kinds


def _style(program, path: str) -> str:
    from planc.lower.program import Parallelize
    return next(op.style.kind for op in program.of_type(Parallelize) if op.module == path)


def test_padding_reshard_int_and_hsdp_bytes():
    """Dim 0 padded to a multiple of the shard size; `reshard N` gathers in backward over N
    ranks; HSDP all-reduces the reduce-scatter output over the replicate axis."""
    text = ("model planc.zoo:seed_transformer\nmesh (replicate = 2, shard = *)\n"
            "defaults { precision param = bf16, reduce = fp32 }\n"
            "unit embedding\nunit transformer_layers.* { reshard after_forward = 2 }\nunit [norm, output]\n")
    plan = planc.loads(text, filename="hsdp.plan")
    compiled = planc.compile(plan, zoo.seed_transformer_tiny(), 12)  # shard = 6: 64 rows pad to 66
    cs = unit_collectives(compiled.program, compiled.graph, 12)
    emb = {(c.kind, c.phase): c for c in cs[0]}
    assert emb["all_gather", "forward"].bytes == 66 * 64 * 2 and emb["all_gather", "forward"].ranks == 6
    assert emb["reduce_scatter", "backward"].bytes == 66 * 64 * 4
    assert emb["all_reduce", "backward"].bytes == 11 * 64 * 4 and emb["all_reduce", "backward"].ranks == 2
    layer = {(c.kind, c.phase): c for c in cs[1]}
    assert layer["all_gather", "backward"].ranks == 2
    recorded = collections.defaultdict(list)
    for r in record_collectives(plan, zoo.seed_transformer_tiny, 12, inputs=zoo_inputs((2, 16))):
        recorded[r.unit].append((r.kind, r.phase, r.bytes, r.ranks))
    for u, ucs in zip(compiled.program.units, cs):
        assert sorted(recorded.get(u.name, [])) == sorted((c.kind, c.phase, c.bytes, c.ranks) for c in ucs), u.name


# ===================================================================== group units (torch 2.13)

GROUPED = {
    "tied_three": "unit [embedding, norm, output]\nunit transformer_layers.*\n",
    "tail_resharded": "unit embedding\nunit transformer_layers.*\nunit [norm, output]\n",
    "pair_of_layers": ("unit embedding\nunit [transformer_layers.0, transformer_layers.1]\n"
                       "unit [norm, output] { reshard after_forward = false }\n"),
}
BASE = "model planc.zoo:seed_transformer\ndefaults { precision param = bf16, reduce = fp32 }\n"


@pytest.mark.parametrize("name", sorted(GROUPED))
def test_group_units_gather_and_reduce_once_and_memory_matches_simulation(name):
    plan = planc.loads(BASE + GROUPED[name], filename=f"{name}.plan")
    compiled = planc.compile(plan, zoo.seed_transformer_tiny(), WORLD)
    recorded = record_collectives(plan, zoo.seed_transformer_tiny, WORLD, inputs=zoo_inputs((2, 16)))
    for op in compiled.program.units:
        if op.is_group:
            kinds = collections.Counter((r.kind, r.phase) for r in recorded if r.unit == op.name)
            assert kinds[("reduce_scatter", "backward")] == 1
            assert kinds[("all_gather", "forward")] == 1
            assert kinds[("all_gather", "backward")] == (1 if op.policy.reshard_after_forward is True else 0)
    est = memory.estimate(compiled, WORLD, input_shape=(2, 16))
    sim = simulate(plan, zoo.seed_transformer_tiny, WORLD, inputs=zoo_inputs((2, 16)))
    assert est.peak.total == sim.peak, (est.peak.label, sim.moment)


def test_simulation_under_the_tracker_issues_the_same_collectives_as_without():
    """simulate's FSDPMemTracker keeps FSDP2's group hooks (torch's own tracker splits groups)."""
    from planc.analysis import comms
    from planc.analysis import simulate as sim_module
    plan = planc.loads(BASE + GROUPED["tied_three"], filename="t.plan")
    plain = record_collectives(plan, zoo.seed_transformer_tiny, WORLD, inputs=zoo_inputs((2, 16)))
    seen: list = []
    original = sim_module._measure

    def measure(model, example, *args, **kwargs):
        rec = comms._Recorder()
        with rec:
            out = original(model, example, *args, **kwargs)
        seen.extend(rec.found)
        return out

    sim_module._measure = measure
    try:
        simulate(plan, zoo.seed_transformer_tiny, WORLD, inputs=zoo_inputs((2, 16)), steps=1, clip=None)
    finally:
        sim_module._measure = original
    assert sorted((r.kind, r.bytes) for r in seen) == sorted((r.kind, r.bytes) for r in plain)


# ===================================================================== FLOPs


FLOP_MODELS = ["planc.zoo:seed_transformer_tiny", "planc.zoo:gpt_tiny", "planc.zoo:moe_transformer_tiny",
               "hf:llama-tiny", "hf:gpt2-tiny"]


@pytest.mark.parametrize("ref", FLOP_MODELS)
def test_flops_per_module_equal_flopcountermode_on_the_real_cpu_step(ref):
    from torch.utils.flop_counter import FlopCounterMode

    from planc.estimate.flops import flop_mapping
    _needs(ref)
    torch.manual_seed(0)
    real = build_model(ref, device="cpu")
    example = Example.of(lm_inputs(real))
    graph = planc.compile(planc.loads(f"model {ref}\n"), build_model(ref), WORLD).graph
    fake = step_profile(graph, example)
    eager = count_step(real, example)
    assert fake.forward == eager.forward and fake.backward == eager.backward
    counter = FlopCounterMode(display=False, custom_mapping=flop_mapping())
    with counter:  # torch's own count of the same real step
        out = real(*example.args, **example.kwargs)
        planc.estimate.trace.default_loss(real)(out, example).backward()
    assert fake.total == counter.get_total_flops() > 0


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recompute_flops_equal_a_real_checkpointed_step(mode):
    """FlopCounterMode on a real step with the blocks checkpointed counts exactly the model's
    forward + backward + recompute."""
    from torch.distributed._composable.checkpoint_activation import checkpoint as checkpoint_module
    from torch.utils.flop_counter import FlopCounterMode

    from planc.estimate.flops import flop_mapping
    from planc.lower.checkpointing import context_fn
    text = (open(ROOT / "plans" / "seed.plan").read() + f"checkpoint transformer_layers.* {mode}\n")
    compiled = planc.compile(planc.loads(text, filename="c.plan"), zoo.seed_transformer_tiny(), WORLD)
    st = estimate_step_time(compiled, world=WORLD, input_shape=(2, 16))
    with torch.device("cpu"):
        real = zoo.seed_transformer_tiny()
    for block in real.transformer_layers:
        checkpoint_module(block, context_fn=context_fn(mode))
    example = Example.of((torch.randint(0, 64, (2, 16)),))
    counter = FlopCounterMode(display=False, custom_mapping=flop_mapping())
    with counter:
        out = real(*example.args)
        planc.estimate.trace.default_loss(real)(out, example).backward()
    assert sum(u.flops for u in st.per_unit) == counter.get_total_flops()
    recompute = sum(u.recompute_flops for u in st.per_unit)
    assert (recompute > 0) if mode == "full" else (recompute == 0)


# ===================================================================== time


def _seed(extra: str = "", world: int = 64):
    text = "".join(line for line in open(ROOT / "plans" / "seed.plan") if not line.startswith("expect memory")) + extra
    with torch.device("meta"):  # the 1.41B model: shapes only
        model = zoo.seed_transformer()
    return planc.compile(planc.loads(text, filename="s.plan"), model, world)


def test_step_time_is_consistent_and_says_what_it_assumes():
    st = estimate_step_time(_seed(), world=64, hardware="h100", input_shape=(2, 512))
    assert st.total_s >= st.compute_s + st.optimizer_s
    assert st.exposed_comm_s == pytest.approx(st.total_s - st.compute_s - st.optimizer_s)
    assert sum(u.exposed_s for u in st.per_unit) == pytest.approx(st.exposed_comm_s)  # no TP: all FSDP waits
    assert 0 < st.mfu < 1 and st.tokens == 2 * 512 * 64
    assert any("estimates" in a for a in st.assumptions) and any("60%" in a for a in st.assumptions)
    # faster links, faster step; more compute per step, a larger share of it hidden
    fast = estimate_step_time(_seed(), world=64, hardware="b200", input_shape=(2, 512))
    assert fast.total_s < st.total_s
    big = estimate_step_time(_seed(), world=64, hardware="h100", input_shape=(8, 1024))
    assert big.exposed_comm_s / big.total_s < st.exposed_comm_s / st.total_s


def test_not_resharding_saves_the_backward_all_gather():
    re = estimate_step_time(_seed(), world=64, input_shape=(2, 512))
    keep = estimate_step_time(_seed("unit transformer_layers.* { reshard after_forward = false }\n"), world=64,
                              input_shape=(2, 512))
    ag = lambda st: sum(u.bytes("all_gather", phase="backward") for u in st.per_unit  # noqa: E731
                        if u.name.startswith("transformer_layers"))
    assert ag(keep) == 0 < ag(re) and keep.comm_s < re.comm_s


def test_a_program_and_a_profile_reuse_one_trace():
    compiled = _seed()
    profile = step_profile(compiled.graph, input_shape=(2, 512))
    assert step_profile(compiled.graph, input_shape=(2, 512)) is profile
    a = estimate_step_time(compiled.program, graph=compiled.graph, world=64, profile=profile)
    b = estimate_step_time(compiled, world=64, input_shape=(2, 512))
    assert a.total_s == b.total_s


def test_hardware_profiles_and_files(tmp_path):
    assert set(PROFILES) >= {"h100", "h200", "a100", "b200"}
    assert hardware("H100-SXM") is PROFILES["h100"]
    f = tmp_path / "mine.toml"
    f.write_text('base = "a100"\nefficiency = 0.5\n[inter]\nbusbw = 100e9\n')
    hw = hardware(str(f))
    assert (hw.name, hw.efficiency, hw.inter.busbw, hw.bf16_flops) == ("mine", 0.5, 100e9, PROFILES["a100"].bf16_flops)
    j = tmp_path / "j.json"
    j.write_text(json.dumps({"gpus_per_node": 4, "bf16_flops": 1e15}))
    assert hardware(str(j)).gpus_per_node == 4
    for text, message in (("efficiency = 2\n", "efficiency"), ("speed = 1\n", "unknown field"),
                          ('base = "tpu"\n', "unknown base")):
        f.write_text(text)
        with pytest.raises(HardwareError, match=message):
            hardware(str(f))
    with pytest.raises(HardwareError, match="unknown hardware"):
        hardware("v100")


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointed_tensor_parallel_blocks_rerun_their_collectives_as_recorded(mode):
    """Recompute reruns the blocks' forward redistributions up to checkpoint's early stop."""
    plan = planc.loads(SEQUENCE_PARALLEL + f"checkpoint blocks.* {mode}\n", filename="sp.plan")
    compiled = planc.compile(plan, SequenceParallelModel(), WORLD)
    st = estimate_step_time(compiled, world=WORLD, inputs=(torch.zeros(2, 16, dtype=torch.long),))
    predicted = collections.Counter((c.kind, c.phase, c.bytes, c.ranks) for u in st.per_unit for c in u.collectives)
    recorded = collections.Counter((r.kind, r.phase, r.bytes, r.ranks) for r in record_collectives(
        plan, SequenceParallelModel, WORLD, inputs=lambda m: (torch.randint(0, 64, (2, 16)),)))
    assert predicted == recorded
    reruns = [c for u in st.per_unit for c in u.collectives if c.what.endswith("(recompute)")]
    assert reruns and all(c.kind == "all_gather" for c in reruns)  # the blocks' final reduce-scatters do not rerun


def test_collective_time_is_alpha_beta_on_the_link_its_group_spans():
    """nccl-tests' form: alpha + bytes x bus factor / busbw; a shard group inside a node uses
    NVLink, the replicate group across nodes the network (HSDP 8 x 8 on 8-GPU nodes)."""
    from planc.estimate.time import collective_s
    text = ("model planc.zoo:seed_transformer\nmesh (replicate = 8, shard = 8)\n"
            "defaults { precision param = bf16, reduce = fp32 }\nunit embedding\nunit transformer_layers.*\n"
            "unit [norm, output]\n")
    compiled = planc.compile(planc.loads(text, filename="h.plan"), zoo.seed_transformer_tiny(), 64)
    hw = PROFILES["h100"]
    cs = {(c.kind, c.phase): c for c in unit_collectives(compiled.program, compiled.graph, 64)[1]}
    rs, ar = cs["reduce_scatter", "backward"], cs["all_reduce", "backward"]
    assert collective_s(rs, hw) == pytest.approx(hw.intra.alpha_s + rs.bytes * 7 / 8 / hw.intra.busbw)
    assert collective_s(ar, hw) == pytest.approx(hw.inter.alpha_s + ar.bytes * 2 * 7 / 8 / hw.inter.busbw)
    assert ar.bytes * 8 == rs.bytes


def test_overlap_hides_gathers_behind_compute_and_offload_adds_host_copies():
    """Compute-bound (8 GPUs in one node, a large batch): only the first gather and the last
    reduce-scatter stay exposed. Offloading the blocks adds their host<->device copies."""
    base = estimate_step_time(_seed(world=8), world=8, hardware="h100", input_shape=(8, 1024))
    assert base.compute_s > base.comm_s and base.exposed_comm_s < 0.1 * base.comm_s
    off = estimate_step_time(_seed("unit transformer_layers.* { offload cpu }\n", world=8), world=8,
                             hardware="h100", input_shape=(8, 1024))
    layer = next(u for u in off.per_unit if u.name == "transformer_layers.0")
    h2d = layer.bytes("host_to_device")
    assert h2d == 2 * next(m for m in memory.unit_memory(_seed(world=8).program, _seed(world=8).graph, 8)
                           if m.name == "transformer_layers.0").sharded  # forward and backward gathers
    assert layer.bytes("device_to_host") > 0 and off.total_s >= base.total_s


def test_compute_outside_every_unit_has_its_own_row_with_root_none():
    text = "model planc.zoo:seed_transformer\nunit transformer_layers.*\nroot none\n"
    compiled = planc.compile(planc.loads(text, filename="r.plan"), zoo.seed_transformer_tiny(), WORLD, strict=False)
    st = estimate_step_time(compiled, world=WORLD, input_shape=(2, 16))
    layers = [u for u in st.per_unit if u.name.startswith("transformer_layers")]
    assert layers[0].flops == layers[1].flops  # the output projection is not billed to the last block
    outside = st.per_unit[-1]
    assert outside.name == "(outside units)" and outside.flops > 0 and not outside.collectives
    assert sum(u.flops for u in st.per_unit) == step_profile(compiled.graph, input_shape=(2, 16)).total
