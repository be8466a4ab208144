"""The decoder: embedding -> Blocks -> final norm -> LM head, plus build_model.

Pipeline contract: forward(tokens) == head(layers[n-1](... layers[0](embed_tokens(tokens)))) exactly,
and every Block maps one tensor [B, T, hidden] to one tensor of the same shape, so an engine can
cut `layers` into stages anywhere and ship a single activation between processes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch
from torch import Tensor, nn

from model_zoo.attention import Attention
from model_zoo.config import ModelConfig
from model_zoo.gated_deltanet import GatedDeltaNet
from model_zoo.init import Initializer, KeyedInit, ParamSlice, load_weights_
from model_zoo.layers import RMSNorm, SwiGLU, check_seq_len
from model_zoo.moe import MoE


class Block(nn.Module):
    """Pre-norm residual block: h + mixer(norm(h)), then h + mlp(norm(h)).

    mixer is Attention ("attn") or GatedDeltaNet ("gdn") per config.layer_types[layer_idx];
    mlp is MoE when config.moe is set, else a dense SwiGLU.
    """

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.layer_type = cfg.layer_types[layer_idx]
        self.mixer_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mixer: Attention | GatedDeltaNet
        if self.layer_type == "attn":
            self.mixer = Attention(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                   cfg.rope_theta, cfg.max_seq_len, qk_norm=cfg.qk_norm,
                                   output_gate=cfg.attn_output_gate, rotary_dim=cfg.rotary_dim,
                                   norm_eps=cfg.norm_eps)
        else:
            g = cfg.gdn
            assert g is not None, "validate() guarantees a GDNConfig for 'gdn' layers"
            self.mixer = GatedDeltaNet(cfg.hidden_size, g.num_heads, g.head_k_dim, g.head_v_dim,
                                       conv_size=g.conv_size, norm_eps=cfg.norm_eps, chunk_size=g.chunk_size,
                                       fla_l2norm=g.fla_l2norm)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp: MoE | SwiGLU = (MoE(cfg.hidden_size, cfg.moe) if cfg.moe is not None
                                  else SwiGLU(cfg.hidden_size, cfg.ffn_hidden_size))

    def forward(self, h: Tensor) -> Tensor:
        h = h + self.mixer(self.mixer_norm(h))
        return h + self.mlp(self.mlp_norm(h))

    def init_weights(self, std: float, out_std: float, init: Initializer | None = None) -> None:
        self.mixer_norm.init_weights(init)
        self.mlp_norm.init_weights(init)
        if isinstance(self.mixer, GatedDeltaNet):
            self.mixer.reset_parameters(std, out_std, init)
        else:
            self.mixer.init_weights(std, out_std, init)
        self.mlp.init_weights(std, out_std, init)


class CausalLM(nn.Module):
    """Plain (unparallelised) decoder-only LM. lm_head.weight IS embed.weight when tie_embeddings."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        cfg.validate()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """(Re)share the embedding with the head. Needed again after to_empty(), which gives every
        module its own fresh Parameter and so silently unties them."""
        if self.config.tie_embeddings and hasattr(self, "embed") and hasattr(self, "lm_head"):
            self.lm_head.weight = self.embed.weight

    def embed_tokens(self, tokens: Tensor) -> Tensor:
        """tokens [B, T] int64 -> h [B, T, hidden]."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [batch, seq_len]; got shape {tuple(tokens.shape)}.")
        check_seq_len(tokens.shape[1], self.config.max_seq_len)
        return self.embed(tokens)

    def head(self, h: Tensor) -> Tensor:
        """h [B, T, hidden] -> logits [B, T, vocab] (final norm included)."""
        return self.lm_head(self.norm(h))

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.embed_tokens(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)

    @torch.no_grad()
    def init_weights(self, init: Initializer | None = None) -> None:
        """normal(0, init_std) for linears, experts and embeddings; ones for norms; GDN via its own
        reset_parameters (decay/conv params have their own schemes). With scale_residual_init, the
        projections that write into the residual stream use init_std / sqrt(2 * num_layers)
        (GPT-2 / Megatron), since each of the 2 * num_layers residual branches adds variance.
        Works on a pipeline stage too (layers it does not own are nn.Identity, its ends may be gone).
        `init` defaults to the layout-free KeyedInit of this (whole, unsharded) model seeded by
        torch.initial_seed()."""
        cfg = self.config
        init = init or keyed_init(self, torch.initial_seed())
        std = cfg.init_std
        out_std = std / math.sqrt(2 * cfg.num_layers) if cfg.scale_residual_init else std
        if hasattr(self, "embed"):
            init.normal_(self.embed.weight, std)
        for layer in self.layers:
            if isinstance(layer, Block):
                layer.init_weights(std, out_std, init)
        if hasattr(self, "norm"):
            self.norm.init_weights(init)
        # A tied head is the embedding's Parameter (one stage), or a copy keyed as "embed.weight".
        if hasattr(self, "lm_head") and not (cfg.tie_embeddings and hasattr(self, "embed")):
            init.normal_(self.lm_head.weight, std)

    def moe_layers(self) -> list[MoE]:
        # getattr: a pipeline stage replaces the layers it does not own with nn.Identity.
        return [layer.mlp for layer in self.layers if isinstance(getattr(layer, "mlp", None), MoE)]

    def moe_stats(self, per_layer: bool = False) -> dict[str, float]:
        """Router health from the last forward, for logging ({} for dense models or before a forward).

        moe/aux_loss: mean over MoE layers of the un-weighted load-balancing loss (1.0 = balanced);
        moe/load_max, moe/load_mean: over layers, the max and mean of (busiest expert's tokens /
        mean tokens per expert), i.e. 1.0 = perfectly balanced. With per_layer, also
        moe/layer{i}/load_max_over_mean and moe/layer{i}/aux_loss for every MoE layer i this model
        (or pipeline stage) holds, i being the global layer index. Syncs with the device (.item()).
        """
        layers = [(i, layer.mlp) for i, layer in enumerate(self.layers)
                  if isinstance(getattr(layer, "mlp", None), MoE) and layer.mlp.last_aux_loss is not None]
        if not layers:
            return {}
        aux = torch.stack([m.last_aux_loss.float() for _, m in layers])
        load = torch.stack([m.last_expert_load.float() for _, m in layers])  # [layers, E]
        ratios = load.max(dim=1).values / load.mean(dim=1).clamp(min=1e-9)
        stats = {"moe/aux_loss": aux.mean().item(), "moe/load_max": ratios.max().item(),
                 "moe/load_mean": ratios.mean().item()}
        if per_layer:
            for (i, _), r, a in zip(layers, ratios.tolist(), aux.tolist()):  # one host sync for all layers
                stats[f"moe/layer{i}/load_max_over_mean"] = r
                stats[f"moe/layer{i}/aux_loss"] = a
        return stats


