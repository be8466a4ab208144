"""Typed model configs. Validated once, early; every error names the field, the value and the fix."""

from __future__ import annotations

from dataclasses import dataclass, field

LAYER_TYPES = ("attn", "gdn")


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """Routed-expert MLP used in every layer of a MoE model (there are no dense MLP layers)."""

    num_experts: int
    top_k: int
    expert_ffn_hidden_size: int
    shared_expert_ffn_hidden_size: int = 0
    """SwiGLU width of the always-on shared expert; 0 means no shared expert."""
    aux_loss_coef: float = 0.01
    """Weight of the Switch load-balancing loss (1.0 when perfectly balanced) added to the LM loss gradient."""
    normalize_topk: bool = True
    """Renormalise the top-k router probabilities to sum to 1 per token (Qwen3 / Mixtral style)."""
    bias_update_rate: float = 0.0
    """Auxiliary-loss-free balancing (DeepSeek-V3): > 0 adds a per-expert bias to the router scores for
    top-k selection only, moved by this much per step towards equal load; 0 disables it."""

    def validate(self) -> None:
        _positive("model.moe.num_experts", self.num_experts)
        _positive("model.moe.expert_ffn_hidden_size", self.expert_ffn_hidden_size)
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"model.moe.top_k={self.top_k} must be in [1, num_experts={self.num_experts}]; "
                "lower top_k or raise num_experts."
            )
        if self.shared_expert_ffn_hidden_size < 0:
            raise ValueError(
                f"model.moe.shared_expert_ffn_hidden_size={self.shared_expert_ffn_hidden_size} is negative; "
                "use 0 for no shared expert."
            )
        if self.aux_loss_coef < 0:
            raise ValueError(f"model.moe.aux_loss_coef={self.aux_loss_coef} is negative; use >= 0 (0 disables).")
        if self.bias_update_rate < 0:
            raise ValueError(
                f"model.moe.bias_update_rate={self.bias_update_rate} is negative; use >= 0 "
                "(0 disables aux-loss-free balancing; DeepSeek-V3 uses 1e-3)."
            )


