"""What the planner needs to know about a model: its shape, parameter counts and FLOPs per token.

A `ModelSpec` is pure data. It comes from a Hugging Face config (`families.py`),
a preset or a user's builder (`models.py`); memory and time are computed from it
in `activations.py`, `memory.py` and `timing.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from .experts import ExpertShape


@dataclass(frozen=True)
class StageCost:
    """One stage of a module-graph pipeline cut, per token: its parameter tensors, forward FLOPs, the bytes
    autograd keeps for its backward (traced in fp32) and the elements it sends to the next stage."""

    tensors: tuple[int, ...]
    forward_flops: float
    saved_bytes: float
    output_elements: float


@dataclass(frozen=True)
class Traced:
    """Per-token costs of a model without a Hugging Face config, measured by tracing its forward in fp32
    (`traced.py`): one block, and the modules before and after the blocks. A model without a list of repeated
    blocks is one block, and `graph_cuts[pp - 2]` are its stages as the runtime's module-graph cut makes them."""

    block_flops: float
    block_saved_bytes: float
    edge_flops: float
    first_saved_bytes: float
    last_saved_bytes: float
    graph_cuts: tuple[tuple[StageCost, ...], ...] = ()


@dataclass(frozen=True)
class RankCut:
    """One pipeline rank's share of the runtime's cut: its blocks over all its stages, and whether it holds the
    embedding (the first stage) and the head (the last)."""

    blocks: int
    holds_first: bool
    holds_last: bool


