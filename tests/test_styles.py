"""The table of style semantics (`planc/resolve/styles.py`): one row per style word, and the
runtime and emit build the class each row names, with the placements torch gives it."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor import parallel as torch_tp
from torch.distributed.tensor.parallel import parallelize_module

from planc.backends import runtime
from planc.backends.emit import style_source
from planc.lang import vocabulary as vocab
from planc.lower.lowering import PLACING_STYLES, SUBTREE_STYLES, tensor_param_dim
from planc.resolve.context import CONTEXT_STYLE
from planc.resolve.mesh import Role
from planc.resolve.styles import IN, OUT, ROWS, STYLES, Layout
from planc.resolve.tensor import STYLE_KINDS, STYLE_OPTIONS, TensorStyle

# Arguments that make each torch style constructible (PrepareModuleOutput needs its output layouts).
_ARGS = {"prepare_input": dict(input_layouts=(Layout("shard", 1),), desired_input_layouts=(Layout("replicate"),)),
         "prepare_output": dict(output_layouts=(Layout("shard", 1),), desired_output_layouts=(Layout("replicate"),)),
         "prepare": dict(input_layouts=(Layout("shard", 1),), desired_input_layouts=(Layout("replicate"),),
                         output_layouts=(Layout("replicate"),), desired_output_layouts=(Layout("shard", 1),))}


def test_every_style_word_has_exactly_one_row():
    words = [r.word for r in ROWS]
    assert sorted(words) == sorted(vocab.STYLES) and len(set(words)) == len(words)
    assert STYLE_KINDS == tuple(w for w in vocab.STYLES if STYLES[w].axis is Role.TENSOR)
    assert STYLES[CONTEXT_STYLE].axis is Role.CONTEXT and STYLES[CONTEXT_STYLE].torch_class is None


def test_the_words_torch_classes_are_the_tables():
    """`vocabulary.TORCH_STYLES` (the lexer's and the syntax help's, below the resolver) agrees with the rows."""
    assert vocab.TORCH_STYLES == {r.word: r.torch_class for r in ROWS if r.torch_own}


def test_options_come_from_the_rows():
    for option, (_, takers, _) in STYLE_OPTIONS.items():
        assert takers == tuple(w for w in STYLE_KINDS if option in STYLES[w].options), option
    for r in ROWS:  # a row names only options the resolver knows
        assert set(r.options) <= set(STYLE_OPTIONS), r.word


@pytest.mark.parametrize("word", [r.word for r in ROWS if r.torch_class])
def test_runtime_and_emit_build_the_class_the_row_names(word):
    row = STYLES[word]
    built = runtime.torch_style(TensorStyle(word, **_ARGS.get(word, {})))
    assert type(built).__name__ == row.torch_class
    expected = getattr(torch_tp, row.torch_class) if row.torch_own else runtime.ReplicateParallel
    assert type(built) is expected and isinstance(built, torch_tp.ParallelStyle)
    assert style_source(TensorStyle(word, **_ARGS.get(word, {}))).startswith(row.torch_class + "(")


def _placement(layout: Layout):
    return Shard(layout.dim) if layout.kind == "shard" else {"replicate": Replicate(), "partial": Partial()}[layout.kind]


@pytest.mark.parametrize("word", ["colwise", "rowwise"])
def test_default_layouts_are_torchs(word):
    """A row's `input` / `output` defaults are what torch's class sets when the plan says nothing."""
    row, built = STYLES[word], runtime.torch_style(TensorStyle(word))
    assert built.input_layouts == (_placement(row.input),)
    assert built.output_layouts == (_placement(row.output),)
    # colwise computes its output features split, rowwise partial sums
    assert row.computes_out == {OUT: Layout("shard", -1), IN: Layout("partial")}[row.splits]


@pytest.fixture()
def fake_group():
    """A fake process group of 2 ranks (torch's FakeStore: one process, no communication)."""
    from planc.analysis.simulate import init_fake
    init_fake(2)
    yield
    dist.destroy_process_group()


def test_the_dims_a_style_splits_are_torchs(fake_group):
    """The parameter dims a row says a style shards are the ones torch's class shards."""
    mesh = DeviceMesh("cpu", [0, 1])
    checked = 0
    for row in ROWS:
        if row.torch_class is None or not row.places:
            continue
        for module, embedding in ((nn.Linear(4, 6), False), (nn.Embedding(8, 4), True)):
            parallelize_module(module, mesh, runtime.torch_style(TensorStyle(row.word)))
            for local, p in module.named_parameters():
                dim = tensor_param_dim(row.word, embedding, local)
                got = p.placements if isinstance(p, DTensor) else None
                assert got == ((Shard(dim),) if dim is not None else (Replicate(),)), (row.word, local, got)
                checked += 1
    assert checked == 4 * 3  # colwise, rowwise, sequence, replicate x (Linear weight, bias; Embedding weight)


def test_lowering_sets_come_from_the_rows():
    assert set(PLACING_STYLES) == {"colwise", "rowwise", "sequence", "replicate"}
    assert set(SUBTREE_STYLES) == {"sequence", "replicate"}
