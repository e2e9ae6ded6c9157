"""The one table of style semantics: what each `parallel` style word means, one row per word.

    parallel layers.*.attention.wq colwise      # STYLES["colwise"]
    parallel layers.*.attention context         # STYLES["context"]

Every module that asks what a style does reads its row here instead of comparing the word:
the resolver (which options a style takes, how many layouts), lowering (which parameter dim
a style splits, whose parameters become DTensors), the runtime and emit (the class they build
and print), tensor_local (the layouts a module computes in), time (which collectives), the
checks, explain, hover and verify's gradient note. A new style (expert parallelism's) is a new
row. It sits in `resolve` so that the resolver, below `lower` in the layers, can read it too.

The facts are torch's (2.13, `torch.distributed.tensor.parallel.style`): `ColwiseParallel`
takes a `Replicate` input and leaves a `Shard(-1)` output, `RowwiseParallel` takes `Shard(-1)`
and leaves its partial sums reduced to `Replicate`; `SequenceParallel` keeps parameters whole
(`Replicate`) and their gradients are summed over the tensor axis; the `PrepareModule*` styles
only change layouts. `replicate` is planc's `ReplicateParallel` (torchtitan's `NoParallel`).
"""

from __future__ import annotations

from dataclasses import dataclass

from planc.resolve.context import CONTEXT_STYLE
from planc.resolve.experts import EXPERT_STYLE
from planc.resolve.mesh import Role


@dataclass(frozen=True, slots=True)
class Layout:
    """A DTensor placement on the tensor axis: `Replicate()`, `Shard(dim)` or `Partial()`.

    Written in a plan as `replicate`, `shard(1)`, `partial`; a layout of None (`none`) is a
    positional input the style leaves alone.
    """

    kind: str  # "replicate" | "shard" | "partial"
    dim: int | None = None

    def __str__(self) -> str:
        return f"shard({self.dim})" if self.kind == "shard" else self.kind


REPLICATE = Layout("replicate")
OUT, IN = "out", "in"  # which features of a Linear's weight a style splits (`StyleRule.splits`)
OWN, SUBTREE = "own", "subtree"  # whose parameters a style places on the tensor axis (`StyleRule.places`)

_REPLICATE, _LAST, _PARTIAL = REPLICATE, Layout("shard", -1), Layout("partial")
_LAYOUT_OPTIONS = ("input", "output")
_PREPARE_IN = ("input", "desired_input", "input_kwargs", "desired_input_kwargs")
_PREPARE_OUT = ("output", "desired_output")


@dataclass(frozen=True)
class StyleRule:
    """One style word's semantics (one row of `STYLES`)."""

    word: str                      # the plan's word (`vocabulary.STYLES`)
    axis: Role                     # the mesh axis it acts on
    torch_class: str | None        # the ParallelStyle class the runtime builds and emit prints (None: not a ParallelStyle)
    torch_own: bool                # the class is torch's (`torch.distributed.tensor.parallel`), not planc's runtime's
    options: tuple[str, ...]       # the block options it takes (`resolve/tensor.STYLE_OPTIONS` derives from them)
    one_layout: bool = False       # its `input` / `output` take one layout (a Linear has one input, one output)
    splits: str | None = None      # OUT / IN: the Linear weight features it splits (None: parameters kept whole)
    places: str | None = None      # OWN / SUBTREE: whose parameters become DTensors (None: none)
    reduces_grad: bool = False     # the whole weight's gradient is summed over the tensor axis (sequence)
    input: Layout | None = None    # what its `input` option defaults to: the layout it expects and computes in
    output: Layout | None = None   # what its `output` option defaults to: the layout it leaves
    computes_out: Layout | None = None  # the layout its local output comes out in, before it is redistributed
    prepares_input: bool = False   # it redistributes inputs (`input`/`desired_input`, keyword inputs too)
    prepares_output: bool = False  # it redistributes outputs (`output`/`desired_output`)
    gradient: str | None = None    # what it does to a weight's gradient (verify's P425 note)
    summary: str = ""              # one line: what the word means (hover)

    @property
    def tensor(self) -> bool:
        """A tensor-parallel style (on the tensor axis)."""
        return self.axis is Role.TENSOR

    def param_dim(self, embedding: bool, local: str) -> int | None:
        """The dim this style shards a module's own parameter `local` on (None: replicated).

        torch 2.13: colwise (OUT) shards an `nn.Linear`'s weight and bias on dim 0 (out features)
        and an `nn.Embedding`'s weight on dim 1; rowwise (IN) shards a Linear's weight on dim 1
        (in features, the bias stays replicated) and an Embedding's on dim 0 (the vocabulary).
        """
        if self.splits == OUT:
            return 1 if embedding else 0
        if self.splits == IN:
            return 0 if embedding else (1 if local == "weight" else None)
        return None


