"""The one patching mechanism every architecture uses, parameterised by an `ArchSpec`.

Only the routed experts are replaced: each `*Experts` module keeps its place in the model but its
fused `gate_up_proj` / `down_proj` move into an `ExpertStore`, and transformers' experts registry
sends its forward to `torch.ops.hybrid_moe.dispatch`. Routers, shared experts, shared-expert gates
and dense layers stay the model's own code, so each architecture's routing semantics are untouched.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm
from transformers import CompileConfig
from transformers.integrations.moe import ExpertsInterface

from ..compile_passes.backend import CPU_DECODE_OPTIONS
from ..config import HybridMoEConfig
from ..errors import InputError
from ..ops import cpu_kernel
from ..ops.dense_linear import KERNEL_DTYPES, QuantizedLinear, RoutedLinear
from ..ops.host_memory import gather_on_huge_pages, release_free_heap
from ..ops.quantize import QuantizedWeight, check_group_size, empty_cpu_format, to_cpu_format
from ..policies import LayerInfo
from ..policies.prefetching import Router, group_limit
from ..runtime import ExpertStore, HybridMoELayer
from ..runtime.costs import policy_context, streaming_costs
from ..runtime.decode_graphs import DecodeGraphs
from ..runtime.decode_replay import DecodeReplay
from ..runtime.expert_store import EXPERT_DTYPES, HostWeight, expert_nbytes, laid_out_for_kernel
from ..runtime.layer import RoutingRule
from ..runtime.layer_policies import build_policies
from ..runtime.link_clock import link_for
from .cpu_attention import use_cpu_attention

EXPERTS_IMPLEMENTATION = "hybrid_moe"
_PATCHED_ATTR = "_hybrid_moe_config"


@dataclass(frozen=True)
class ArchSpec:
    """What differs between architectures: the MoE block's class, config names, which layers are sparse."""

    model_type: str
    block_class: str
    num_experts_attr: str
    intermediate_attr: str
    is_moe_layer: Callable[[object, int], bool]
    score_fn: str  # "softmax" or "sigmoid": how router logits become the scores top-k picks from
    renormalises: Callable[[object], bool]  # from the config: are the top-k weights divided by their score sum?
    routing: str  # one line for the docs: how the model's own router picks and weights experts


