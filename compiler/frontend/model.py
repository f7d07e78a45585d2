"""The Llama family (Llama, Mistral, Qwen2, Qwen3, SmolLM3, Granite, Gemma 2 and 3, OLMo 2, Phi-3, and the
mixture-of-experts Qwen3-MoE, Mixtral and OLMoE) as one plain, stateless torch module.

This is what the compiler traces, not what it runs: a full-sequence forward over one sequence with
explicit positions and no cache. Parameter names equal Hugging Face's Llama names, so a checkpoint's tensors map
onto it 1:1 (Phi-3's fused projections as row ranges: ModelConfig.stored_slices) and `torch.func.functional_call` can feed them in as explicit inputs. The passes later find
RMSNorm, RoPE, attention and SwiGLU in the traced graph and rewrite attention into paged-KV attention;
nothing here knows about the cache.

Numerics follow transformers at fp32: variance in fp32, rotate-half RoPE, repeat_kv for GQA, and
`scaled_dot_product_attention`, causal or with a sliding layer's window mask (one R.nn.attention each
through the import).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig


def rope_inv_freq(config: ModelConfig, theta: float | None = None, long: bool = False) -> torch.Tensor:
    """float32 [rope_dim // 2], computed exactly as transformers' rope init functions do. theta: an unscaled
    RoPE of that base instead (Gemma 3's sliding layers); long: LongRoPE's set for sequences past its original
    length (else its short one)."""
    dim = config.rope_dim
    base = config.rope_theta if theta is None else theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling is None or theta is not None:
        return inv_freq
    if scaling["rope_type"] == "longrope":
        ext = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
        return 1.0 / (ext * base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    if scaling["rope_type"] == "yarn":
        return _yarn_inv_freq(config, factor)
    # llama3: keep high frequencies, divide low ones by factor, interpolate in between.
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1.0 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def _yarn_inv_freq(config: ModelConfig, factor: float) -> torch.Tensor:
    """YaRN: interpolated low frequencies, extrapolated high ones, a linear ramp between (beta_fast/slow)."""
    s, dim, base = config.rope_scaling, config.rope_dim, config.rope_theta
    old_len = s["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(s.get("beta_fast") or 32), correction_dim(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0.0, 1.0)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1.0 - ramp
    return (1.0 / (factor * pos_freqs)) * (1.0 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def attention_scale(config: ModelConfig) -> float:
    """The softmax scale: head_dim^-0.5 (or the config's query_scale), times YaRN's attention factor squared.

    transformers multiplies YaRN's cos and sin by the attention factor, which scales q.k by its square;
    folding that into the softmax scale keeps the rotate-half pattern fuse_rope matches.
    """
    scale = config.head_dim**-0.5 if config.query_scale is None else config.query_scale
    s = config.rope_scaling
    if s is None or s["rope_type"] != "yarn":
        return scale
    factor = s.get("attention_factor")
    if factor is None:

        def mscale(m: float = 1.0) -> float:
            return 1.0 if s["factor"] <= 1 else 0.1 * m * math.log(s["factor"]) + 1.0

        both = s.get("mscale") and s.get("mscale_all_dim")
        factor = mscale(s["mscale"]) / mscale(s["mscale_all_dim"]) if both else mscale()
    return scale * float(factor) ** 2


def softcapped_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, softcap: float, window: int
) -> torch.Tensor:
    """Gemma 2's attention over one sequence ([1, H, T, D] each, causal; window > 0: key j is seen from query i
    when i - window < j <= i): the scores are soft-capped, softcap * tanh(s / softcap), after the scale."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    s = torch.tanh(s / softcap) * softcap
    pos = torch.arange(q.shape[-2], device=q.device)
    delta = pos[:, None] - pos[None, :]
    seen = (delta >= 0) & (delta < window) if window > 0 else delta >= 0
    p = torch.softmax(s.masked_fill(~seen, float("-inf")), dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(p, v)


# One opaque op, so that the trace carries it whole to the Relax import (compiler/export.py), as it carries
# scaled_dot_product_attention; the ONNX export decomposes it into the reference.
softcapped_attention = torch.library.custom_op("llmc::softcapped_attention", mutates_args=())(
    softcapped_attention_reference
)


@softcapped_attention.register_fake
def _(q, k, v, scale, softcap, window):
    return torch.empty_like(q)


def moe_reference(
    x: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k: int, norm_topk: bool
) -> torch.Tensor:
    """A mixture-of-experts MLP over rows x [T, H], as transformers computes it: the router's probabilities
    softmax(x @ router.T) in float32, each token's top_k of them (renormalized to sum 1 with norm_topk), and its
    output the sum of its chosen experts' SwiGLU MLPs weighted by them. router: [E, H]; gate_up: [E * 2I, H],
    expert e's gate rows then its up rows; down: [E * H, I], expert e's rows.

    Every expert runs on every token here, weighted 0 where not chosen: the same sum, in shapes that export to
    ONNX; the kernels run only the chosen ones."""
    experts, hidden = router.shape
    inter = down.shape[1]
    probs = torch.softmax(F.linear(x, router).float(), dim=-1)
    top, chosen = torch.topk(probs, top_k, dim=-1)
    if norm_topk:
        top = top / top.sum(dim=-1, keepdim=True)
    weights = torch.zeros_like(probs).scatter(1, chosen, top).to(x.dtype)  # [T, E]
    out = torch.zeros_like(x)
    for e in range(experts):
        gate, up = F.linear(x, gate_up[2 * inter * e : 2 * inter * (e + 1)]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[hidden * e : hidden * (e + 1)])
        out = out + weights[:, e : e + 1] * y
    return out


# One opaque op, carried whole to the Relax import (compiler/export.py) as llmc.moe; the ONNX export decomposes it
moe = torch.library.custom_op("llmc::moe", mutates_args=())(moe_reference)


@moe.register_fake
def _(x, router, gate_up, down, top_k, norm_topk):
    return torch.empty_like(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, unit_offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.unit_offset = eps, unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:  # Gemma scales in fp32 by 1 + w, then casts
            return ((1.0 + self.weight.float()) * x).to(dtype)
        return self.weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the leading cos.shape[-1] dims of each head; the rest pass (Phi-4-mini's partial)."""
    dim = cos.shape[-1]
    if dim == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rot = x[..., :dim]
    return torch.cat((rot * cos + rotate_half(rot) * sin, x[..., dim:]), dim=-1)


class Attention(nn.Module):
    def __init__(self, c: ModelConfig, window: int, rope: bool = True):
        super().__init__()
        self.c, self.window, self.rope = c, window, rope
        self.q_proj = nn.Linear(c.hidden_size, c.q_size, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.kv_size, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.kv_size, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.q_size, c.hidden_size, bias=c.o_bias)
        if c.qk_norm:
            whole = c.qk_norm_over_heads  # OLMo 2: over the whole projection
            self.q_norm = RMSNorm(c.q_size if whole else c.head_dim, c.rms_norm_eps, c.norm_unit_offset)
            self.k_norm = RMSNorm(c.kv_size if whole else c.head_dim, c.rms_norm_eps, c.norm_unit_offset)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x: [1, T, hidden]; cos, sin: [1, 1, T, head_dim]
        c = self.c
        T = x.shape[1]
        q, k = self.q_proj(x), self.k_proj(x)
        if c.qk_norm and c.qk_norm_over_heads:  # OLMo 2: the whole projection normalized before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.view(1, T, c.num_heads, c.head_dim), k.view(1, T, c.num_kv_heads, c.head_dim)
        if c.qk_norm and not c.qk_norm_over_heads:  # Qwen3, Gemma 3: each head of q and k normalized
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(1, T, c.num_kv_heads, c.head_dim).transpose(1, 2)
        if self.rope:  # SmolLM3's NoPE layers attend without it
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        group = c.num_heads // c.num_kv_heads
        if group > 1:  # repeat_kv, as transformers spells it
            k = k[:, :, None].expand(1, c.num_kv_heads, group, T, c.head_dim).reshape(1, c.num_heads, T, c.head_dim)
            v = v[:, :, None].expand(1, c.num_kv_heads, group, T, c.head_dim).reshape(1, c.num_heads, T, c.head_dim)
        if c.attn_softcap is not None:  # Gemma 2 (positions are 0..T-1 here, as the window mask below assumes too)
            o = softcapped_attention(q, k, v, attention_scale(c), c.attn_softcap, self.window)
        elif self.window:  # key j is seen from query i when p_i - window < p_j <= p_i
            delta = positions[:, None] - positions[None, :]
            mask = (delta >= 0) & (delta < self.window)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attention_scale(c))
        else:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attention_scale(c))
        return self.o_proj(o.transpose(1, 2).reshape(1, T, c.q_size))


class MLP(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.act = F.silu if c.hidden_act == "silu" else lambda g: F.gelu(g, approximate="tanh")
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Expert(nn.Module):
    """One expert's gated MLP, its linears named as the family names them (gate, up, down)."""

    def __init__(self, names: tuple[str, str, str], hidden: int, inter: int):
        super().__init__()
        self.names = names
        for name, (o, i) in zip(names, ((inter, hidden), (inter, hidden), (hidden, inter)), strict=True):
            setattr(self, name, nn.Linear(i, o, bias=False))

    def weights(self) -> list[torch.Tensor]:
        return [getattr(self, n).weight for n in self.names]


class SparseMoE(nn.Module):
    """A router (`gate`) over `experts`: the experts' weights stacked, as the kernels read them, into llmc.moe."""

    def __init__(self, c: ModelConfig, names: tuple[str, str, str]):
        super().__init__()
        self.c = c
        self.gate = nn.Linear(c.hidden_size, c.num_experts, bias=False)
        self.experts = nn.ModuleList(
            Expert(names, c.hidden_size, c.expert_intermediate_size) for _ in range(c.num_experts)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = [e.weights() for e in self.experts]
        gate_up = torch.cat([w for gate, up, _ in weights for w in (gate, up)])
        down = torch.cat([d for _, _, d in weights])
        rows = x.reshape(-1, x.shape[-1])
        out = moe(rows, self.gate.weight, gate_up, down, self.c.experts_per_token, self.c.norm_topk_prob)
        return out.reshape(x.shape)


class DecoderLayer(nn.Module):
    """Pre-norm (Llama); Gemma's sandwich: post_attention_layernorm and post_feedforward_layernorm norm each
    branch before its residual add, and pre_feedforward_layernorm is the MLP's input norm; OLMo 2's post-norm:
    those two branch norms and no input norms."""

    def __init__(self, c: ModelConfig, window: int, rope: bool = True, layer: int = 0):
        super().__init__()
        self.c = c

        def norm():
            return RMSNorm(c.hidden_size, c.rms_norm_eps, c.norm_unit_offset)

        if not c.post_norms:
            self.input_layernorm = norm()
        self.self_attn = Attention(c, window, rope)
        self.post_attention_layernorm = norm()
        if c.sandwich_norms:
            self.pre_feedforward_layernorm = norm()
        if c.sandwich_norms or c.post_norms:
            self.post_feedforward_layernorm = norm()
        self.ffn = "mlp"  # the MLP's name: a sparse one's as the checkpoint names it (Mixtral: block_sparse_moe)
        if layer in c.moe_layers:
            _, experts, names = c.moe_names(layer)
            self.ffn = experts.split(".")[-3]
            setattr(self, self.ffn, SparseMoE(c, names))
        else:
            self.mlp = MLP(c)

    def mlp_branch(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, self.ffn)(x)

    def residual(self, x: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
        r = self.c.residual_scale
        return x + (branch if r == 1.0 else branch * r)  # Granite's residual_multiplier

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.c.post_norms:
            x = self.residual(x, self.post_attention_layernorm(self.self_attn(x, cos, sin, positions)))
            return self.residual(x, self.post_feedforward_layernorm(self.mlp_branch(x)))
        attn = self.self_attn(self.input_layernorm(x), cos, sin, positions)
        if not self.c.sandwich_norms:
            x = self.residual(x, attn)
            return self.residual(x, self.mlp_branch(self.post_attention_layernorm(x)))
        x = self.residual(x, self.post_attention_layernorm(attn))
        return self.residual(x, self.post_feedforward_layernorm(self.mlp_branch(self.pre_feedforward_layernorm(x))))


class Backbone(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(c, c.attention_window(i), i not in c.nope_layers, i) for i in range(c.num_layers)
        )
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, c.norm_unit_offset)


class LlamaFamily(nn.Module):
    """input_ids: [T] int64, positions: [T] int64 -> logits: [T, vocab] (one sequence, causal).

    The graph states every fact the kernels need: the RoPE inverse frequencies are a constant tensor, each
    attention's `scale` is explicit, and a sliding layer's window is its mask (compiler/export.py reads it).
    """

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.config = c
        # A real CPU tensor even when the module is built on meta: the trace captures its values as a constant.
        with torch.device("cpu"):
            self.inv_freq = rope_inv_freq(c)
            local = c.sliding_rope_theta
            self.sliding_inv_freq = None if local is None else rope_inv_freq(c, local)
            longrope = c.rope_scaling is not None and c.rope_scaling["rope_type"] == "longrope"
            self.long_inv_freq = rope_inv_freq(c, long=True) if longrope else None
        self.model = Backbone(c)
        if not c.tie_word_embeddings:
            self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        c = self.config
        x = self.model.embed_tokens(input_ids)[None]  # [1, T, hidden]
        if c.embedding_scale != 1.0:
            x = x * c.embedding_scale

        def rope_tables(inv_freq: torch.Tensor, factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
            # from the positions; inv_freq is a trace-time constant, not a buffer
            freqs = positions.float()[:, None] * inv_freq.to(x.device)[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)[None, None]  # [1, 1, T, rope_dim]
            cos, sin = emb.cos(), emb.sin()
            if factor != 1.0:
                cos, sin = cos * factor, sin * factor
            return cos.to(x.dtype), sin.to(x.dtype)

        if self.long_inv_freq is None:
            tables = rope_tables(self.inv_freq)
        else:  # LongRoPE, as transformers switches it: the long set once the sequence passes the original length
            s = c.rope_scaling
            past = positions.max() + 1 > s["original_max_position_embeddings"]
            inv_freq = torch.where(past, self.long_inv_freq.to(x.device), self.inv_freq.to(x.device))
            tables = rope_tables(inv_freq, s["attention_factor"])
        local = tables if self.sliding_inv_freq is None else rope_tables(self.sliding_inv_freq)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, *(local if i in c.sliding_layers else tables), positions)
        x = self.model.norm(x)
        head = self.model.embed_tokens.weight if c.tie_word_embeddings else self.lm_head.weight
        logits = F.linear(x, head)[0]
        if c.final_softcap is not None:  # Gemma 2
            logits = torch.tanh(logits / c.final_softcap) * c.final_softcap
        return logits if c.logits_scaling == 1.0 else logits / c.logits_scaling