@dataclass(frozen=True, kw_only=True)
class GDNConfig:
    """Gated DeltaNet (linear attention) mixer used by layers whose layer_types entry is "gdn"."""

    num_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_size: int = 4
    chunk_size: int = 64
    fla_l2norm: bool = False
    """L2-normalise q and k as FLA's kernels and HF Qwen3-Next do, x * rsqrt(sum(x^2) + 1e-6), instead of
    F.normalize's x / max(|x|, 1e-6); they differ where |x|^2 is not far above 1e-6 (small-init projections)."""

    def validate(self) -> None:
        for name in ("num_heads", "head_k_dim", "head_v_dim", "conv_size", "chunk_size"):
            _positive(f"model.gdn.{name}", getattr(self, name))


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A decoder-only LM: pre-norm blocks of (attention | Gated DeltaNet) + (SwiGLU | MoE).

    hidden_size may differ from num_heads * head_dim (attention projects in and out).
    """

    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    """Dense SwiGLU width; unused (conventionally 0) when moe is set."""
    max_seq_len: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    scale_residual_init: bool = True
    """Megatron convention: output projections (attention out, MLP down, experts' down) get
    init_std / sqrt(2 * num_layers) so the residual stream's variance does not grow with depth.
    HF SmolLM2 initialises them with plain init_std; set False to match it."""
    qk_norm: bool = False
    """RMSNorm over each attention head's q and k before RoPE (Qwen3, Qwen3-MoE, Qwen3-Next). Off in the
    paper's configs (docs/hf.md says why)."""
    attn_output_gate: bool = False
    """Gated attention (Qwen3-Next): the attention output is multiplied by sigmoid(x W_gate), one gate per
    channel of every head, before o_proj."""
    partial_rotary_factor: float = 1.0
    """RoPE rotates the first int(head_dim * factor) channels of each head; the rest carry no position
    (Qwen3-Next: 0.25). 1.0 is full rotary."""
    layer_types: tuple[str, ...] = field(default=())
    """One entry per layer, "attn" or "gdn". Empty means all "attn"."""
    moe: MoEConfig | None = None
    gdn: GDNConfig | None = None

    def __post_init__(self) -> None:
        # Frozen dataclass: object.__setattr__ is the documented way to fill derived defaults.
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("attn",) * max(self.num_layers, 0))
        else:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))

    @property
    def rotary_dim(self) -> int:
        """Channels of each head that RoPE rotates (HF's int(head_dim * partial_rotary_factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

    def validate(self) -> ModelConfig:
        """Raise ValueError on the first inconsistency; returns self so calls can be chained."""
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_seq_len"):
            _positive(f"model.{name}", getattr(self, name))
        for name in ("rope_theta", "norm_eps", "init_std"):
            if not getattr(self, name) > 0:
                raise ValueError(f"model.{name}={getattr(self, name)} must be > 0.")
        if self.num_heads % self.num_kv_heads:
            divisors = [d for d in range(1, self.num_heads + 1) if self.num_heads % d == 0]
            raise ValueError(
                f"model.num_heads={self.num_heads} is not divisible by model.num_kv_heads={self.num_kv_heads} "
                f"(grouped-query attention shares each KV head by a whole group); choose num_kv_heads in {divisors}."
            )
        if self.head_dim % 2:
            raise ValueError(f"model.head_dim={self.head_dim} must be even for rotary embeddings; use e.g. 64.")
        self._validate_rotary()
        self._validate_layer_types()
        if self.moe is None and self.ffn_hidden_size <= 0:
            raise ValueError(
                f"model.ffn_hidden_size={self.ffn_hidden_size} must be > 0 for a dense model (moe is None); "
                "set it, e.g. to 8/3 * hidden_size rounded to 64, or set model.moe."
            )
        if self.moe is not None:
            self.moe.validate()
        if self.gdn is not None:
            self.gdn.validate()
        return self

    def _validate_rotary(self) -> None:
        f = self.partial_rotary_factor
        if not (isinstance(f, (int, float)) and 0 < f <= 1):
            raise ValueError(f"model.partial_rotary_factor={f!r} must be in (0, 1]; use 1.0 for full rotary "
                             "or e.g. 0.25 (Qwen3-Next).")
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ValueError(
                f"model.partial_rotary_factor={f} rotates int({self.head_dim} * {f}) = {self.rotary_dim} channels "
                f"of model.head_dim={self.head_dim}; RoPE needs an even number >= 2: choose a factor that "
                f"gives one, e.g. {2 * max(1, round(self.head_dim * f / 2)) / self.head_dim:g}."
            )
        for name in ("qk_norm", "attn_output_gate"):
            if type(getattr(self, name)) is not bool:
                raise ValueError(f"model.{name}={getattr(self, name)!r} must be true or false.")

    def _validate_layer_types(self) -> None:
        if len(self.layer_types) != self.num_layers:
            raise ValueError(
                f"model.layer_types has {len(self.layer_types)} entries but model.num_layers={self.num_layers}; "
                "give exactly one 'attn' or 'gdn' per layer."
            )
        bad = sorted({t for t in self.layer_types if t not in LAYER_TYPES})
        if bad:
            raise ValueError(f"model.layer_types contains {bad}; each entry must be one of {LAYER_TYPES}.")
        if "gdn" in self.layer_types and self.gdn is None:
            raise ValueError(
                "model.layer_types contains 'gdn' but model.gdn is None; set model.gdn (a GDNConfig) "
                "or use only 'attn' layers."
            )


def _positive(name: str, value: int) -> None:
    if not (isinstance(value, int) and value > 0):
        raise ValueError(f"{name}={value!r} must be a positive integer.")
