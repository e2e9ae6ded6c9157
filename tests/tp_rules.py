"""The tensor-parallel rules of the zoo's Llama-shaped models as plan text, for the tests' plans
(plans/zoo-llama-tp.plan's, torchtitan's): sequence-parallel norms, the attention and the
feed-forward split colwise then rowwise, the head colwise on a sequence-sharded input."""

from __future__ import annotations

ATTENTION = """parallel tok_embeddings rowwise {
  input replicate
  output shard(1)
}
parallel layers.*.{attention_norm,ffn_norm} sequence
parallel layers.*.attention prepare_input {
  input shard(1)
  desired_input replicate
}
parallel layers.*.attention.{wq,wk,wv} colwise
parallel layers.*.attention.wo rowwise { output shard(1) }
"""

FEED_FORWARD = """parallel layers.*.feed_forward prepare_input {
  input shard(1)
  desired_input replicate
}
parallel layers.*.feed_forward.{w1,w3} colwise
parallel layers.*.feed_forward.w2 rowwise { output shard(1) }
"""


def head(output: str = "loss_parallel") -> str:
    """The final norm sequence-parallel and the output projection colwise, its logits `output`
    (`loss_parallel`: vocabulary-sharded into the loss; `output replicate`: gathered)."""
    return f"parallel norm sequence\nparallel output colwise {{\n  input shard(1)\n  {output}\n}}\n"