def hybrid_experts_forward(
    module: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The experts implementation registered as "hybrid_moe" in transformers' ExpertsInterface."""
    out = torch.ops.hybrid_moe.dispatch(hidden_states, top_k_index, top_k_weights, module._hybrid_moe_handle)
    nxt = module._hybrid_moe_next
    # Under torch.compile the backend's prefetch pass inserts this call; eager runs make it here.
    if nxt is not None and not torch.compiler.is_compiling():
        torch.ops.hybrid_moe.prefetch(hidden_states, top_k_index, nxt)
    return out


ExpertsInterface.register(EXPERTS_IMPLEMENTATION, hybrid_experts_forward)


def is_patched(model: torch.nn.Module) -> bool:
    return hasattr(model, _PATCHED_ATTR)


def patch_with_spec(
    model: torch.nn.Module,
    spec: ArchSpec,
    config: HybridMoEConfig | None = None,
    read_experts: Callable[[torch.nn.Module], tuple[HostWeight, HostWeight]] | None = None,
    read_linear: Callable[[torch.nn.Linear], QuantizedWeight | None] | None = None,
    **overrides: object,
) -> torch.nn.Module:
    """Validate everything first, then move experts into stores layer by layer; on error the model is untouched.
    `read_experts(experts)` (loading.py) gives a layer's experts in the host format instead of converting the
    module's own: a model built with uninitialised experts then never holds more than one expert of them.
    `read_linear(linear)` likewise gives a linear's weight already quantised to `dense_weight_dtype` (None: quantise
    the module's own)."""
    config = (config or HybridMoEConfig()).replace(**overrides)
    moe_layers, device, config, dense = check_structure(model, spec, config)
    cfg = model.config.get_text_config()
    first = moe_layers[0][1].experts
    expert_bytes = first.gate_up_proj[0].nbytes + first.down_proj[0].nbytes
    num_experts = first.gate_up_proj.shape[0]
    slots = config.slots_per_layer(num_experts, expert_bytes, len(moe_layers))
    capture = device.type == "cuda" and config.cuda_graph
    _, two_inter, hidden = first.gate_up_proj.shape
    host_bytes = sum(
        expert_nbytes(
            empty_cpu_format((1, *w.shape[1:]), w.dtype, config.cpu_weight_dtype, config.cpu_weight_group_size)
        )
        for w in (first.gate_up_proj, first.down_proj)
    )
    # the prefill staging ring's plan (on CUDA this machine's profile, measured once): now, before any change
    streaming = streaming_costs(config, device.type, hidden, two_inter // 2, host_bytes, expert_bytes)
    ring = 0 if streaming is None else config.staging_slots * expert_bytes  # one ring, shared by every layer
    _check_fits(device, slots * expert_bytes * len(moe_layers) + ring)
    policies = {  # each layer's, built once, before anything changes (one that cannot run fails here)
        idx: build_policies(
            config,
            policy_context(
                config,
                LayerInfo(idx, num_experts, slots, host_bytes, expert_bytes),  # slots: the model's dtype
                hidden,
                two_inter // 2,
                _router(block, spec, cfg),
                link_for(device),
            ),
            capture,
            streaming,
        )
        for idx, block in moe_layers
    }
    routing = RoutingRule(spec.score_fn, bool(spec.renormalises(cfg)))
    # Patched models a caller dropped linger in reference cycles (transformers keeps the compiled call on the
    # model): collect them now, so their layer handles, and with them their compiled graphs, are reused
    # (runtime/registry.py) rather than the model recompiled for new handles.
    gc.collect()

    for idx, block in tqdm(moe_layers, desc="hybrid-moe: placing experts", unit="layer", leave=False):
        experts = block.experts
        dtype = experts.gate_up_proj.dtype
        gate_up, down = (
            read_experts(experts)
            if read_experts
            else (
                to_cpu_format(w, config.cpu_weight_dtype, config.cpu_weight_group_size)
                for w in (experts.gate_up_proj, experts.down_proj)
            )
        )
        if slots == 0:  # every expert computed on the CPU, in the kernel's fastest layout
            gate_up, down = laid_out_for_kernel(gate_up, down)
        store = ExpertStore(gate_up, down, slots, device, slot_dtype=dtype)
        # Drop the module's own copy now, so peak host memory grows by at most one layer.
        del experts.gate_up_proj, experts.down_proj
        experts._hybrid_moe_layer = HybridMoELayer(
            f"layers.{idx}.mlp.experts", idx, store, config, _router(block, spec, cfg), routing, policies[idx]
        )
        experts._hybrid_moe_handle = experts._hybrid_moe_layer.handle
        experts.register_state_dict_post_hook(_experts_from_store)
        experts._hybrid_moe_next = None
        experts.config._experts_implementation = EXPERTS_IMPLEMENTATION
        release_free_heap()  # the layer's read and conversion temporaries: not resident under the next layer
    for (_, block), (_, nxt) in zip(moe_layers, moe_layers[1:]):
        block.experts._hybrid_moe_next = block.experts._hybrid_moe_layer.next_handle = nxt.experts._hybrid_moe_handle
    for parent, name, linear in tqdm(dense, desc="hybrid-moe: routing dense layers", unit="linear", leave=False):
        if config.dense_weight_dtype == "model":
            setattr(parent, name, RoutedLinear(linear))
            continue
        quantized = QuantizedLinear(
            linear,
            config.dense_weight_dtype,
            config.dense_group_size,
            read_linear(linear) if read_linear else None,
        )
        quantized.register_state_dict_post_hook(_refuse_quantized_save)
        setattr(parent, name, quantized)
        release_free_heap()  # its read and quantisation temporaries: otherwise the next linear's come on top
    if device.type == "cpu":
        use_cpu_attention(model)
        release_free_heap()  # the absorbed attention's temporaries, before the gather below adds a slab
        # the small dense weights, read every token; not the input embedding, of which a token reads one row (and which
        # a load leaves mapped in the checkpoint file, so that only rows seen become resident)
        embedding = model.get_input_embeddings().weight
        gather_on_huge_pages(t for t in [*model.parameters(), *model.buffers()] if t is not embedding)
    model.to(device)  # dense weights, attention, routers and shared experts
    _compile_decode_with_backend(model, capture, device.type == "cpu")
    _refuse_saves_before_writing(model)
    setattr(model, _PATCHED_ATTR, config)
    return model


def _refuse_saves_before_writing(model: torch.nn.Module) -> None:
    """`save_pretrained` builds the state dict, whose hooks refuse a save that would write altered weights, before
    it writes anything: transformers writes config.json first, which over an existing checkpoint would pair a new
    config with the old weights."""
    save = model.save_pretrained

    @functools.wraps(save)
    def save_pretrained(*args: object, **kwargs: object) -> object:
        model.state_dict()  # raises here, with nothing written, where a hook refuses
        return save(*args, **kwargs)

    model.save_pretrained = save_pretrained


def check_structure(
    model: torch.nn.Module, spec: ArchSpec, config: HybridMoEConfig
) -> tuple[
    list[tuple[int, torch.nn.Module]], torch.device, HybridMoEConfig, list[tuple[torch.nn.Module, str, torch.nn.Linear]]
]:
    """Every check of `config` against the model that needs its structure and shapes, not its weights' values:
    `from_pretrained` runs it before reading any weight, `patch_with_spec` before any change. Gives the MoE layers,
    the device, the config made concrete for it, and the dense linears patching replaces."""
    if is_patched(model):
        raise RuntimeError("this model is already patched by torch_hybrid_moe; patch a fresh model instead")
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type != spec.model_type:
        raise ValueError(f"patch for {spec.model_type!r} models called on a {model_type!r} model")
    cfg = model.config.get_text_config()
    moe_layers = _find_moe_layers(model, spec, cfg)
    device = config.resolve_device()
    config = config.for_device(device)
    _check_cpu_format(config, moe_layers[0][1].experts)
    dense = dense_linears(model, config, device)
    config.check_top_k(cfg.num_experts_per_tok)  # Expert Deferral keeps at least one immediate expert
    check_precalc_start(config, [idx for idx, _ in moe_layers])
    return moe_layers, device, config, dense


def _experts_from_store(module: torch.nn.Module, state: dict, prefix: str, metadata: object) -> None:
    """Put the routed experts back into a patched model's state dict (so `save_pretrained` writes a complete
    model), exactly as loaded: from the host master when it holds the model's own dtype; refused otherwise,
    since a quantised or down-cast master no longer holds the original weights."""
    layer = module._hybrid_moe_layer
    store = layer.store
    for name, host in (("gate_up_proj", store.host_gate_up), ("down_proj", store.host_down)):
        if not isinstance(host, torch.Tensor) or host.dtype != store.slot_gate_up.dtype:
            raise RuntimeError(
                f"{layer.name}: the experts' host copy is {layer.config.cpu_weight_dtype}, not the model's "
                f"{store.slot_gate_up.dtype}, so the original weights are gone and saving would write altered "
                "experts; save the unpatched model (patch with cpu_weight_dtype='model' to keep them), or write the "
                "quantised store with thm.prepare / hybrid-moe prepare"
            )
        state[prefix + name] = host


def dense_linears(
    model: torch.nn.Module, config: HybridMoEConfig, device: torch.device
) -> list[tuple[torch.nn.Module, str, torch.nn.Linear]]:
    """(parent, attribute, module) of every linear patching replaces, checked before any change: each one that
    `dense_weight_dtype` int8 / int4 quantises; with "model", on the CPU, the bf16 / fp16 ones, which get this
    machine's measured routes (RoutedLinear). Accelerators keep theirs as loaded."""
    found = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is torch.nn.Linear
    ]
    if config.dense_weight_dtype == "model":
        routed = device.type == "cpu" and cpu_kernel.best_isa() >= 0
        return [entry for entry in found if routed and entry[2].weight.dtype in KERNEL_DTYPES]
    if device.type != "cpu":
        raise InputError(
            f"dense_weight_dtype={config.dense_weight_dtype!r} quantises the CPU's dense layers; on "
            f"{device} they run on the accelerator as loaded (use dense_weight_dtype='model')"
        )
    for _, name, linear in found:
        try:
            check_group_size(linear.in_features, config.dense_group_size, options="dense_weight")
        except ValueError as err:
            raise InputError(
                f"dense_weight_dtype={config.dense_weight_dtype!r}: linear {name!r} "
                f"({linear.in_features} inputs): {err}"
            ) from None
    return found


def _refuse_quantized_save(module: torch.nn.Module, state: dict, prefix: str, metadata: object) -> None:
    raise RuntimeError(
        f"{prefix.rstrip('.')}: dense_weight_dtype={module.fmt!r} quantised this linear, so its "
        "original weight is gone and saving would write altered weights; save the unpatched model"
    )


def make_patch_function(spec: ArchSpec) -> Callable[..., torch.nn.Module]:
    def patch(model: torch.nn.Module, config: HybridMoEConfig | None = None, **overrides: object) -> torch.nn.Module:
        return patch_with_spec(model, spec, config, **overrides)

    patch.__name__ = f"patch_{spec.model_type}"
    patch.__doc__ = (
        f"Patch a transformers {spec.model_type!r} model for hybrid expert placement, in place.\n\n"
        f"Routing stays the model's own: {spec.routing}"
    )
    return patch


def _router(block: torch.nn.Module, spec: ArchSpec, cfg: object) -> Router:
    """The block's gate as prefetchers replay it on other hidden states (the same rule as the simulator's)."""
    return Router(
        block.gate.weight.detach(),
        cfg.num_experts_per_tok,
        spec.score_fn,
        getattr(block.gate, "e_score_correction_bias", None),
        **group_limit(spec.model_type, {k: getattr(cfg, k, None) for k in ("topk_method", "n_group", "topk_group")}),
    )


def moe_layer_indices(model: torch.nn.Module) -> list[int]:
    """The decoder blocks of `model` (a supported architecture) whose MLP is an MoE block, by its config."""
    from . import ARCHITECTURES

    cfg = model.config.get_text_config()
    spec = ARCHITECTURES[model.config.model_type]
    return [idx for idx in range(cfg.num_hidden_layers) if spec.is_moe_layer(cfg, idx)]


def check_precalc_start(config: HybridMoEConfig, moe_indices: list[int]) -> None:
    """DAOP's pre-calculation predicts MoE layers from `precalc_from_layer` on, each from an MoE layer before it:
    refuse a start that leaves nothing to approximate."""
    if config.mode == "daop_precalc" and (len(moe_indices) < 2 or config.precalc_from_layer > moe_indices[-1]):
        raise InputError(
            f"precalc_from_layer={config.precalc_from_layer} approximates nothing in this model: its last MoE layer "
            f"is decoder block {moe_indices[-1] if moe_indices else None} and a predicted layer needs an MoE layer "
            "before it"
        )


def _find_moe_layers(model: torch.nn.Module, spec: ArchSpec, cfg: object) -> list[tuple[int, torch.nn.Module]]:
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    found = []
    for idx, layer in enumerate(decoder.layers):
        block = layer.mlp
        sparse = type(block).__name__ == spec.block_class
        if sparse != spec.is_moe_layer(cfg, idx):
            raise ValueError(
                f"layer {idx} is {'an MoE' if sparse else 'a dense'} layer ({type(block).__name__}) "
                f"but the config says it should be {'dense' if sparse else 'MoE'}"
            )
        if sparse:
            _check_experts(idx, block.experts, spec, cfg)
            found.append((idx, block))
    if not found:
        raise ValueError(f"no {spec.block_class} layer found: nothing to patch")
    first_idx, first = found[0][0], found[0][1].experts.gate_up_proj.dtype
    for idx, block in found:
        for name in ("gate_up_proj", "down_proj"):
            dtype = getattr(block.experts, name).dtype
            if dtype != first:
                raise TypeError(
                    f"layer {idx}: experts.{name} is {dtype} but layer {first_idx}'s experts.gate_up_proj is {first}: "
                    "all routed experts must share one dtype (cast the model first, e.g. model.to(torch.bfloat16))"
                )
    return found


def _check_experts(idx: int, experts: torch.nn.Module, spec: ArchSpec, cfg: object) -> None:
    num_experts = getattr(cfg, spec.num_experts_attr)
    inter = getattr(cfg, spec.intermediate_attr)
    hidden = cfg.hidden_size
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor):
        raise ValueError(f"layer {idx}: experts module has no fused gate_up_proj/down_proj tensors")
    want = {"gate_up_proj": (num_experts, 2 * inter, hidden), "down_proj": (num_experts, hidden, inter)}
    for name, tensor in (("gate_up_proj", gate_up), ("down_proj", down)):
        if tuple(tensor.shape) != want[name]:
            raise ValueError(
                f"layer {idx}: experts.{name} has shape {tuple(tensor.shape)} but the config implies {want[name]} "
                f"({spec.num_experts_attr}={num_experts}, {spec.intermediate_attr}={inter}, hidden_size={hidden})"
            )
        if tensor.dtype not in EXPERT_DTYPES:
            raise TypeError(
                f"layer {idx}: experts.{name} has dtype {tensor.dtype}; supported: "
                f"{', '.join(str(d) for d in EXPERT_DTYPES)}"
            )
        if tensor.device.type == "meta":
            raise ValueError(f"layer {idx}: experts.{name} is on the meta device; load real weights first")
    act = getattr(getattr(experts, "act_fn", None), "__class__", type(None)).__name__
    if "SiLU" not in act:
        raise ValueError(f"layer {idx}: experts use activation {act}; only SiLU-gated experts are supported")


