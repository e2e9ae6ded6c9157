"""The code `planc emit` prints does on real ranks exactly what `planc.apply` does.

One launch of 2 gloo ranks. For each case, every rank builds the tiny model twice from
the same seed, shards one copy with `planc.apply(model, plan)` and the other by exec'ing
the emitted `apply_plan(model, mesh)` on the same mesh, then reads back from FSDP2's own
state: which modules are FSDP modules and how they are grouped, the mixed precision,
offload and reshard settings, the prefetch lists, checkpointed and compiled modules, and
every parameter's DTensor placements, local shard shape, dtype and device. Cases without
`compile` also run one forward and backward and compare the loss and local gradients.
"""

from __future__ import annotations

import pathlib
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from distributed import run
from torch import nn

import planc
from planc import zoo
from planc.backends.emit import emit_python
from planc.model.build import build_model

pytestmark = pytest.mark.dist

ROOT = pathlib.Path(__file__).resolve().parent.parent
WORLD = 2



class NumberedDictModel(nn.Module):
    """Blocks in a ModuleDict keyed "0", "1", ... as torchtitan keeps them (emit loops `.values()`)."""

    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(vocab_size=32)
        self.tok = nn.Embedding(32, 16)
        self.layers = nn.ModuleDict({str(i): nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
                                     for i in range(3)})
        self.out = nn.Linear(16, 32)

    def forward(self, tokens):
        h = self.tok(tokens)
        for layer in self.layers.values():
            h = h + layer(h)
        return self.out(h)


DICT_PLAN = """model test_emit_dist:NumberedDictModel
defaults { precision param = bf16, reduce = fp32 }
unit layers.*
unit layers.*.0 { reshard after_forward = false }
unit [tok, out]
"""

# case -> (plan file or text, model, whether to run a step: compile needs a C++ toolchain
# and minutes on 2 cores, so the compile case is compared without running it)
CASES = {
    "seed": ("plans/seed.plan", "planc.zoo:seed_transformer_tiny", True),
    "gpt_tied": ("plans/gpt.plan", "planc.zoo:gpt_tiny", True),
    "seed_hsdp": ("plans/seed_hsdp.plan", "planc.zoo:seed_transformer_tiny", True),
    "moe_everything": ("tests/golden/emit/moe_everything.plan", "planc.zoo:moe_transformer_tiny", False),
    "moe_everything_no_compile": ("tests/golden/emit/moe_everything.plan", "planc.zoo:moe_transformer_tiny", True),
    "dict_layers": (DICT_PLAN, "test_emit_dist:NumberedDictModel", True),
    # a setting made by an FSDPModule method (sum the gradients, as torchtitan's loss needs);
    # force_sum: gloo has no PREMUL_SUM
    "reduction": ("plans/seed.plan", "planc.zoo:seed_transformer_tiny", True),
    # op-level selective activation checkpointing (the policy printed from planc/lower/checkpointing.py)
    "selective": ("plans/seed.plan", "planc.zoo:seed_transformer_tiny", True),
}


def _plan_text(case: str) -> str:
    path, _, _ = CASES[case]
    text = path if "\n" in path else (ROOT / path).read_text(encoding="utf-8")
    if case == "selective":
        text += "\ncheckpoint transformer_layers.* selective\n"
    if case == "reduction":
        text += "\ndefaults { reduction divide_factor = 1.0, force_sum = true }\n"
    if case.endswith("_no_compile"):
        text = "\n".join(line for line in text.splitlines() if not line.startswith("compile "))
    return text


def read_back(model: torch.nn.Module) -> dict:
    """What FSDP2 and the composable APIs hold, by module and parameter name."""
    from torch.distributed._composable.contract import _get_registry
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    module_name = {id(m): n for n, m in model.named_modules()}
    param_name = {id(p): n for n, p in model.named_parameters()}
    states, units = {}, {}
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
            states.setdefault(id(state), (state, []))[1].append(name)
    key_of = {sid: tuple(sorted(names)) for sid, (_, names) in states.items()}
    for sid, (state, _names) in states.items():
        groups = state._fsdp_param_groups
        units[key_of[sid]] = {
            "state_modules": tuple(module_name[id(m)] for m in state._modules),
            "params": sorted(param_name[id(fp.sharded_param)] for g in groups for fp in g.fsdp_params),
            "mp": (state._mp_policy.param_dtype, state._mp_policy.reduce_dtype,
                   state._mp_policy.output_dtype, state._mp_policy.cast_forward_inputs),
            "offload": [(type(g.offload_policy).__name__, getattr(g.offload_policy, "pin_memory", None))
                        for g in groups],
            "reshard": [None if g.post_forward_mesh_info is None else g.post_forward_mesh_info.shard_mesh_size
                        for g in groups],
            "reduction": [(g.gradient_divide_factor, g.force_sum_reduction_for_comms) for g in groups],
            "prefetch_forward": [key_of[id(s)] for s in state._states_to_forward_prefetch or []],
            "prefetch_backward": [key_of[id(s)] for s in state._states_to_backward_prefetch or []],
        }
    params = {}
    for name, p in model.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        params[name] = {"placements": tuple(map(repr, p.placements)) if isinstance(p, DTensor) else None,
                        "local_shape": tuple(local.shape), "dtype": local.dtype, "device": str(local.device)}
    return {
        "units": units,
        "params": params,
        "checkpointed": sorted(n for n, m in model.named_modules() if "checkpoint" in (_get_registry(m) or {})),
        "compiled": sorted(n for n, m in model.named_modules() if getattr(m, "_compiled_call_impl", None) is not None),
    }


