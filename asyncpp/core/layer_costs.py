"""The forward+backward cost of each piece a pipeline split moves around: a block of each kind, the
embedding, and the LM head with its loss (Megatron's --account-for-embedding-in-pipeline-split and
--account-for-loss-in-pipeline-split, made quantitative).

A deterministic model, not a measurement: every rank computes the same numbers from the model config and
the work shape, so `parallel.stage_layers=auto` needs no collective and the single-process simulator picks
the same split as the pipeline. Units are FLOP-equivalents per token, for one forward and its backward:

- matmuls: 2 FLOPs per multiply-add forward, twice that backward (input and weight gradient): 6 x MACs;
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
    layers = tuple(_block(model, kind, seq_len, device_type, e) for kind in model.layer_types)
    # The gather and its scatter-add backward per token, plus the dense [vocab, hidden] gradient each
    # microbatch zeroes and accumulates (shared by the microbatch's tokens).
    embedding = e * (2 * h + 2 * model.vocab_size * h / tokens)
    # Norm; logits matmul; fp32 cross entropy: max, exp-sum and log-softmax forward, softmax - one-hot backward.
    norm = e * 4 * h
    head = norm + 6 * h * model.vocab_size + e * 6 * model.vocab_size
    return LayerCosts(layers, embedding, head, norm)


def _block(model, kind: str, seq_len: int, device_type: str, e: float) -> float:
    h = model.hidden_size
    norms_and_residuals = e * (2 * 4 * h + 2 * 2 * h)
    mixer = _attention(model, seq_len, device_type, e) if kind == "attn" else _gated_deltanet(model, e)
    return norms_and_residuals + mixer + _mlp(model, e)


def _attention(model, seq_len: int, device_type: str, e: float) -> float:
    h, hd = model.hidden_size, model.head_dim
    q, kv = model.num_heads * hd, model.num_kv_heads * hd
    projections = 6 * h * (2 * q + 2 * kv)  # q, k, v in; out
    if getattr(model, "attn_output_gate", False):  # the sigmoid gate's projection, like q, and the gating
        projections += 6 * h * q + e * 3 * q
    # Scores and the weighted sum over the keys a query sees: all T on the CPU's math path, T/2 on
    # average with a causal flash kernel; softmax forward and backward over the same scores.
    keys = seq_len if device_type == "cpu" else (seq_len + 1) / 2
    scores = 6 * 2 * model.num_heads * hd * keys + e * 5 * model.num_heads * keys
    return projections + scores + e * 4 * (q + kv)  # rotary embedding on q and k


def _gated_deltanet(model, e: float) -> float:
    g, h = model.gdn, model.hidden_size
    dk, dv, heads, chunk = g.head_k_dim, g.head_v_dim, g.num_heads, g.chunk_size
    key, value = heads * dk, heads * dv
    projections = 6 * h * (2 * key + 2 * value + 2 * heads) + 6 * value * h  # q k v g a b in; out
    # Chunked delta rule per token and head: intra-chunk q k^T and its weighted values, the WY/UT
    # transform over the chunk, and reading and updating the dk x dv state.
    recurrence = 6 * heads * (chunk * (dk + dv) + chunk * dk + 2 * dk * dv)
    convolutions = 6 * g.conv_size * (2 * key + value)
    return projections + recurrence + convolutions + e * 8 * (2 * key + value)


def _mlp(model, e: float) -> float:
    h, moe = model.hidden_size, model.moe
    if moe is None:
        return 6 * 3 * h * model.ffn_hidden_size + e * 6 * model.ffn_hidden_size
    f, shared = moe.expert_ffn_hidden_size, moe.shared_expert_ffn_hidden_size
    router = 6 * h * moe.num_experts + e * 4 * moe.num_experts
    experts = moe.top_k * (6 * 3 * h * f + e * 6 * f + e * 4 * h)  # SwiGLU per routed copy, dispatch and combine
    shared_expert = (6 * 3 * h * shared + e * 6 * shared + 6 * h) if shared else 0.0
    return router + experts + shared_expert
