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
    "P160": Code("batch does not divide into microbatches", "The plan's `step { accumulate N }` splits each rank's "
                 "batch of one optimizer step into N equal microbatches, but the input's batch (from `input = BxS` "
                 "or `--input-shape`) is not a multiple of N. Give a batch that is, or accumulate fewer "
                 "microbatches.\n\n    step { accumulate 4 }\n    expect memory.peak <= 70GiB at world = 8, "
                 "input = 2x4096   # 2 rows do not split in 4"),
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
    "P408": Code("mesh axis not supported yet", "The mesh names an axis whose role planc knows but does not "
                 "build yet: `pipeline` (`pp`) or `expert` (`ep`). planc builds the `replicate`, "
                 "`shard`, `context` and `tensor` axes; remove the axis (the plan then runs without that parallelism).\n\n"
                 "    mesh (pp = 2, shard = *)   # error: the pipeline axis is not supported yet"),
    # --- the step simulated on a fake process group (P44x; `planc check --simulate`, planc/analysis/shapecheck.py)
    "P440": Code("simulated step fails at a tensor-parallel module", "`planc check --simulate` applies the whole plan "
                 "on a fake process group of the world size and runs one training step on fake tensors (shapes, no "
                 "data). The step failed in a module's forward or backward after a `parallel` rule changed the shapes "
                 "it sees: the diagnostic names the rule, the module that failed, and the shapes. The usual cause is "
                 "model code that reshapes with a global size, e.g. the head count: under colwise each rank holds "
                 "n_heads / tp heads.\n\n"
                 "    q = self.wq(x).view(b, s, self.n_heads, self.head_dim)   # fails under colwise\n"
                 "    q = self.wq(x).view(b, s, -1, self.head_dim)             # works: the local count"),
    "P441": Code("tensor-parallel size does not divide the heads", "Found by `planc check --simulate`: a colwise "
                 "projection is split into tp slices of features, and the model's view into heads of `head_dim` fails "
                 "because tp does not divide the number of heads (each rank would hold a fraction of a head). DTensor "
                 "allows uneven shards; head reshapes do not.\n\n"
                 "    mesh (shard = *, tensor = 8)   # a model with 4 heads: use tensor = 1, 2 or 4"),
    "P442": Code("style cannot be applied", "Found by `planc check --simulate`: torch refused an operation of the "
                 "lowered program while `planc.apply` ran it on a fake process group: a tensor-parallel style on a "
                 "module it does not support (colwise and rowwise take `nn.Linear` and `nn.Embedding`), or "
                 "`fully_shard` of a unit after tensor parallelism.\n\n"
                 "    parallel layers.*.attention_norm colwise   # a norm: use `replicate` or `sequence`"),
    "P443": Code("clipping or the optimizer step fails", "Found by `planc check --simulate`: forward and backward ran, "
                 "but `clip_grad_norm_` or the (foreach) optimizer step failed. With tensor parallelism the cause is "
                 "almost always parameters on different meshes: modules left out of the `parallel` rules are 1-D "
                 "DTensors over the data-parallel axes next to 2-D ones (pytorch#134212). Give them `replicate`.\n\n"
                 "    parallel model.norm replicate"),
    "P444": Code("simulated step fails outside tensor parallelism", "Found by `planc check --simulate`: the step failed "
                 "in a module no `parallel` rule touches, before any tensor-parallel module ran: the model does not run "
                 "on the simulated input (token ids of `--input-shape`, default 2 x 16). Pass an input that fits."),
    # --- tensor parallelism (P41x-P43x), static: read from the module tree and the mesh
    "P410": Code("tensor axis not innermost", "The tensor-parallel axis must be the last (innermost) `mesh` "
                 "dimension: its ranks exchange activations every layer and belong within a node. planc "
                 "builds the device mesh with the tensor axis last whatever the order written, so a plan "
                 "that writes it elsewhere does not say what runs.\n\n"
                 "    mesh (tensor = 8, shard = *)   # error: write `mesh (shard = *, tensor = 8)`"),
    "P411": Code("tensor parallelism does not divide the query heads", "A colwise projection splits an attention "
                 "module's query heads over the tensor axis; the head count (read from the module: Hugging "
                 "Face `config.num_attention_heads`, torchtitan `n_heads`, `num_heads`) must be a multiple of "
                 "the tensor-parallel size, or the reshape to heads fails in forward.\n\n"
                 "    mesh (shard = *, tensor = 8)\n    parallel **.self_attn.q_proj colwise   # error: 4 heads"),
    "P412": Code("tensor parallelism does not divide the key/value heads", "With grouped-query attention the "
                 "key and value projections hold fewer heads (`num_key_value_heads`, `n_kv_heads`) than the "
                 "queries; tensor parallelism splits them too, so the tensor-parallel size must divide them. "
                 "Hugging Face loads Qwen3-VL (4 KV heads) at tp = 8 and crashes in forward "
                 "(transformers#48307).\n\n"
                 "    mesh (shard = *, tensor = 8)\n    parallel **.self_attn.k_proj colwise   # error: 4 KV heads"),
    "P413": Code("tensor-parallel split not even", "A colwise layer whose output stays sharded (`Shard(-1)`) "
                 "splits its out-features, the rowwise Linear after it its in-features; a size the "
                 "tensor-parallel size does not divide leaves ranks with unequal shards. DTensor splits the "
                 "weights unevenly without complaint, but the rowwise layer rebuilds its input with "
                 "`DTensor.from_local`, which assumes equal shards, and its matmul fails in forward (torch "
                 "2.13: `Sharding propagation failed for aten.mm`). Uneven splits that torch handles are not "
                 "reported: an Embedding's vocabulary rowwise, a colwise layer gathered with `output replicate`, a "
                 "colwise layer with `local_output false` (a DTensor knows its global shape; checked on 2 gloo "
                 "ranks: the same output as one process).\n\n"
                 "    parallel mlp.w1 colwise   # error: 42 out-features over tensor = 4\n"
                 "    parallel mlp.w2 rowwise   # error: 42 in-features"),
    "P414": Code("vocabulary not divisible under loss parallel", "`loss_parallel` keeps the logits sharded on "
                 "the vocabulary and computes the cross-entropy on the shards. torch 2.13 computes the right "
                 "loss on unequal shards (checked on 2 gloo ranks), so this is a warning: the ranks then hold "
                 "unequal logits and weights. Pad the vocabulary to a multiple of the tensor-parallel size, as "
                 "Megatron and torchtitan do.\n\n"
                 "    parallel output colwise { loss_parallel }   # warning: vocabulary 50 over tensor = 4",
                 "warning"),
    "P415": Code("sequence length not divisible under sequence parallel", "Sequence parallelism splits the "
                 "tokens of each sequence over the tensor axis (`Shard(1)`), so the sequence length of an "
                 "`input = BxS` the plan states must be a multiple of the tensor-parallel size. Checked only "
                 "where a plan gives an input shape (`expect ... at input = BxS`); 3 tokens over 2 gloo ranks "
                 "aborted the process group in the all-gather.\n\n"
                 "    parallel **.attention_norm sequence\n"
                 "    expect memory.peak <= 80GiB at world = 8, input = 2x30   # error at tensor = 4"),
    "P416": Code("colwise output not taken back", "A colwise style leaves its output sharded on the last "
                 "dimension (`Shard(-1)`, as a local tensor by default). Its consumer must accept that: a "
                 "rowwise Linear (whose input is `Shard(-1)`) or an explicit `prepare_input`. planc found "
                 "none among the modules after it in the same block, so the next layer sees 1/tp of the "
                 "features, or the loss 1/tp of the vocabulary. Write `output replicate` to gather the "
                 "output, `loss_parallel` on the output projection, or add the rowwise consumer. (A warning: "
                 "planc reads the module tree, not the forward code.)\n\n"
                 "    parallel lm_head colwise   # warning: logits left sharded; `{ output replicate }`",
                 "warning"),
    "P417": Code("norm inside a sequence-parallel region", "Where the plan keeps activations sharded on the "
                 "sequence (`Shard(1)`: a `sequence` style, an `input shard(1)` or an `output shard(1)` next "
                 "to it), a norm with weights sees only 1/tp of the tokens. Unless it has the `sequence` "
                 "style, its weight gradient is not summed over the tensor axis and the tensor-parallel "
                 "ranks drift apart silently (checked on 2 gloo ranks: replicated or unstyled, each rank "
                 "keeps the gradient of its own tokens).\n\n"
                 "    parallel layers.*.attention_norm replicate   # error: write `sequence`"),
    "P418": Code("parameters left out of the tensor-parallel plan", "Once some modules are on the tensor axis, "
                 "their parameters are 2-D DTensors (data parallel x tensor) after `fully_shard`; the "
                 "parameters of modules no `parallel` line covers are 1-D. `clip_grad_norm_` fails on the "
                 "mix (torch 2.13: `All operands in aten.stack.default must have the same mesh`; "
                 "pytorch#180346), as foreach optimizers were reported to (pytorch#134212). The fix is "
                 "read from the layout chain: a Linear a colwise output feeds needs `rowwise`, a projection "
                 "missing beside split ones `colwise`, a module with weights on head-sharded activations "
                 "(a per-head `q_norm` after a colwise `q_proj`) `sequence { sequence_dim 2; local_output "
                 "true }` (P423: `replicate` would not reduce its gradient), and any other module "
                 "`replicate` (torchtitan's `NoParallel`), so every parameter lives on the same meshes. A "
                 "module whose own `parallel` rule has an error is not reported again.\n\n"
                 "    parallel **.self_attn.q_proj colwise\n"
                 "    # error: model.norm is left out: add `parallel model.norm replicate`"),
    "P419": Code("loss parallel not on the output projection", "`loss_parallel` belongs on the projection that "
                 "makes the logits: a Linear whose out-features are the vocabulary (the input embedding's "
                 "size). On another module its vocabulary-sharded DTensor output flows into layers that "
                 "expect local activations.\n\n"
                 "    parallel layers.*.mlp.w1 colwise { loss_parallel }   # error: not the logits"),
    "P420": Code("colwise or rowwise on a module torch cannot split", "torch's `ColwiseParallel` and "
                 "`RowwiseParallel` split only `nn.Linear` and `nn.Embedding` modules (subclasses included); "
                 "on anything else `parallelize_module` raises `NotImplementedError`. Select the Linear "
                 "layers inside, or use `prepare_input` / `prepare_output` / `replicate` on the container.\n\n"
                 "    parallel layers.*.attention colwise   # error: a block, not a Linear"),
    "P421": Code("tied parameters with different tensor-parallel placements", "A parameter shared by two "
                 "modules (a tied embedding and output projection) is one tensor: tensor parallelism must "
                 "place it the same way from both (embedding rowwise and output colwise both split the "
                 "vocabulary, `Shard(0)`), and both owners must be on the tensor axis. (They must also "
                 "be in one FSDP unit: P301.)\n\n"
                 "    parallel tok_embeddings rowwise\n    parallel output rowwise   # error: Shard(0) vs Shard(1)"),
    "P422": Code("rowwise input not produced", "A rowwise Linear reads its input as sharded on the last "
                 "dimension (`Shard(-1)`, its default): each rank holds 1/tp of the features, as a colwise layer "
                 "before it leaves them. planc found no colwise layer before it (or beside it) in the same "
                 "block, so its input is probably whole on every rank, and `DTensor.from_local` would read it "
                 "as a shard of a tp-times wider tensor. Make the layers that feed it colwise, or write "
                 "`input replicate`. (A warning: planc reads the module tree, not the forward code.)\n\n"
                 "    parallel **.self_attn.{q_proj, k_proj, v_proj} replicate\n"
                 "    parallel **.self_attn.o_proj rowwise   # warning: nothing colwise feeds it",
                 "warning"),
    "P423": Code("replicate on weights that see head-sharded activations", "Inside a module whose colwise "
                 "child leaves its output sharded on the heads or features (`Shard(-1)`: `q_proj` before a "
                 "per-head `q_norm`, as in Qwen3, Qwen3-MoE and Gemma 3), a module with weights sees 1/tp of "
                 "the heads on each rank. `replicate` (torchtitan's `NoParallel`) keeps its weight "
                 "replicated but never reduces its gradient over the tensor axis: each rank keeps the "
                 "gradient of its own heads (checked on 2 gloo ranks: 68-71% off on the tiny Qwen3), and the "
                 "copies drift apart. The shapes are fine, so the simulation cannot see it. Write "
                 "`sequence { sequence_dim 2; local_output true }` (the input is (batch, seq, heads, ...), "
                 "heads split: the gradient is summed over the tensor axis, as Hugging Face's "
                 "`replicated_with_grad_allreduce` does), or gather the producer's output.\n\n"
                 "    parallel **.self_attn.{q_proj, k_proj, v_proj} colwise\n"
                 "    parallel **.self_attn.{q_norm, k_norm} replicate   # error: gradient not reduced"),
    "P424": Code("colwise on a fused projection", "A fused projection makes several parts in one "
                 "output (Phi-3's `gate_up_proj` = [gate | up], `qkv_proj` = [q | k | v]) that the forward "
                 "cuts apart along the features (`chunk`, `split`, a slice). `colwise` splits the output "
                 "features contiguously, so rank 0 holds all of `gate` and rank 1 all of `up`: each rank "
                 "then cuts its own shard in two and computes another function. When the parts are as wide "
                 "as the rowwise consumer expects (the MLP's `down_proj`), every shape chains and the plan "
                 "trains silently wrong (checked on 2 gloo ranks: the tiny Phi-3's loss is off by 8.6e-4). "
                 "planc reports it where the rowwise consumer reads fewer features than the colwise layer "
                 "makes and the model, run on fake tensors up to that block, cuts the output along its last "
                 "dim first (a per-head fused output, GPT-NeoX's `query_key_value` viewed as (heads, 3 x "
                 "head_dim), keeps each head's parts together and is fine). Gather the output "
                 "(`colwise { output replicate }`, and `rowwise { input replicate }` on the consumer), or "
                 "split the fused weight into one Linear per part.\n\n"
                 "    parallel **.mlp.gate_up_proj colwise   # error: [gate | up] split contiguously\n"
                 "    parallel **.mlp.down_proj rowwise"),
    # --- pipeline parallelism (P46x-P47x; planc/resolve/pipeline.py, planc/checks/pipeline.py)
    "P460": Code("unknown pipeline schedule", "`pipeline NAME` names one of torch's schedule classes without "
                 "the `Schedule` prefix: GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, "
                 "ZBVZeroBubble, DualPipeV.\n\n    pipeline OneFOneB { microbatches 8 }   # error: write `1F1B`"),
    "P461": Code("stages per rank do not fit the schedule", "GPipe and 1F1B run one stage per pipeline rank; "
                 "the looped schedules (Interleaved1F1B, LoopedBFS, InterleavedZeroBubble) at least 2; the V "
                 "schedules (ZBVZeroBubble, DualPipeV) exactly 2, stages r and 2 x pipeline - 1 - r on rank r "
                 "(given a loop placement a V schedule hangs: tests/test_pipeline_facts_dist.py).\n\n"
                 "    pipeline ZBVZeroBubble { microbatches 8, stages_per_rank = 3 }   # error"),
    "P462": Code("pipeline lines and the pipeline axis disagree", "A `pipeline` or `stage` line needs a pipeline "
                 "axis on the mesh, the outermost (`mesh (pipeline = 2, shard = *)`), and a pipeline axis needs a "
                 "`pipeline` line naming torch's schedule and the microbatches.\n\n"
                 "    mesh (shard = *)\n    pipeline 1F1B { microbatches 8 }   # error: no pipeline axis\n\n"
                 "    mesh (pipeline = 2, shard = *)   # error: add `pipeline 1F1B { microbatches 8 }`"),
    "P463": Code("torch refuses the schedule's microbatches", "torch 2.13 refuses to build some schedules with "
                 "some microbatch counts: DualPipeV needs at least as many microbatches as stages, Interleaved1F1B "
                 "and InterleavedZeroBubble a multiple of their rounds once there are more microbatches than "
                 "pipeline ranks. planc builds the schedule as torch does and reports torch's reason. Use a count "
                 "it accepts.\n\n"
                 "    mesh (pipeline = 2, shard = *)\n    pipeline DualPipeV { microbatches 2 }   # error: 4 stages"),
    "P464": Code("pipeline axis without a fixed size", "The stages are cut for a known number of pipeline "
                 "ranks: give the pipeline axis a size and let a data-parallel axis take the rest of the world.\n\n"
                 "    mesh (pipeline = *, shard = 8)   # error: write `pipeline = 4, shard = *`"),
    "P465": Code("resharding after forward under a split-backward schedule", "InterleavedZeroBubble, "
                 "ZBVZeroBubble and DualPipeV split each backward into an input and a weight part; with FSDP "
                 "resharding after forward they train with wrong gradients on torch 2.13 (DualPipeV silently: "
                 "tests/test_pipeline_facts_dist.py). torchtitan never reshards after forward under a pipeline, "
                 "and neither does planc by default: remove `reshard after_forward = true`.\n\n"
                 "    pipeline DualPipeV { microbatches 8 }\n"
                 "    unit layers.* { reshard after_forward = true }   # error"),
    "P466": Code("local batch does not divide into the microbatches", "The pipeline cuts each data-parallel "
                 "rank's batch (the input's batch divided by the data-parallel degree) into the `pipeline` line's "
                 "microbatches; torch fails deep in the runtime when they are uneven "
                 "(tests/test_pipeline_facts_dist.py). Give a batch that divides, or fewer microbatches.\n\n"
                 "    mesh (pipeline = 2, shard = *)\n    pipeline 1F1B { microbatches 3 }\n"
                 "    expect memory.peak <= 1GiB at world = 4, input = 8x128   # error: 4 rows in 3"),
    "P467": Code("module in no stage", "Every module with parameters must be in one pipeline stage: a stage "
                 "keeps only its modules and drops the others. Add the module to a `stage` line.\n\n"
                 "    stage 0: tok_embeddings, layers[0:2]\n    stage 1: layers[2:], norm   # error: `output` in no stage"),
    "P468": Code("module in two stages", "A module (or its parameters) is listed in two `stage` lines; each "
                 "stage must own its modules alone.\n\n"
                 "    stage 0: tok_embeddings, layers[0:3]\n    stage 1: layers[2:], norm, output   # error: layers.2"),
    "P469": Code("stages out of forward order", "Stage N + 1 runs on the output of stage N: the stages must "
                 "hold contiguous runs of the model's modules in forward (registration) order, stage 0 first.\n\n"
                 "    stage 0: tok_embeddings, layers[2:4]\n    stage 1: layers[0:2], norm, output   # error"),
    "P470": Code("stages miscounted", "A pipeline of P ranks with V stages per rank has P x V stages, "
                 "numbered 0 to P x V - 1: write one `stage N:` line for each.\n\n"
                 "    mesh (pipeline = 2, shard = *)\n    pipeline 1F1B { microbatches 8 }\n"
                 "    stage 0: tok_embeddings, layers[0:4]\n    stage 2: layers[4:], norm, output   # error"),
    "P471": Code("embedding not first or head not last", "The first stage takes the token ids, so it holds "
                 "the input embedding; the last stage computes the loss, so it holds the output head.\n\n"
                 "    stage 0: layers[0:4], tok_embeddings   # error if `tok_embeddings` is in a later stage"),
    "P472": Code("unit spans two stages", "An FSDP unit gathers its parameters as one group on one rank; its "
                 "modules must lie in one stage. Split the unit, or move the stage boundary.\n\n"
                 "    unit [norm, output]\n    stage 0: tok_embeddings, layers, norm\n    stage 1: output   # error"),
    "P473": Code("tied weights across stages", "A parameter shared by modules in two stages (an embedding tied "
                 "to the output head) would be two copies trained apart on two ranks; torchtitan refuses it too. "
                 "Untie the weights, or keep their modules in one stage (a one-stage pipeline is no pipeline)."),
    "P474": Code("fewer microbatches than stages", "With m microbatches on p pipeline ranks the pipeline is "
                 "idle (p - 1) / (m + p - 1) of the step (interleaved with v stages per rank: (p - 1) / (v m + p - 1)); "
                 "with fewer microbatches than stages most of the step is bubble. Use more microbatches.\n\n"
                 "    mesh (pipeline = 4, shard = *)\n    pipeline 1F1B { microbatches 2 }   # warning: 60% bubble",
                 "warning"),
    "P475": Code("accumulation and a pipeline", "Under a pipeline, the `pipeline` line's microbatches are the "
                 "gradient accumulation: torch's schedule runs them all in one step. Remove the `step { accumulate "
                 "N }` line and write `microbatches N` in the `pipeline` block."),
    "P476": Code("not estimated for this pipeline plan", "`check --simulate` does not run a pipeline's schedule "
                 "on its fake process group; the memory per pipeline rank cannot cut a stage that has no unit "
                 "of its own, and does not model context or expert parallelism yet: the step, or the `expect "
                 "memory...` line, is not checked (the message says which and why). `expect memory...` lines are "
                 "otherwise checked on every pipeline rank.", "warning"),
    "P477": Code("the model cannot be cut automatically", "The automatic split cuts the model's repeated blocks "
                 "(with the embedding and the head each weighing one block) into pipeline x stages_per_rank "
                 "stages; the model has no list of blocks, or fewer pieces than stages. Use fewer stages, or "
                 "write `stage` lines."),
    "P479": Code("rule on a module the stages cut", "A `checkpoint`, `compile` or `parallel` rule applies to a "
                 "module whose submodules lie in several stages (a Hugging Face `model` holding the blocks): no "
                 "stage keeps the whole module, so the rule would do nothing. Apply it to modules inside the "
                 "stages.\n\n    checkpoint model full   # error under a pipeline: write `checkpoint "
                 "model.layers.* full`"),
    "P478": Code("split has no effect", "`split` says what the automatic split balances; with `stage` lines "
                 "there is no automatic split. Remove one or the other.", "warning"),
    # --- expert parallelism (P48x; planc/resolve/experts.py, planc/checks/experts.py)
    "P434": Code("tensor style on an expert-parallel MoE layer", "With a tensor axis, the MoE layer that holds "
                 "expert-parallel experts (their parent: router, shared experts, experts) runs on its tensor rank's "
                 "part of the group's tokens: the sequence shard when its input is sharded over the tensor axis "
                 "(sequence parallelism), else an equal cut of the replicated tokens, the outputs gathered back. A "
                 "tensor style on that layer changes its input's layout before planc reads it (a local sequence "
                 "shard would be taken for replicated tokens and cut again): remove it, planc splits the layer's "
                 "tokens itself.\n\n    parallel layers.*.moe prepare_input { ... }   # error beside "
                 "`parallel layers.*.moe.experts expert` on a mesh with a tensor axis"),
    "P436": Code("routing histogram does not fit the plan", "A routing histogram (`--routing FILE`, recorded by "
                 "`planc.analysis.routing.record_routing`) gives, per experts container, the rows each recorded rank "
                 "routed to each expert. The estimates read it for the containers the plan makes expert-parallel, so "
                 "its layers must be those containers, with the model's expert count, and its recorded ranks must "
                 "form expert groups: one rank (a dense run: every rank routes alike) or a multiple of the expert "
                 "degree. Record it on the model the plan shards.\n\n"
                 "    parallel layers.*.moe.experts expert   # error: the histogram counts 4 experts, the model has 64"),
    "P437": Code("not a routing histogram", "`--routing FILE` must name a routing histogram as "
                 "`record_routing(model).save(path)` writes it: a JSON object with \"planc_routing\": 1, the recorded "
                 "\"batch\" shape, the \"expert_degree\" and \"layers\", each a \"name\" and \"counts\" (rows per "
                 "rank per expert, non-negative integers, every rank with at least one row). The message says what "
                 "is missing and where.\n\n    {\"planc_routing\": 1, \"batch\": [2, 16], \"expert_degree\": 2, "
                 "\"layers\": [{\"name\": \"layers.0.moe.experts\", \"counts\": [[20, 17, 14, 13]]}]}"),
    "P480": Code("expert style without an expert axis", "`parallel SELECTOR expert` keeps whole experts on the "
                 "ranks of the mesh's expert axis, and the mesh has none. Add one (it borrows its ranks from shard x "
                 "context x tensor).\n\n    mesh (shard = *, expert = 2)\n    parallel layers.*.moe.experts expert"),
    "P481": Code("the expert style takes no options", "The `expert` style has one behaviour: each expert rank keeps "
                 "experts / expert whole experts and the rows routed to them arrive and leave by all-to-all. Remove "
                 "the block.\n\n    parallel layers.*.moe.experts expert { capacity 1.25 }   # error"),
    "P482": Code("experts do not split evenly", "Every rank of the expert axis keeps the same "
                 "number of whole experts, so every MoE layer's expert count must divide by the expert size. When "
                 "efsdp x expert exceeds the expert count, FSDP shards the experts on dim 1 (torchtitan's rule), "
                 "which torch 2.13 needs even: dim 1 must divide by efsdp.\n\n"
                 "    mesh (shard = *, expert = 3)   # error with 4 experts"),
    "P483": Code("expert degree does not divide the ranks it borrows", "The expert axis borrows its ranks from "
                 "shard x context x tensor (torchtitan's rule); the experts are FSDP-sharded over the rest, "
                 "shard x context x tensor / expert ranks. The expert size must divide shard x context x tensor.\n\n"
                 "    mesh (shard = 4, expert = 3)   # error: 3 does not divide 4"),
    "P484": Code("expert style on a module that is not an experts container", "The `expert` style slices a module's "
                 "3-D weights [experts, ...] by expert and wraps its forward, which takes the rows sorted by expert and "
                 "each expert's cumulative end (`planc.zoo.routed.RoutedExperts`). A module of another layout (one "
                 "module per expert, a router, a whole MoE layer) is refused; the message names the known layouts."
                 "\n\n    parallel layers.*.moe expert   # error: select layers.*.moe.experts"),
    "P485": Code("experts or router placed another way", "Expert parallelism places the experts' parameters (whole "
                 "experts per expert rank, FSDP on the expert mesh) and leaves the router replicated, so every rank "
                 "routes its own tokens with the same weights. An `ignore` or `place` line on the experts' parameters, "
                 "or a tensor-parallel style on the experts or their router, contradicts that; remove it."),
    "P486": Code("top-k larger than the expert count", "The router keeps top_k experts per token; a model whose "
                 "top_k exceeds its expert count cannot route (torch.topk raises at the first step)."),
    "P487": Code("expert parallelism inside pipeline stages, untested there", "The expert axis may borrow "
                 "tensor ranks (each MoE layer then runs on its tensor rank's part of the group's tokens) and context "
                 "ranks (each holds its own sequence shard, so its tokens are distinct). Inside pipeline stages it is "
                 "built for whole-backward schedules (GPipe, 1F1B, Interleaved1F1B, LoopedBFS) with the expert axis "
                 "borrowing shard ranks; beside a tensor axis or under a split-backward schedule it is not tested yet: "
                 "remove that axis or the `expert` style, or change the schedule."),
    "P488": Code("expert axis without an expert style", "The mesh has an expert axis but no module is "
                 "expert-parallel: the axis does nothing. Mark the experts containers, or remove the axis.", "warning"),
    # --- context parallelism (P49x; planc/resolve/context.py, planc/checks/context_parallel.py)
    "P490": Code("context style without a context axis", "`parallel SELECTOR context` makes attention gather keys "
                 "and values over the mesh's context axis, and the mesh has none. Add one.\n\n"
                 "    mesh (shard = *, context = 2)\n    parallel layers.*.attention context"),
    "P491": Code("the context style takes no options", "The `context` style has one behaviour: the sequence is "
                 "cut head-tail into 2 x context chunks, each rank keeps two, and attention gathers keys and values "
                 "over the context axis. Remove the block.\n\n"
                 "    parallel layers.*.attention context { balance round_robin }   # error"),
    "P492": Code("context axis without a context style", "The mesh has a context axis, so every batch is cut "
                 "along the sequence, but no module gets the `context` style: attention would see only its own "
                 "shard of the sequence and train wrong, silently. Mark the attention modules.\n\n"
                 "    mesh (shard = *, context = 2)   # error: nothing attends over the context axis\n"
                 "    parallel layers.*.attention context   # the fix"),
    "P493": Code("context style on a module that is not a supported attention", "The `context` style routes a "
                 "module's causal `F.scaled_dot_product_attention(q, k, v, is_causal=True)` (no mask) to attention "
                 "that gathers keys and values over the context axis, and passes the module its shard's global "
                 "positions as `positions=`. planc supports modules whose `forward` takes `positions` and calls "
                 "causal SDPA that way: the zoo's Llama `Attention` (`planc.zoo:llama`). Select those modules. The model's own "
                 "`forward` must take `positions` too, and pass them down: the loop calls "
                 "`model(tokens, positions=batch.positions)`.\n\n"
                 "    parallel layers.*.feed_forward context   # error: not an attention"),
    "P494": Code("model builds positions from the full sequence", "A Hugging Face model (Llama and its kin) builds "
                 "its rotary positions and its causal mask from the whole sequence inside the model's `forward`, and "
                 "its attention applies that mask; a sequence shard then gets wrong positions and a local causal "
                 "mask, which trains wrong without an error. Use a model whose attention takes global `positions=` "
                 "(the zoo's Llama, `planc.zoo:llama`), or drop the context axis."),
    "P495": Code("sequence length not divisible for context parallelism", "Context parallelism cuts each "
                 "sequence into 2 x context chunks (head-tail balancing), so the sequence length of `input = BxS` "
                 "must divide by 2 x context.\n\n"
                 "    mesh (shard = *, context = 4)\n    expect memory.peak <= 1GiB at world = 8, input = 2x100   "
                 "# error: 100 % 8 != 0"),
    # --- expectations (P5xx)
    "P425": Code("trains differently from one process", "`planc check --verify` trained the plan on a small "
                 "twin of the model on local processes (gloo, the smallest world that keeps every mesh axis "
                 "> 1) and the same steps unsharded in one process, in fp32, and a loss, gradient or updated "
                 "parameter differed by more than 1e-5 + 1e-4 x its size. The error is located on the rule "
                 "that shapes the differing parameters' gradients (the `parallel` line that styles the "
                 "module, else its `unit`), with the worst error. Run `planc check --simulate` and read the "
                 "tensor-parallel rules for that line.\n\n"
                 "    parallel layers.*.attn.q_norm replicate   # P425: its gradient is not reduced over tensor"),
    "P426": Code("plan not verified", "`planc check --verify` could not run the plan: no small twin of the "
                 "model is known (pass `--verify-model`), the mesh needs more local processes than the machine "
                 "runs (4), the plan does not apply or train on the twin, or the run did not finish in time. "
                 "The message says which.\n\n    planc check plans/big.plan --verify --verify-model pkg.mod:tiny"),
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
    "P607": Code("Trainer accumulates differently", "`planc.integrations.hf.trainer_arguments` turns the plan's "
                 "`step { accumulate N, sync = ... }` into the Trainer's `gradient_accumulation_steps` (and "
                 "`sync_each_batch` for `sync = every`). Under HSDP the Trainer defers only the all-reduce across "
                 "replicas to the last microbatch and reduce-scatters every microbatch, which is neither of planc's "
                 "two modes, so its memory and time estimates would not describe the run. Write `sync = every` "
                 "(the Trainer then syncs each microbatch), or shard without a replicate axis.\n\n"
                 "    mesh (replicate = 2, shard = *)\n    step { accumulate 4, sync = last }   # P607 with the Trainer"),
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
    # --- pipeline stages on the model (ppverify: P456)
    "P451": Code("activation checkpointing under a split-backward schedule", "InterleavedZeroBubble, "
                 "ZBVZeroBubble and DualPipeV split each backward into an input half and a weight half run later. "
                 "On torch 2.13 the composable `checkpoint` planc applies fails in the weight half "
                 "(`AttributeError: '_GeneratorContextManager' object has no attribute 'args'` in "
                 "`backward_weight_one_chunk`; tests/test_pipeline_facts_dist.py), so the first step would crash. "
                 "Remove the `checkpoint` lines, or use a schedule without a split backward.\n\n"
                 "    pipeline 1F1B { microbatches 8 }\n    checkpoint layers.* full"),
    "P456": Code("the forward is not a chain of the stages", "Each pipeline stage runs the model's forward with "
                 "the modules outside it passed through (they return their first argument). A forward that "
                 "indexes its blocks or carries state across them breaks that: GPT adds `wpe(positions)` to the "
                 "token embedding, so a later stage would pass token positions on as its hidden state. planc "
                 "cuts the model into the plan's stages on meta and runs them chained on token ids before "
                 "anything runs; fix the stages (keep the modules the forward combines in one stage) or the "
                 "forward (state that crosses blocks travels in the hidden state)."),
    # --- `planc import --hf-tp-plan` (tpplans: P457-P459)
    "P457": Code("Hugging Face tensor-parallel style not imported", "An entry of the model's Hugging Face "
                 "tensor-parallel plan (`base_model_tp_plan`, `_tp_plan`) has no torch `ParallelStyle` "
                 "equivalent (packed fused weights, expert parallelism, MLA), places a single parameter, or "
                 "names no module of the model. The imported plan leaves it out with a `# not imported:` "
                 "comment; the module's parameters are replicated on the tensor axis instead.\n\n"
                 "    # not imported: model.layers.*.mlp.experts.gate_up_proj packed_colwise (...)", "warning"),
    "P458": Code("no Hugging Face tensor-parallel plan", "`planc import --hf-tp-plan` reads the plan "
                 "transformers ships with the model (`config.base_model_tp_plan`); this model has none (it "
                 "is not a Hugging Face model, or transformers has no tensor-parallel plan for it). Write "
                 "the `parallel` statements by hand (docs/language.md)."),
    "P459": Code("tensor parallelism and shared parameters", "Two modules share one parameter (tied "
                 "input and output embeddings). `parallelize_module` registers a new parameter on each module it "
                 "places, so the owners would hold two copies that train apart; planc (`planc.apply` and the "
                 "code `planc emit` prints) ties them again when the owners place the parameter alike, as the "
                 "imported embedding rowwise and output colwise do (both shard the vocabulary, `Shard(0)`). "
                 "Owners placed differently are an error of `planc check` (P421).", "warning"),
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
    "P952": Code("no tensor-parallel degree can be searched", "`planc suggest --tensor-parallel RULES --tensor T,...` "
                 "adds the `parallel` rules at each degree T, and every degree asked for was skipped: the rules fail "
                 "planc's static checks there (heads or features not divisible by T, P410-P422), T does not divide "
                 "the world, or the model did not run as one tensor rank. The message says why per degree; include "
                 "degree 1 (the 1-D search) or degrees the rules hold at.\n\n"
                 "    planc suggest --model planc.zoo:llama_tiny --world-size 8 --budget 1MiB --input-shape 2x16 \\\n"
                 "        --tensor-parallel plans/zoo-llama-tp.plan --tensor 1,2"),
    "P953": Code("model does not run on the search's inputs", "`planc suggest` runs one training step of the model "
                 "(on fake tensors) to count activations and FLOPs, and the model did not run on the inputs given. "
                 "`--input-shape BxS` feeds token ids of batch B and sequence S, as a decoder language model takes "
                 "them; a model that takes other inputs (an encoder-decoder's decoder ids, images, a mask) needs "
                 "`--inputs MODULE:FN`, a factory called with the model that returns its inputs per rank (a tuple, "
                 "a dict of keywords or an `Example`), as `planc explain --inputs` takes it.\n\n"
                 "    planc suggest --model hf:t5-tiny --world-size 8 --budget 4MiB --inputs tests.step_inputs:t5_inputs"),
    "P954": Code("no pipeline degree can be searched", "`planc suggest --pipeline P,...` searches each pipeline "
                 "degree P with the tensor degrees asked for, and every degree was skipped: P x T does not divide "
                 "the world, the global batch (`--global-batch`, default world x B) does not divide among the "
                 "data-parallel ranks or gives fewer sequences per data-parallel rank than pipeline ranks, or the "
                 "model cuts into fewer stages than P (its blocks, the modules before them and after them). The "
                 "message says why per degree.\n\n"
                 "    planc suggest --model planc.zoo:llama_tiny --world-size 8 --budget 1MiB --input-shape 2x16 \\\n"
                 "        --pipeline 2,4"),
    "P960": Code("no combination of degrees can be searched", "`planc suggest --context-parallel RULES` or "
                 "`--expert-parallel RULES` (with or without `--tensor-parallel`) searches every combination of the "
                 "degrees asked for, each with its axes' `parallel` rules, and every combination was skipped: planc's "
                 "checks reject it (P482 experts not dividing, P487 experts with a pipeline axis, P495 a "
                 "sequence that does not cut into 2 x context chunks, ...), its axes do not divide the world, or the "
                 "model did not run as one rank of it. The message says why per combination; include degree 1 (the "
                 "plan without that axis) or degrees the rules hold at.\n\n"
                 "    planc suggest --model planc.zoo:routed_moe_tiny --world-size 8 --budget 1MiB --input-shape 2x16 \\\n"
                 "        --expert-parallel auto --expert 1,2"),
    "P961": Code("expert routing not estimated", "`planc suggest --expert-parallel` prices each MoE layer's "
                 "all-to-alls from its routing, read from the model: `top_k` from the MoE layer (`router.top_k` as "
                 "planc.zoo's routed MoE names it, `top_k` or `gate.top_k` as Hugging Face's Mixtral and Qwen3-MoE "
                 "do) and the rows' width from the experts container (`w1` `[experts, hidden, dim]`, or Hugging "
                 "Face's `hidden_dim`). An experts container the `expert` style fits whose routing is named "
                 "otherwise is not estimated: the expert degrees are skipped with this code and the layer's path. "
                 "Give the MoE layer (or its router) a `top_k` attribute and the experts a `hidden_dim`, or write "
                 "the plan by hand.\n\n"
                 "    planc suggest --model tests.moe_models:unnamed_top_k --world-size 8 --budget 1MiB \\\n"
                 "        --input-shape 2x16 --expert-parallel auto --expert 2"),
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
