"""Which Qwen-MoE layers are sparse: shared by Qwen2-MoE and Qwen3-MoE."""


def is_qwen_moe_layer(cfg: object, idx: int) -> bool:
    return idx not in cfg.mlp_only_layers and cfg.num_experts > 0 and (idx + 1) % cfg.decoder_sparse_step == 0