def _check_cpu_format(config: HybridMoEConfig, experts: torch.nn.Module) -> None:
    """Quantised CPU weights need group sizes that fit both projections' column counts: checked before anything
    changes."""
    if config.cpu_weight_dtype in ("int8", "int4"):
        for name in ("gate_up_proj", "down_proj"):
            try:
                check_group_size(getattr(experts, name).shape[-1], config.cpu_weight_group_size)
            except ValueError as err:
                raise InputError(f"cpu_weight_dtype={config.cpu_weight_dtype!r}: experts.{name}: {err}") from None


def _check_fits(device: torch.device, slot_bytes: int) -> None:
    if device.type != "cuda":
        return
    free, _ = torch.cuda.mem_get_info(device)
    if slot_bytes > free:
        raise InputError(
            f"expert slots (and the prefill staging ring) need {slot_bytes / 2**30:.2f} GiB but only "
            f"{free / 2**30:.2f} GiB of {device} is free; lower expert_budget (or staging_slots)"
        )


def _replayed_call(model: torch.nn.Module) -> Callable[[object], DecodeReplay]:
    """The model's `get_compiled_call`, which `generate()` calls once per call: a fresh `DecodeReplay` around the
    compiled forward each time, so no two calls (or threads) share replay state."""
    method = type(model).get_compiled_call

    def get_compiled_call(compile_config: object) -> DecodeReplay:
        return DecodeReplay(model, method(model, compile_config))

    return get_compiled_call


def _compile_decode_with_backend(model: torch.nn.Module, capture: bool, on_cpu: bool) -> None:
    """Make plain `generate()` use a static cache and compile its decode step with `backend="hybrid_moe"` (on the
    CPU with its wrapper in C++); with `capture`, each decode step then runs as one CUDA graph
    (runtime/decode_graphs.py), otherwise past Dynamo once its steps agree (runtime/decode_replay.py)."""
    gen = getattr(model, "generation_config", None)
    if gen is None:
        return
    gen.cache_implementation = "static"
    compile_config = (  # torch.compile takes a mode or options, not both
        CompileConfig(fullgraph=True, backend="hybrid_moe", mode=None, options=dict(CPU_DECODE_OPTIONS))
        if on_cpu
        else CompileConfig(fullgraph=True, backend="hybrid_moe", mode="default")
    )
    compile_config._compile_all_devices = True  # transformers auto-compiles on CUDA only unless told
    gen.compile_config = compile_config
    if capture:
        model.get_compiled_call = DecodeGraphs(model).get_compiled_call
    else:
        model.get_compiled_call = _replayed_call(model)