def _torch(cls: str) -> str:
    return f"tensor parallelism, torch's `{cls}` on the tensor axis"


ROWS: tuple[StyleRule, ...] = (
    StyleRule("colwise", Role.TENSOR, "ColwiseParallel", True, (*_LAYOUT_OPTIONS, "local_output", "loss_parallel"),
              one_layout=True, splits=OUT, places=OWN, input=_REPLICATE, output=_LAST, computes_out=_LAST,
              gradient="splits the weight's output features over the tensor axis; its input's gradient is summed "
                       "over the tensor ranks", summary=_torch("ColwiseParallel")),
    StyleRule("rowwise", Role.TENSOR, "RowwiseParallel", True, (*_LAYOUT_OPTIONS, "local_output"),
              one_layout=True, splits=IN, places=OWN, input=_LAST, output=_REPLICATE, computes_out=_PARTIAL,
              gradient="splits the weight's input features over the tensor axis; its output is summed over the ranks",
              summary=_torch("RowwiseParallel")),
    StyleRule("sequence", Role.TENSOR, "SequenceParallel", True, ("local_output", "sequence_dim"),
              places=SUBTREE, reduces_grad=True,
              gradient="keeps the weight whole and sums its gradient over the tensor axis",
              summary=_torch("SequenceParallel")),
    StyleRule("replicate", Role.TENSOR, "ReplicateParallel", False, (), places=SUBTREE,
              gradient="keeps the weight whole on every tensor rank and does not reduce its gradient over the tensor axis",
              summary="the parameters replicated on the tensor axis (torchtitan's `NoParallel`)"),
    StyleRule("prepare_input", Role.TENSOR, "PrepareModuleInput", True, (*_PREPARE_IN, "local_output"),
              prepares_input=True, summary=_torch("PrepareModuleInput")),
    StyleRule("prepare_output", Role.TENSOR, "PrepareModuleOutput", True, (*_PREPARE_OUT, "local_output"),
              prepares_output=True, summary=_torch("PrepareModuleOutput")),
    StyleRule("prepare", Role.TENSOR, "PrepareModuleInputOutput", True, (*_PREPARE_IN, *_PREPARE_OUT, "local_output"),
              prepares_input=True, prepares_output=True, summary=_torch("PrepareModuleInputOutput")),
    StyleRule(CONTEXT_STYLE, Role.CONTEXT, None, False, (),
              summary="context parallelism: attention gathers keys and values over the context axis"),
    StyleRule(EXPERT_STYLE, Role.EXPERT, None, False, (),
              summary="expert parallelism: whole experts per expert rank, their tokens moved there and back by "
                      "all-to-all; the experts FSDP-sharded on the expert-data-parallel mesh"),
)

STYLES: dict[str, StyleRule] = {r.word: r for r in ROWS}
# The tensor-parallel style words, in the table's order (what `resolve/tensor.py` accepts).
TENSOR_STYLES: tuple[str, ...] = tuple(r.word for r in ROWS if r.tensor)


def rule(kind: str) -> StyleRule:
    """The row of a style word (KeyError for a word that is not one: every caller has a resolved style)."""
    return STYLES[kind]
