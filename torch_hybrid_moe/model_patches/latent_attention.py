"""DeepSeek's multi-head latent attention (MLA) in decode steps with the key / value up-projection absorbed into the
query and the output.

transformers caches MLA's compressed latent c (kv_lora_rank wide, after its norm) and the shared rotary key, and
every step expands the whole cache through kv_b_proj into per-head keys and values: on the DeepSeek-V2-Lite shape at
256 cached positions that is 256 x 512 x 4,096 multiply-adds a layer, 7.1 of 24.2 ms a decode token in int8
(benchmarks/RESULTS.md, 2026-12-01). The expansion is linear, so it moves onto the one query and the output instead
(the DeepSeek-V2 paper's absorption; llama.cpp does the same): with W_UK[h] and W_UV[h] head h's key and value rows
of kv_b_proj, score_h(t) = (W_UK[h]^T q_h) . c(t) + q_rot_h . k_rot(t) and out_h = W_UV[h] sum_t p_h(t) c(t), an
attention with one key / value head over the cache as stored. The same function in another order: it stays within
float rounding of the expanded form. Prompts (more than one query) keep the expanded form, which costs fewer
multiply-adds where queries are as many as cached positions, and a model switched to another attention
implementation expands as before.
"""

from __future__ import annotations

import types

import torch

from ..ops.dense_linear import QuantizedLinear
from ..ops.quantize import QuantizedWeight, dequantize

# An absorbing module's kv_b_proj as two buffers, each laid out so that its product reduces over contiguous memory
# (a decode step reads them once, from DRAM): the key rows of each head transposed, [heads, kv_lora_rank, nope], and
# the value rows, [heads, v, kv_lora_rank]. The key rows as stored made Inductor's fused product stride a row apart
# for every multiply-add: the absorbed attention took 0.30 ms a layer against 0.22-0.26 (DeepSeek-V2-Lite's shape,
# weights from DRAM: `python benchmarks/decode_layouts.py`, benchmarks/RESULTS.md, 2026-12-01).
UP_K = "_hybrid_moe_kv_up_k"
UP_V = "_hybrid_moe_kv_up_v"


def is_latent_attention(module: torch.nn.Module) -> bool:
    """Whether `module` is an MLA attention that expands its cached latent in `expand_kv` (DeepSeek-V2 / V3)."""
    return all(hasattr(module, a) for a in ("kv_b_proj", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "expand_kv"))


def absorb(module: torch.nn.Module, attention: str) -> None:
    """Make MLA module `module` hand its cached latent to the attention function named `attention` in decode steps
    (which then calls `absorbed_attention`), where the model runs that implementation."""
    linear = module.kv_b_proj
    quantised = isinstance(linear, QuantizedLinear)
    if quantised:  # dense int8 / int4 mode: the small up-projection stays in model dtype
        q = QuantizedWeight.from_kernel_operands(linear.qweight, linear.scale)
        weight = dequantize(q.data, q.scale, q.bits, q.group_size).to(module.kv_a_layernorm.weight.dtype)
    else:
        weight = linear.weight.detach()
    nope = int(module.qk_nope_head_dim)
    per_head = weight.unflatten(0, (-1, nope + int(module.v_head_dim)))
    # The key rows are copied (half of kv_b_proj, 0.2% of DeepSeek-V2-Lite's weights); the value rows, already laid
    # out for their product, stay a view of kv_b_proj's weight, copied only out of a dequantised weight (whose key
    # rows the view would keep alive).
    module.register_buffer(UP_K, per_head[:, :nope].transpose(1, 2).contiguous(), persistent=False)
    values = per_head[:, nope:]
    module.register_buffer(UP_V, values.contiguous() if quantised else values, persistent=False)

    def expand_kv(self: torch.nn.Module, kv_nope: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.config._attn_implementation != attention:
            return expanded(self, kv_nope, k_rot)
        return kv_nope, k_rot  # the latent as "key" and the rotary key as "value": absorbed_attention reads them

    module.expand_kv = types.MethodType(expand_kv, module)


def absorbed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    latent: torch.Tensor,
    k_rot: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
) -> tuple[torch.Tensor, None] | None:
    """Attention of one query [B, H, 1, nope + rot] over the cached latent [B, 1, T, r] and rotary keys
    [B, 1, T, rot] -> ([B, 1, H, v], None); None for more than one query: the caller expands (`expanded`)."""
    if query.shape[2] != 1:
        return None
    nope = module.qk_nope_head_dim
    q_nope, q_rot = query[:, :, 0].split([nope, query.shape[-1] - nope], dim=-1)  # [B, H, *]
    q_latent = torch.bmm(getattr(module, UP_K), q_nope.permute(1, 2, 0)).permute(2, 0, 1)  # [B, H, r]
    c, rot = latent[:, 0], k_rot[:, 0]  # [B, T, r], [B, T, rot]
    scores = torch.baddbmm(torch.bmm(q_latent, c.transpose(1, 2)), q_rot, rot.transpose(1, 2))
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32))  # softmax in fp32 at least
    scores = scores * (query.shape[-1] ** -0.5 if scaling is None else scaling)
    if attention_mask is not None:  # SDPA's: [B | 1, 1, 1, T], boolean (True: attend) or additive
        mask = attention_mask[:, :, 0]
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    # a query that sees no position gets zeros, as the decode op gives (softmax would give NaN)
    probs = torch.softmax(scores, dim=-1).masked_fill(scores.amax(-1, keepdim=True) == float("-inf"), 0.0)
    probs = probs.to(c.dtype)
    out_latent = torch.bmm(probs, c)  # [B, H, r]
    out = torch.bmm(getattr(module, UP_V), out_latent.permute(1, 2, 0))  # [H, v, B]
    return out.permute(2, 0, 1).unsqueeze(1), None


def expanded(module: torch.nn.Module, latent: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-head keys and values of the cached latent, as the model's own `expand_kv` makes them."""
    return type(module).expand_kv(module, latent, k_rot)
