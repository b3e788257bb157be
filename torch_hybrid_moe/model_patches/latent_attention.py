"""DeepSeek's multi-head latent attention (MLA) in decode steps with the key / value up-projection absorbed into the
query and the output.

transformers caches MLA's compressed latent c (kv_lora_rank wide, after its norm) and the shared rotary key, and
every step expands the whole cache through kv_b_proj into per-head keys and values: on the DeepSeek-V2-Lite shape at
256 cached positions that is 256 x 512 x 4,096 multiply-adds a layer, 7.1 of 24.2 ms a decode token in int8
(benchmarks/RESULTS.md, 2026-12-01). The expansion is linear, so it moves onto the one query and the output instead
(the DeepSeek-V2 paper's absorption; llama.cpp does the same): with W_UK[h] and W_UV[h] head h's key and value rows
of kv_b_proj, score_h(t) = (W_UK[h]^T q_h) . c(t) + q_rot_h . k_rot(t) and out_h = W_UV[h] sum_t p_h(t) c(t), an
attention with one key / value head over the cache as stored. The same function in another order: it stays within
float rounding of the expanded form. A decode step runs it as one op, `hybrid_moe::latent_attention`
(ops/latent_attention.py), which reads kv_b_proj's rows in the format the dense layers hold them. Prompts (more than
one query) keep the expanded form, which costs fewer multiply-adds where queries are as many as cached positions, and a
model switched to another attention implementation expands as before.
"""

from __future__ import annotations

import types

import torch

from ..ops.dense_linear import QuantizedLinear
from ..ops.latent_attention import lay_out_key_rows
from ..ops.quantize import QuantizedWeight, dequantize, quantize

# An absorbing module's kv_b_proj as the `hybrid_moe::latent_attention` op reads it (ops/latent_attention.py): the key
# rows of each head transposed, [heads, kv_lora_rank, nope], and the value rows, [heads, v, kv_lora_rank], each with
# its scales (None in a float dtype). The value rows are a view of kv_b_proj's weight (rows, not a copy); the key
# rows a copy, its products then reduce over contiguous memory; as int8 on AVX-512 machines, laid out for the kernel's
# lanes (`lay_out_key_rows`: [heads, kv_lora_rank / 16, nope / 4, 64]).
UP_K = "_hybrid_moe_kv_up_k"
UP_K_SCALE = "_hybrid_moe_kv_up_k_scale"
UP_V = "_hybrid_moe_kv_up_v"
UP_V_SCALE = "_hybrid_moe_kv_up_v_scale"


def is_latent_attention(module: torch.nn.Module) -> bool:
    """Whether `module` is an MLA attention that expands its cached latent in `expand_kv` (DeepSeek-V2 / V3)."""
    return all(hasattr(module, a) for a in ("kv_b_proj", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "expand_kv"))


def absorb(module: torch.nn.Module, attention: str) -> None:
    """Make MLA module `module` hand its cached latent to the attention function named `attention` in decode steps
    (which then calls `absorbed_attention`), where the model runs that implementation."""
    linear = module.kv_b_proj
    nope = int(module.qk_nope_head_dim)
    split = (-1, nope + int(module.v_head_dim))  # kv_b_proj's rows per head: its key rows, then its value rows
    if isinstance(linear, QuantizedLinear):
        linear.hold_row_major()  # its rows are read below, and its value rows by the op
    if isinstance(linear, QuantizedLinear) and nope % 32 == 0:
        # Dense int8 / int4 mode: the value rows are kv_b_proj's own, read as the dense layers' rows are; the key rows,
        # transposed, are requantised to int8 (one more rounding of values on an int8 or int4 grid: int8 keeps it
        # below the first one's).
        q = QuantizedWeight.from_kernel_operands(linear.qweight, linear.scale)
        rows, scales = linear.qweight.unflatten(0, split), linear.scale.unflatten(0, split)
        keys = dequantize(rows[:, :nope], scales[:, :nope], q.bits, q.group_size).transpose(1, 2)
        up_k = quantize(keys.flatten(0, 1).unsqueeze(0), 8, q.group_size if nope % q.group_size == 0 else 32)
        key_rows, key_scales = up_k.data[0].view(keys.shape), up_k.scale[0].unflatten(0, keys.shape[:2])
        # where the kernel's AVX-512 lanes run, laid out for them: the op then takes 0.6x its time with the weights in
        # cache, 0.8x from DRAM (benchmarks/RESULTS.md, 2026-12-02)
        key_rows, key_scales = lay_out_key_rows(key_rows, key_scales) or (key_rows, key_scales)
        buffers = {UP_K: key_rows, UP_K_SCALE: key_scales, UP_V: rows[:, nope:], UP_V_SCALE: scales[:, nope:]}
    else:  # model dtype; or a quantised weight whose key rows the int8 kernels cannot take, dequantised to it
        quantised = isinstance(linear, QuantizedLinear)
        rows = (dequantized(linear, module) if quantised else linear.weight.detach()).unflatten(0, split)
        # The value rows stay a view of kv_b_proj's weight (of a dequantised one a copy: the view would keep its key
        # rows alive); the key rows are a copy (0.2% of DeepSeek-V2-Lite's weights).
        up_v = rows[:, nope:].contiguous() if quantised else rows[:, nope:]
        buffers = {UP_K: rows[:, :nope].transpose(1, 2).contiguous(), UP_K_SCALE: None, UP_V: up_v, UP_V_SCALE: None}
    for name, tensor in buffers.items():
        module.register_buffer(name, tensor, persistent=False)

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
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    out = torch.ops.hybrid_moe.latent_attention(  # ops/latent_attention.py
        query,
        latent,
        k_rot,
        getattr(module, UP_K),
        getattr(module, UP_K_SCALE),
        getattr(module, UP_V),
        getattr(module, UP_V_SCALE),
        attention_mask,
        scale,
    )
    return out, None


def dequantized(linear: QuantizedLinear, module: torch.nn.Module) -> torch.Tensor:
    """A quantised kv_b_proj's weight dequantised to the module's dtype."""
    q = QuantizedWeight.from_kernel_operands(linear.qweight, linear.scale)
    return dequantize(q.data, q.scale, q.bits, q.group_size).to(module.kv_a_layernorm.weight.dtype)


def expanded(module: torch.nn.Module, latent: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-head keys and values of the cached latent, as the model's own `expand_kv` makes them."""
    return type(module).expand_kv(module, latent, k_rot)
