"""A Llama-family model (Llama, Mistral, Qwen2, Qwen3, SmolLM3: ARCHITECTURES) in plain torch with a static KV cache, written the way gpt-fast
writes it, so that `torch.compile(mode="max-autotune")` can take the whole step: the peer that
benchmarks/gpu_check.py times beside llmc on the same weights. tests/test_torch_llama.py checks it against
transformers.

The cache holds `max_seq` positions per sequence and every step attends over all of them under a mask (as
gpt-fast does): a decode step reads the whole static cache, not only the positions written so far. RoPE comes
from transformers' own rotary embedding (rope_scaling included); the shapes and windows from llmc's parse of
the same config.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from llmc.compiler.frontend.config import parse_config


def _load(checkpoint: Path) -> dict[str, torch.Tensor]:
    index = checkpoint / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["model.safetensors"]
    )
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(load_file(str(checkpoint / name)))
    return tensors


ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "SmolLM3ForCausalLM")


class TorchLlama(torch.nn.Module):
    """forward(ids [B, T], pos [T]) -> logits [B, vocab] at each sequence's last position; the B sequences of
    a step sit at the same positions pos (a prefill chunk, or one decode token each)."""

    def __init__(
        self,
        checkpoint: str | Path,
        *,
        dtype=torch.float32,
        weight_dtype=None,
        device="cpu",
        max_seq: int = 256,
        batch: int = 1,
    ):
        """weight_dtype: round the weights through it first (fp32 arithmetic over bf16 weights: a reference
        for a bf16 build); dtype: what the model computes and caches in."""
        super().__init__()
        checkpoint = Path(checkpoint)
        hf_config = AutoConfig.from_pretrained(checkpoint)
        self.cfg = c = parse_config(hf_config.to_dict())
        if c.architecture not in ARCHITECTURES:
            raise ValueError(f"the torch peer computes {', '.join(ARCHITECTURES)}, not {c.architecture}")
        self.rotary = LlamaRotaryEmbedding(config=hf_config).to(device)
        w = {k: v.to(device=device, dtype=weight_dtype or dtype).to(dtype) for k, v in _load(checkpoint).items()}
        self.w = w
        if "lm_head.weight" not in w:
            w["lm_head.weight"] = w["model.embed_tokens.weight"]
        shape = (c.num_layers, batch, c.num_kv_heads, max_seq, c.head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("key_pos", torch.arange(max_seq, device=device), persistent=False)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps)
        return weight * h.to(x.dtype)

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.w[f"{name}.weight"], self.w.get(f"{name}.bias"))

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        b, t = ids.shape
        x = F.embedding(ids, self.w["model.embed_tokens.weight"])
        cos, sin = self.rotary(x, pos[None].expand(b, t))
        cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)  # [B, 1, T, D]
        for layer in range(c.num_layers):
            p = f"model.layers.{layer}"
            h = self._norm(x, self.w[f"{p}.input_layernorm.weight"])
            q = self._linear(h, f"{p}.self_attn.q_proj").view(b, t, c.num_heads, c.head_dim)
            k = self._linear(h, f"{p}.self_attn.k_proj").view(b, t, c.num_kv_heads, c.head_dim)
            if c.qk_norm:  # Qwen3: each head of q and k, before RoPE
                q, k = (
                    self._norm(q, self.w[f"{p}.self_attn.q_norm.weight"]),
                    self._norm(k, self.w[f"{p}.self_attn.k_norm.weight"]),
                )
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            v = self._linear(h, f"{p}.self_attn.v_proj").view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
            if layer not in c.nope_layers:  # SmolLM3's NoPE layers attend without RoPE
                q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            self.k_cache[layer][:, :, pos] = k
            self.v_cache[layer][:, :, pos] = v
            visible = self.key_pos[None, :] <= pos[:, None]  # [T, max_seq]
            if window := c.attention_window(layer):
                visible = visible & (self.key_pos[None, :] > pos[:, None] - window)
            attn = F.scaled_dot_product_attention(
                q, self.k_cache[layer], self.v_cache[layer], attn_mask=visible, enable_gqa=True
            )
            x = x + self._linear(attn.transpose(1, 2).reshape(b, t, c.q_size), f"{p}.self_attn.o_proj")
            h = self._norm(x, self.w[f"{p}.post_attention_layernorm.weight"])
            gate, up = self._linear(h, f"{p}.mlp.gate_proj"), self._linear(h, f"{p}.mlp.up_proj")
            x = x + self._linear(F.silu(gate) * up, f"{p}.mlp.down_proj")
        x = self._norm(x[:, -1], self.w["model.norm.weight"])
        return F.linear(x, self.w["lm_head.weight"]).float()