@dataclass(frozen=True)
class ModelSpec:
    """A transformer of `layers` identical blocks plus an embedding and an output head, or a traced module.

    Parameters are listed tensor by tensor (element counts), because ZeRO-1 hands
    whole tensors to ranks. `embedding_tensors` and `head_tensors` live outside the
    blocks, on the first and on the last pipeline stage; a tied LM head counts once
    in `parameters` but is held by both end stages when the model is pipelined.
    """

    name: str
    family: str              # gpt2 | llama | bert | vit
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int                 # intermediate size of the MLP
    vocab: int               # rows of the token embedding; 0 for ViT
    seq_len: int             # tokens per sample by default (ViT: patches + 1)
    activation: str          # HF activation name: gelu, gelu_new, silu, ...
    gated_mlp: bool          # Llama-style gate * up MLP
    norm: str                # layernorm | rmsnorm
    attention_dropout: float
    hidden_dropout: float
    parameters: int          # total, as the built model counts them
    layer_tensors: tuple[int, ...]      # one transformer block
    embedding_tensors: tuple[int, ...]
    head_tensors: tuple[int, ...]       # final norm and output head not shared with the embedding
    tied_head: bool          # the head reuses the token embedding matrix
    head_outputs: int        # logits per token (vocab for LM heads; 0 when only one token is classified)
    input_elements_per_token: float = 0.0  # model input a token carries (ViT: pixels of its patch)
    embedding_saved_elements: float = 0.0  # kept per token by the embedding for backward (ViT pixels, BERT's LayerNorm)
    head_saved_elements: float = 0.0       # kept per token by the final norm / head transform, before the logits
    traced: Optional[Traced] = None        # measured costs, in place of the transformer formulas
    sequential_blocks: bool = False        # the blocks are an nn.Sequential, whose runs set_activation_checkpointing
                                           # can group (Hugging Face models call a ModuleList's blocks one by one)
    experts: Optional[ExpertShape] = None  # a mixture of experts': each token passes through top-k of them
    rank_cut: Optional[RankCut] = None     # the pipeline rank a memory prediction is for (memory.py sets it per
                                           # rank); None: the fullest stage, with the larger of embedding and head

    def graph_stages(self, pp: int) -> tuple[StageCost, ...]:
        """The module-graph cut into `pp` stages, for a traced model without a block list; else ()."""
        cuts = self.traced.graph_cuts if self.traced else ()
        return cuts[pp - 2] if 2 <= pp <= len(cuts) + 1 else ()

    @property
    def max_stages(self) -> int:
        """Most pipeline stages the runtime can cut the model into."""
        if self.traced and self.traced.graph_cuts:
            return len(self.traced.graph_cuts) + 1
        return self.layers

    def boundary_elements(self, pp: int) -> float:
        """Elements per token a pipeline stage sends to the next (the hidden state; a graph cut's largest)."""
        stages = self.graph_stages(pp)
        return max(s.output_elements for s in stages[:-1]) if stages else self.hidden

    @property
    def causal(self) -> bool:
        """Decoder language models attend only to earlier positions (a fused kernel skips the rest)."""
        return self.family in ("gpt2", "llama", "mixtral")

    @property
    def layer_parameters(self) -> int:
        return sum(self.layer_tensors)

    @property
    def active_layer_parameters(self) -> float:
        """Weights of a block one token passes through: a mixture of experts' top-k experts only."""
        if self.experts is None:
            return self.layer_parameters
        e = self.experts
        return self.layer_parameters - e.per_expert * (e.experts - e.top_k) * e.moe_layers / self.layers

    @property
    def embedding_parameters(self) -> int:
        return sum(self.embedding_tensors)

    @property
    def head_parameters(self) -> int:
        return sum(self.head_tensors)

    @property
    def block_norm_tensors(self) -> int:
        """Hidden-sized norm weights per block: two norms, each a scale (and a LayerNorm's bias). Sequence
        parallelism sums each one's gradient over the tensor-parallel group."""
        return 2 * (1 if self.norm == "rmsnorm" else 2)

    @property
    def head_matmul_parameters(self) -> int:
        """Weights the head multiplies per token (a tied embedding counts here). A classifier
        that reads one token per sample costs nothing per token."""
        return self.head_outputs * self.hidden

    def flops_per_token(self, seq: int) -> float:
        """Training FLOPs per token (forward + backward = 3 × forward), without recompute.

        Forward: 2 FLOPs per weight the token passes through (every block, the head, and a
        ViT's patch projection) plus 4·s·h per block for QKᵀ and attention × V. This is the
        PaLM/Megatron convention, so MFU from it compares with published numbers.
        """
        return 3 * self.forward_flops_per_token(seq, self.layers) + 3 * self.edge_flops_per_token()

    def forward_flops_per_token(self, seq: int, layers: int) -> float:
        """Forward FLOPs per token through `layers` blocks (what recompute repeats)."""
        if self.traced:
            return layers * self.traced.block_flops
        return layers * (2 * self.active_layer_parameters + 4 * seq * self.hidden)

    def edge_flops_per_token(self) -> float:
        """Forward FLOPs per token outside the blocks: the head and a ViT's patch projection."""
        if self.traced:
            return self.traced.edge_flops
        return 2 * (self.head_matmul_parameters + self.input_elements_per_token * self.hidden)

    def stage_flops_per_token(self, seq: int, pp: int) -> tuple[float, float]:
        """Forward FLOPs per token on the busiest stage: (in its blocks, which recompute repeats; outside them)."""
        stages = self.graph_stages(pp)
        if stages:
            return max(s.forward_flops for s in stages), 0.0
        return self.forward_flops_per_token(seq, self.stage_layers(pp)), self.edge_flops_per_token()

    def stage_layers(self, pp: int) -> int:
        """Blocks on the fullest pipeline stage (⌈layers / pp⌉), or on the rank `rank_cut` names."""
        if self.rank_cut is not None and pp > 1:
            return self.rank_cut.blocks
        return math.ceil(self.layers / pp)

    def stage_parameters(self, pp: int) -> int:
        """Parameters on the largest pipeline stage, before tensor parallelism.

        With one stage this is the whole model. Otherwise the first stage holds the
        embedding, the last the head (and its own copy of a tied embedding).
        """
        if pp == 1:
            return self.parameters
        return sum(self.stage_tensors(pp))

    def stage_tensors(self, pp: int) -> tuple[int, ...]:
        """Parameter tensors of the largest pipeline stage, as `stage_parameters` counts them, in the order
        its forward uses them."""
        stages = self.graph_stages(pp)
        if stages:
            return max((s.tensors for s in stages), key=sum)
        blocks = self.layer_tensors * self.stage_layers(pp)
        if pp == 1:
            return self.embedding_tensors + blocks + self.head_tensors
        last = self.head_tensors + ((self.vocab * self.hidden,) if self.tied_head else ())
        if self.rank_cut is not None:
            return ((self.embedding_tensors if self.rank_cut.holds_first else ()) + blocks
                    + (last if self.rank_cut.holds_last else ()))
        return self.embedding_tensors + blocks if sum(self.embedding_tensors) >= sum(last) else blocks + last