def keyed_init(model: CausalLM, seed: int, slice_of: Callable[[str, Tensor], ParamSlice] | None = None) -> KeyedInit:
    """The layout-free initializer of `model` (whole, or a pipeline stage, possibly sharded: `slice_of`
    says where each local tensor sits in the full model's). A tied head is keyed as the embedding."""
    aliases = {"lm_head.weight": "embed.weight"} if model.config.tie_embeddings else {}
    return KeyedInit.for_model(model, seed, slice_of, aliases)


def materialize(model: CausalLM, device: str | torch.device, seed: int,
                slice_of: Callable[[str, Tensor], ParamSlice] | None = None,
                weights: Mapping[str, Tensor] | None = None) -> CausalLM:
    """Allocate a meta-device model (or stage, or shard of one) on `device` and initialize it: each
    parameter from (seed, its full-model name, global shape, the slice held), model_zoo/init.py; with
    `weights` (full-model tensors by name), each parameter is then its slice of them (init.load_weights_)."""
    model.to_empty(device=torch.device(device))
    model.tie_weights()
    init = keyed_init(model, seed, slice_of)
    model.init_weights(init)
    init.check_complete(model.named_parameters())
    if weights is not None:
        load_weights_(model.named_parameters(remove_duplicate=False), init.slices, weights)
    return model


def build_model(cfg: ModelConfig, device: str | torch.device = "cpu", seed: int | None = None) -> CausalLM:
    """Construct on the meta device (no memory, no init cost), then materialise on `device` and
    initialise. The weights are a function of `seed` alone (default torch.initial_seed(), i.e. what
    torch.manual_seed last set), the same for every device and every parallel layout. device="meta"
    returns the bare skeleton (for counting, or for a stage build that materialises shards itself)."""
    device = torch.device(device)
    with torch.device("meta"):
        model = CausalLM(cfg)
    if device.type == "meta":
        return model
    return materialize(model, device, torch.initial_seed() if seed is None else seed)
