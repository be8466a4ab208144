"""The forward+backward cost of each piece a pipeline split moves around: a block of each kind, the
embedding, and the LM head with its loss (Megatron's --account-for-embedding-in-pipeline-split and
--account-for-loss-in-pipeline-split, made quantitative).

A deterministic model, not a measurement: every rank computes the same numbers from the model config and
the work shape, so `parallel.stage_layers=auto` needs no collective and the single-process simulator picks
the same split as the pipeline. Units are FLOP-equivalents per token, for one forward and its backward:

- matmuls and the sequence mixers: the model's FLOP count, model_zoo.counting (the one the training log's
  MFU uses: 6 x MACs, forward and its input and weight gradients), to which this module adds only what the
  device does on top;
- memory-bound elementwise work (norms, softmax, SwiGLU's gate, the fp32 cross entropy over the
  vocabulary, the embedding's dense gradient) as element passes x `elementwise`, the FLOPs the device
  does in the time one fp32 element is read and written (its roofline ratio: peak FLOP/s / bytes/s x 8).
  It is what makes the head of a small model expensive: at vocabulary 8192 and hidden 128 the cross
  entropy costs about a third of the head's matmul on a CPU.

Attention's score work grows with the sequence (full T x T on the math path; the causal half with a
flash kernel) while Gated DeltaNet's grows with its chunk size, so which layer kind is dearer depends on
train.seq_len. The figures are estimates; the pipeline's end-of-run summary measures the real per-stage
busy time and suggests a split from it (asyncpp.pipeline.executor).
"""

from __future__ import annotations

from dataclasses import dataclass

from model_zoo.counting import layer_flops_per_token

ELEMENTWISE_FLOPS = {"cpu": 40.0, "cuda": 300.0}
"""FLOP-equivalents of one fp32 element pass: a core's ~50 GFLOP/s FMA rate over ~10 GB/s of bandwidth
(x 8 bytes); an H100's ~990 TFLOP/s bf16 over 3.35 TB/s. Rough on purpose: only ratios matter."""

FLOP_RATE = {"cpu": 50e9, "cuda": 0.4 * 989e12}
"""FLOP/s a stage's forward and backward reach: what turns the FLOP-equivalents above into seconds, needed
only where compute is set against communication (asyncpp.core.vocab_split). A core's ~50 GFLOP/s; an H100
SXM's 989 TFLOP/s dense bf16 at 40% MFU (bench/schedules.py's defaults). A faster device makes the same
bytes relatively dearer, so this is the number to revisit when a measured MFU is known."""


@dataclass(frozen=True)
class LayerCosts:
    """Forward+backward FLOP-equivalents per token."""

    layers: tuple[float, ...]
    """One per layer of the model, in order."""
    embedding: float
    head: float
    """Final norm, LM head and the cross entropy."""
    head_fixed: float = 0.0
    """The part of `head` that does not shrink with a vocabulary shard: the final norm, applied once per token
    on the last stage (a vocabulary-parallel head, asyncpp.core.vocab_split, spreads only `head_vocab`)."""
    embedding_fixed: float = 0.0
    """The part of `embedding` that does not shrink with a vocabulary shard: the gather and its scatter-add, per
    token (a sharded embedding runs them on every stage; the dense table gradient's part splits with the rows)."""

    @property
    def head_vocab(self) -> float:
        """The part of `head` proportional to the vocabulary: the logits matmul and the fp32 cross entropy."""
        return self.head - self.head_fixed

    def stage_costs(self, sizes: list[int]) -> list[float]:
        """The cost of each stage of a split (embedding on the first, head on the last)."""
        out, start = [], 0
        for size in sizes:
            out.append(sum(self.layers[start:start + size]))
            start += size
        out[0] += self.embedding
        out[-1] += self.head
        return out


def layer_costs(model, seq_len: int, micro_batch_size: int, device_type: str = "cpu") -> LayerCosts:
    """Costs of every layer, the embedding and the head of `model` (a model_zoo.ModelConfig) at this work shape."""
    e = ELEMENTWISE_FLOPS.get(device_type, ELEMENTWISE_FLOPS["cpu"])
    h, tokens = model.hidden_size, seq_len * micro_batch_size
    layers = tuple(_block(model, i, seq_len, device_type, e) for i in range(len(model.layer_types)))
    # The gather and its scatter-add backward per token, plus the dense [vocab, hidden] gradient each
    # microbatch zeroes and accumulates (shared by the microbatch's tokens).
    embedding = e * (2 * h + 2 * model.vocab_size * h / tokens)
    # Norm; logits matmul; fp32 cross entropy: max, exp-sum and log-softmax forward, softmax - one-hot backward.
    norm = e * 4 * h
    head = norm + 6 * h * model.vocab_size + e * 6 * model.vocab_size
    return LayerCosts(layers, embedding, head, norm, e * 2 * h)


def _block(model, i: int, seq_len: int, device_type: str, e: float) -> float:
    """Layer i: the model's FLOP count (model_zoo.counting, the one count the MFU uses too), plus what the
    device adds on top: the memory-bound element passes, and on the CPU's math path attention's full T keys
    instead of the causal T/2 the count assumes."""
    h = model.hidden_size
    norms_and_residuals = e * (2 * 4 * h + 2 * 2 * h)
    if model.layer_types[i] == "attn":
        extra = _attention_extra(model, seq_len, device_type, e)
    else:
        extra = _gated_deltanet_elementwise(model, e)
    return layer_flops_per_token(model, i, seq_len) + norms_and_residuals + extra + _mlp_elementwise(model, e)


def _attention_extra(model, seq_len: int, device_type: str, e: float) -> float:
    hd, heads = model.head_dim, model.num_heads
    q, kv = heads * hd, model.num_kv_heads * hd
    # Scores and the weighted sum over the keys a query sees: all T on the CPU's math path, T/2 on average
    # with a causal flash kernel (the count's T/2, so the CPU adds the other half); softmax forward and
    # backward over the same scores.
    keys = seq_len if device_type == "cpu" else (seq_len + 1) / 2
    scores_beyond_count = 6 * 2 * heads * hd * (keys - seq_len / 2)
    gate = e * 3 * q if getattr(model, "attn_output_gate", False) else 0.0  # the sigmoid gating
    return scores_beyond_count + e * 5 * heads * keys + e * 4 * (q + kv) + gate  # rotary embedding on q and k


def _gated_deltanet_elementwise(model, e: float) -> float:
    g = model.gdn
    return e * 8 * (2 * g.num_heads * g.head_k_dim + g.num_heads * g.head_v_dim)


def _mlp_elementwise(model, e: float) -> float:
    h, moe = model.hidden_size, model.moe
    if moe is None:
        return e * 6 * model.ffn_hidden_size
    f, shared = moe.expert_ffn_hidden_size, moe.shared_expert_ffn_hidden_size
    # The router's softmax; SwiGLU per routed copy, dispatch and combine; the shared expert's SwiGLU.
    return e * 4 * moe.num_experts + moe.top_k * (e * 6 * f + e * 4 * h) + (e * 6 * shared if shared else 0.0)