def step(model: torch.nn.Module) -> dict:
    """One forward and backward on a fixed batch: the loss and each local gradient."""
    from torch.distributed.tensor import DTensor
    tokens = zoo.example_input(model, generator=torch.Generator().manual_seed(7))
    logits = model(tokens)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())
    loss.backward()
    grads = {n: (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).clone()
             for n, p in model.named_parameters() if p.grad is not None}
    return {"loss": loss.item(), "grads": grads}


def worker(rank: int, world: int, cases: list[tuple[str, str, str, str, bool]]) -> dict:
    out = {}
    for case, text, builder, source, train in cases:
        torch.manual_seed(0)
        by_apply = build_model(builder, device="cpu")
        torch.manual_seed(0)
        by_emit = build_model(builder, device="cpu")
        applied = planc.apply(by_apply, planc.loads(text, filename=case))
        namespace: dict = {}
        exec(compile(source, f"<emitted {case}>", "exec"), namespace)
        returned = namespace["apply_plan"](by_emit, applied.mesh)
        result = {"returns_model": returned is by_emit}
        for label, model in (("apply", by_apply), ("emit", by_emit)):
            result[label] = {"before_step": read_back(model)}
            if train:
                result[label]["step"] = step(model)
                result[label]["after_step"] = read_back(model)  # root resharding settles in lazy init
        out[case] = result
    return out


@pytest.fixture(scope="module")
def results() -> dict:
    cases = []
    for case, (path, builder, train) in CASES.items():
        text = _plan_text(case)
        name = path if "\n" not in path else f"<{case}>"
        compiled = planc.compile(planc.loads(text, filename=name), build_model(builder))
        cases.append((case, text, builder, emit_python(compiled, plan_path=name), train))
    return run(worker, WORLD, cases)


@pytest.mark.parametrize("case", sorted(CASES))
def test_emitted_code_matches_apply(results, case):
    for rank in range(WORLD):
        r = results[rank][case]
        assert r["returns_model"]
        a, e = r["apply"], r["emit"]
        assert e["before_step"]["units"] == a["before_step"]["units"]
        assert e["before_step"]["params"] == a["before_step"]["params"]
        assert e["before_step"]["checkpointed"] == a["before_step"]["checkpointed"]
        assert e["before_step"]["compiled"] == a["before_step"]["compiled"]
        if "step" in a:
            assert e["after_step"]["units"] == a["after_step"]["units"]
            assert e["step"]["loss"] == a["step"]["loss"]
            assert e["step"]["grads"].keys() == a["step"]["grads"].keys()
            for name, grad in a["step"]["grads"].items():
                assert torch.equal(e["step"]["grads"][name], grad), name


def test_the_comparison_is_not_vacuous(results):
    """The cases really exercise groups, offload, placement, prefetch, checkpoint, compile, ignore."""
    seed = results[0]["seed"]["emit"]["before_step"]
    assert len(seed["units"]) == 5  # embedding, 2 blocks, [norm, output], root
    assert ("norm", "output") in seed["units"]
    assert all(u["mp"][0] == torch.bfloat16 for u in seed["units"].values())
    everything = results[0]["moe_everything"]["emit"]["before_step"]
    units = everything["units"]
    assert units[("tok_embeddings",)]["offload"] == [("CPUOffloadPolicy", False)]  # gloo mesh: no pinning
    assert units[("layers.0.moe",)]["reshard"] == [2]
    assert units[("layers.0",)]["prefetch_forward"] == [("norm", "output")]
    assert everything["params"]["layers.0.moe.experts.w1"]["placements"] == ("Shard(dim=1)",)
    assert everything["params"]["layers.0.attention_norm.weight"]["placements"] is None  # ignored
    assert everything["checkpointed"] == ["layers.0", "layers.1"]
    assert everything["compiled"] == ["layers.0.attention", "layers.1.attention"]
    # the two ranks hold different halves
    w1 = [results[r]["moe_everything_no_compile"]["emit"]["step"]["grads"]["layers.0.moe.experts.w1"]
          for r in range(WORLD)]
    assert w1[0].shape == w1[1].shape and not torch.equal(w1[0], w1[1])
    hsdp = results[0]["seed_hsdp"]["emit"]["before_step"]
    assert hsdp["params"]["embedding.weight"]["placements"] == ("Replicate()", "Shard(dim=0)")
    numbered = results[0]["dict_layers"]["emit"]["before_step"]["units"]
    assert {("layers.0",), ("layers.0.0",), ("out", "tok")} <= set(numbered)
    selective = results[0]["selective"]["emit"]
    assert selective["before_step"]["checkpointed"] == ["transformer_layers.0", "transformer_layers.1"]
    assert selective["step"]["loss"] == results[0]["seed"]["emit"]["step"]["loss"]  # recompute changes nothing
    summed = results[0]["reduction"]["emit"]
    # every unit with parameters (the root here has none: no parameter group) sums
    assert {tuple(u["reduction"]) for u in summed["before_step"]["units"].values()} == {((1.0, True),), ()}
    assert {tuple(u["reduction"]) for u in seed["units"].values()} == {((None, False),), ()}
    mean = results[0]["seed"]["emit"]["step"]["grads"]
    for name, grad in summed["step"]["grads"].items():  # summed over 2 ranks, not averaged
        assert torch.allclose(grad, WORLD * mean[name], rtol=1e-5, atol=1e-7), name
    tied = results[0]["gpt_tied"]["emit"]["before_step"]
    assert ("lm_head", "ln_f", "wte") in tied["units"]
