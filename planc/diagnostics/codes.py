"""The registry of diagnostic codes: a title and an explanation with an example for each."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Severity = Literal["error", "warning", "note"]


@dataclass(frozen=True, slots=True)
class Code:
    """A registry entry: a one-line title and an explanation with an example."""

    title: str
    explanation: str
    severity: Severity = "error"


# NOTE: codes are stable identifiers users put in CI logs and docs; never renumber them.
CODES: dict[str, Code] = {
    # --- reading and parsing (P0xx)
    "P001": Code("syntax error", "The text is not a valid plan: an unexpected token or character. "
                 "The message names what planc expected at that point.\n\n"
                 "    unit [norm, output\n    # error: expected `,` or `]`"),
    "P002": Code("cannot read plan", "The plan file is missing, unreadable, not UTF-8 text, or too large "
                 "(plans are limited to 1 MiB)."),
    "P003": Code("include not found", "An `include` names a file that does not exist. Paths are relative "
                 "to the including plan.\n\n    include \"base.plan\""),
    "P004": Code("include cycle", "Plans include each other in a loop. Break the cycle: a base plan should "
                 "not include the plans built on it."),
    "P005": Code("nesting too deep", "The plan nests brackets deeper than planc accepts."),
    "P006": Code("includes expand too far", "A file included from several places is spliced once per "
                 "`include`, so plans that include the same base files from many places grow exponentially. "
                 "One plan's includes may splice at most 1000 files and 8 MiB of text. Include each base "
                 "plan once, from the top plan.\n\n    # a.plan includes b.plan and c.plan, both include d.plan, ..."),
    # --- names and values (P1xx)
    "P101": Code("unknown option", "A block names an option planc does not know. Options are `precision`, "
                 "`reshard`, `offload`, `prefetch`, `checkpoint`, `compile`, `reduction`, and the FSDP1 "
                 "spellings `strategy`, `mixed_precision`, `cpu_offload`.\n\n"
                 "    unit layers.* { precison param = bf16 }  # did you mean `precision`?"),
    "P102": Code("unknown value", "An option, mesh or statement has a value planc does not know: a dtype, an "
                 "enum word, a placement.\n\n    precision param = bfloat61  # did you mean `bfloat16`?"),
    "P103": Code("bad argument", "An option argument is missing, repeated, of the wrong type, or names a "
                 "key the option does not take.\n\n    reshard after_forward = maybe"),
    "P104": Code("not allowed here", "A construct is valid in general but not where it was written, e.g. "
                 "`checkpoint` on the root, or `strategy HYBRID_SHARD` inside a unit."),
    "P105": Code("invalid regular expression", "A `re\"...\"` selector does not compile as a Python regular "
                 "expression."),
    "P106": Code("model not loadable", "The model the plan names (or `--model`) could not be imported or "
                 "built on the meta device."),
    "P107": Code("unknown tensor-parallel style", "A `parallel` statement names a style planc does not know. Styles "
                 "are `colwise`, `rowwise`, `sequence`, `replicate`, `prepare_input`, `prepare_output` and `prepare`.\n\n"
                 "    parallel layers.*.attention.wq columnwise   # did you mean `colwise`?"),
    "P108": Code("bad tensor-parallel style option", "A `parallel` statement's block has an option its style does not "
                 "take, a value that is not a layout (`replicate`, `shard(N)`, `partial`, `none`), or `loss_parallel` "
                 "with an output layout other than `shard(-1)`.\n\n"
                 "    parallel norm sequence { input shard(1) }   # SequenceParallel takes no input layouts"),
    "P109": Code("tensor parallelism without a tensor axis", "A `parallel` statement needs the mesh's tensor axis, "
                 "the innermost dimension: `mesh (shard = *, tensor = 8)`.\n\n"
                 "    mesh (shard = *)\n    parallel layers.*.attention.wq colwise   # error: no tensor axis"),
    # --- selectors (P2xx)
    "P201": Code("selector matches nothing", "A selector matches no module of the model. Check the path "
                 "with `planc tree`; mark the rule `optional` if matching nothing is fine.\n\n"
                 "    unit layer.*   # did you mean `layers`?"),
    "P202": Code("unknown class", "A `: Class` guard names a class that no module of the model has; it "
                 "would silently wrap nothing (the most common failure of FSDP1 wrap policies).\n\n"
                 "    unit **: LLaMADecoderLayer  # did you mean `LlamaDecoderLayer`?"),
    "P203": Code("module in two units", "Two unit rules put one module into different units (e.g. alone "
                 "and in a group). A module belongs to exactly one FSDP unit."),
    "P204": Code("unit on a container", "`nn.ModuleList` and `nn.ModuleDict` have no `forward`, so FSDP2 "
                 "refuses them. Make each child a unit instead: `unit layers.*`."),
    "P205": Code("group unit as root", "A group (list) unit cannot be the root of FSDP: with `root none`, "
                 "a group that no other unit encloses would act as one. Keep the root a unit."),
    "P206": Code("parameter selector matches nothing", "An `ignore` or `place` selector matches no "
                 "parameter of the model."),
    "P207": Code("rule has no effect", "Every unit and option this rule sets is set again by later rules, "
                 "so removing it changes nothing; or one block sets a setting twice, and the first value "
                 "has no effect.\n\n    unit layers.* { reshard after_forward = true; reshard after_forward = false }",
                 "warning"),
    "P208": Code("bad selector", "A selector is malformed for the model: an index out of range, an "
                 "unknown predicate, a slice on a module without children."),
    "P209": Code("plan does nothing", "The plan (with its includes) has no statements: it is empty or holds "
                 "only comments. It is valid, and shards the model as one root unit, but it is more likely "
                 "a wrong or truncated file.\n\n    # only a comment", "warning"),
    "P210": Code("alternative matches nothing", "One branch of a `{a,b}` alternation matches nothing "
                 "while the others match: usually a typo, which would silently leave those modules out. "
                 "Mark the rule `optional` when the branch is there for another model family.\n\n"
                 "    unit layers.*.{attn,mpl}   # warning: `mpl` matches nothing", "warning"),
    "P211": Code("except excludes nothing", "An `except` removes none of the selector's matches: a "
                 "typo there silently keeps what it was meant to drop.\n\n"
                 "    unit layers.* except layers.99   # warning", "warning"),
    "P212": Code("regular expression too slow", "A `re\"...\"` selector did not finish matching the "
                 "model's names within the time budget (1 s; docs/language.md, Limits). A repeated group "
                 "whose body can match the same text in several ways (`(a+)+`, `(.*)*`, `(a|aa)+`) "
                 "backtracks exponentially on long names. Repeat the body once, or use a path selector.\n\n"
                 "    unit re\"(\\w+\\.?)*attn\"   # error: write re\".*attn\""),
    # --- structure (P3xx)
    "P301": Code("tied parameters split across units", "One parameter is held by modules in two units "
                 "(tied input/output embeddings). FSDP2 fails at the first forward: `Parameter ... is "
                 "shared with a parameter already managed by another FSDP group`. Put every module that "
                 "holds it in one group unit (with the other members of any group one of them is in "
                 "already, in place of the rules that made those units), or make none a unit of its own."
                 "\n\n    unit wte\n    unit lm_head      # error: wte.weight is lm_head.weight\n"
                 "    unit [wte, lm_head]   # the fix, in place of both"),
    "P302": Code("parameters under no unit", "With `root none`, these parameters belong to no unit: they "
                 "stay replicated and their gradients are never synchronised, so ranks silently diverge."),
    "P303": Code("scalar parameter in a unit", "FSDP2 cannot shard 0-dim parameters (`ValueError`). "
                 "`ignore` them or keep them out of the unit."),
    "P304": Code("precision mismatch between units", "A unit computes in another dtype than the unit "
                 "around it, and nothing converts between them: FSDP2 crashes at runtime with `mat1 and "
                 "mat2 must have the same dtype`. Set `precision output = <outer dtype>, cast_inputs = true` "
                 "on the inner unit, or give both units the same param dtype."),
    "P305": Code("prefetch target is not a unit", "Explicit prefetch lists must name FSDP units."),
    "P306": Code("group units nest in each other", "FSDP2 shards bottom-up: a unit must be sharded "
                 "before any unit around one of its modules. Two groups that each hold a module inside "
                 "the other have no such order.\n\n    unit [a.x, b]\n    unit [b.y, a]   # error"),
    "P307": Code("unit its parent never calls", "FSDP2 gathers a unit's parameters in its forward "
                 "hooks. Some modules read their children's weights directly instead of calling them "
                 "(`nn.MultiheadAttention` passes `out_proj.weight` to a functional op), so a unit there "
                 "is never gathered and the parent computes with a shard. Make the parent the unit.\n\n"
                 "    unit **.attention.out_proj   # error: make `**.attention` the unit"),
    "P308": Code("ignored parameter in a mixed-precision unit", "FSDP2 neither shards nor casts ignored "
                 "parameters, so under `precision param = bf16` an ignored fp32 weight meets bf16 "
                 "activations (a dtype error in most ops). Cast it in the model, or do not ignore it.",
                 "warning"),
    "P309": Code("shared module split across units", "One module object is registered at several "
                 "paths (ALBERT-style sharing: one MLP used by two blocks), and different units hold it "
                 "there. FSDP2 would shard its parameters once for each unit and fail in torch "
                 "(`Cannot concatenate overlapping meshes`). Make the shared module a unit of its own "
                 "(FSDP2 shards it once, and the units around its paths leave it out), or put the units "
                 "that hold it in one group.\n\n    unit blocks.*        # error: blocks.0.mlp is blocks.1.mlp\n"
                 "    unit blocks.0.mlp    # the fix: the shared module is a unit"),
    # --- mesh (P4xx)
    "P401": Code("mesh does not fit the world size", "The mesh dimensions do not multiply to the number "
                 "of ranks."),
    "P402": Code("reshard size does not divide the shard size", "`reshard after_forward = N` reshards to "
                 "groups of N ranks; N must divide the shard dimension of the mesh (1 <= N <= shard)."),
    "P403": Code("placement on a missing dim", "`Shard(d)` names a dimension the parameter does not have."),
    "P404": Code("placement dim not divisible", "`Shard(d)` with d != 0 needs that dimension divisible by "
                 "the shard size (FSDP2 pads only dim 0)."),
    "P405": Code("mesh needs a world size", "Only one mesh dimension can be `*`."),
    "P406": Code("reshard size is a boolean in disguise", "`reshard after_forward = 1` keeps parameters "
                 "unsharded after forward (the same as `false`); a size equal to the shard size reshards "
                 "fully (the same as `true`). Write the boolean.", "warning"),
    "P407": Code("too many ranks", "A mesh whose dimensions multiply past planc's limit of ranks "
                 "(2**20 = 1,048,576; docs/language.md, Limits), far above any cluster; a number is "
                 "probably a typo or a size in another unit. (One size past the limit is already a P103 "
                 "where the plan writes it.)\n\n"
                 "    mesh (replicate = 65536, shard = 65536)   # error: 4,294,967,296 ranks"),
    # --- expectations (P5xx)
    "P501": Code("expectation failed", "An `expect` statement does not hold for the resolved plan."),
    "P502": Code("memory expectation failed", "An `expect memory...` bound does not hold under planc's "
                 "analytic per-rank memory model. With `input = BxS` on the line, activations for that "
                 "input are counted, traced as `planc explain --input-shape BxS` traces them; without it "
                 "they are left out.\n\n    expect memory.peak <= 70GiB at world = 64, input = 8x4096"),
    # --- applying to a live model (P6xx)
    "P601": Code("model already sharded", "`planc.apply` found FSDP (an `FSDPModule`), DTensor parameters "
                 "or activation checkpointing already applied to the model. FSDP2 cannot shard a module "
                 "twice; apply a plan once, to a freshly built model.\n\n"
                 "    model = build(); planc.apply(model, plan); planc.apply(model, plan)  # refused"),
    "P602": Code("mesh does not fit the plan", "The `mesh` passed to `planc.apply` has another number of "
                 "dimensions or other sizes than the plan's `mesh` statement: a 1-D mesh for a plain plan, a "
                 "2-D (replicate, shard) mesh for an HSDP plan.\n\n"
                 "    mesh (replicate = 2, shard = *)   # needs init_device_mesh(dev, (2, N // 2), ...)"),
    "P603": Code("no process group", "`planc.apply` without a `mesh` builds one from the default process "
                 "group, so `torch.distributed.init_process_group` (or `torchrun`) must run first."),
    "P604": Code("non-contiguous parameter in a unit", "FSDP2 cannot shard non-contiguous parameters "
                 "(`NotImplementedError`). Make the parameter contiguous when building the model, or "
                 "`ignore` it."),
    "P605": Code("model the Trainer cannot take sharded", "`planc.integrations.hf.shard_for_trainer` "
                 "marks a transformers model as sharded so that `Trainer` leaves it as it is (no DDP, no "
                 "second sharding). Models whose class has no such flag (not a transformers 5 "
                 "`PreTrainedModel`, or a wrapper around one) are refused before anything is sharded.\n\n"
                 "    model = AutoModelForCausalLM.from_config(cfg); shard_for_trainer(model, plan)"),
    "P606": Code("initialisation unknown", "`planc.materialize` allocated the model's memory but could not "
                 "tell how to initialise some parameters or buffers: after the initialiser ran they still held "
                 "the poison planc writes into fresh memory (NaN, or the lowest integer), so training would "
                 "start from garbage. planc uses the model's own initialiser when it has one (`init_states` / "
                 "`init_weights(buffer_device=...)` as torchtitan's models have, Hugging Face's "
                 "`initialize_weights`), else `reset_parameters()` per module. Pass `init=` with the model's "
                 "real initialiser, covering every module named.\n\n"
                 "    planc.materialize(model, \"cuda\", init=lambda m: m.init_rope_cache())"),
    # --- importing accelerate FSDP configs (P7xx; `planc import`, planc/importers/accelerate.py)
    "P701": Code("not an accelerate FSDP config", "The file is not YAML, not a mapping, or has no "
                 "`fsdp_config` section (accelerate writes one with `accelerate config` when "
                 "`distributed_type: FSDP`)."),
    "P702": Code("unknown config value", "An accelerate setting has a value planc does not know, such as a "
                 "misspelled sharding strategy or wrap policy.\n\n    fsdp_sharding_strategy: FULL_SHRAD  "
                 "# did you mean `FULL_SHARD`?"),
    "P703": Code("wrap class not in the model", "`fsdp_transformer_layer_cls_to_wrap` names a class that no "
                 "module of the model (`--model`) has. Older accelerate versions then wrap nothing and "
                 "train the whole model as one unit, silently; newer ones fail at startup.\n\n"
                 "    fsdp_transformer_layer_cls_to_wrap: LLaMADecoderLayer  # did you mean `LlamaDecoderLayer`?"),
    "P704": Code("setting not translated", "An accelerate setting changes how FSDP runs but has no "
                 "equivalent in a plan or in FSDP2 (e.g. `fsdp_backward_prefetch: BACKWARD_POST`); the "
                 "written plan behaves as if it were left at its default.", "warning"),
    "P705": Code("setting left to the training script", "An accelerate setting is about checkpoint "
                 "formats, loading or the launcher, not about sharding, so it has no place in a plan "
                 "(e.g. `fsdp_state_dict_type`); keep it where the script sets it.", "note"),
    "P706": Code("unknown fsdp_config key", "A key under `fsdp_config` is not one accelerate reads; it is "
                 "probably misspelled and accelerate ignores it.", "warning"),
    "P503": Code("memory expectation not checked", "An `expect memory...` line needs a world size: "
                 "`at world = N` on the line, or `--world-size N` on the command line; "
                 "`expect memory.activations` also needs an input shape (`input = BxS`). Without them it "
                 "cannot be checked, and planc says so rather than passing it silently.", "warning"),
    "P504": Code("input does not fit the model", "`input = BxS` on an `expect memory...` line runs one "
                 "forward and backward of the model (on fake tensors) with token ids of batch B and "
                 "sequence length S, to count activations. The model did not run on them: it takes other "
                 "inputs, or the sequence does not fit it. Fix the shape, or remove `input =` to check the "
                 "bound without activations.\n\n    expect memory.peak <= 8GiB at world = 8, input = 2x512"),
    # --- planc suggest (P950-P969)
    "P950": Code("no plan fits the budget", "`planc suggest` searched unit granularity, resharding, offload, "
                 "activation checkpointing, prefetch and HSDP replicate sizes, and no plan's estimated per-rank "
                 "peak fits `--budget`. The message gives the smallest peak it found and the plan that reaches "
                 "it: raise the budget to at least that, use more ranks, or a shorter input.\n\n"
                 "    planc suggest --model planc.zoo:seed_transformer --world-size 8 --budget 1GiB --input-shape 2x512"),
    "P951": Code("model has no block chain", "`planc suggest` searches plans for models built as a chain of "
                 "blocks of one class (`layers.*`, `blocks.*`). This model has no list of two or more such "
                 "blocks; write its plan by hand (`planc tree --model ...` shows the module tree)."),
    # --- notes (P9xx)
    "P902": Code("root reshards after forward by default", "`defaults` apply to the root unit too. "
                 "`reshard after_forward = true` there frees the root's parameters after forward, although "
                 "backward needs them first: FSDP2's own default for the root is `false`. Add "
                 "`root { reshard after_forward = false }` unless that is what you want.", "note"),
    "P903": Code("prefetch target in a group unit", "An explicit prefetch list names a module that is one "
                 "member of a group unit. FSDP2 gathers a unit as a whole, so the group is prefetched; "
                 "planc says so, since the list reads as if only that module were.\n\n"
                 "    unit [layers.0, layers.1]\n    unit norm { prefetch backward = [layers.1] }   # note: "
                 "prefetches the group", "note"),
    "P901": Code("FSDP1 spelling", "An FSDP1 word was accepted and mapped to its FSDP2 meaning; the note "
                 "says what it became.", "note"),
}
