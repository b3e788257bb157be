"""What live layers hand their policies: the cost model cost-aware schedulers weigh placements with
(`HybridMoEConfig.hardware`), and the link's state as they may see it."""

from __future__ import annotations

import functools

from ..config import HybridMoEConfig
from ..cost_model import EXPERT_SHAPES, HARDWARE, CostModel, ExpertShape
from ..policies import IdleLink, LayerInfo, Timeline
from ..policies.prefetching import Router
from .link_clock import CopyTimeline, LinkClock


@functools.cache
def _local_model(shape: ExpertShape) -> CostModel:
    from ..profiling import profile_hardware  # measures once per machine and shape, then reads its disk cache

    return profile_hardware(shape, progress=True).cost_model()  # measuring takes a while: say so


def live_costs(
    config: HybridMoEConfig,
    hidden: int,
    inter: int,
    expert_bytes: int,
    hardware: str | None = None,
    slot_bytes: int = 0,
) -> CostModel | None:
    """The configured cost model (or `hardware`'s) for experts of this size (or of `config.expert_shape`), `slot_bytes`
    each in a slot (0: as on the host); None without one."""
    hardware = config.hardware if hardware is None else hardware
    if not hardware:
        return None
    weights = 3 * hidden * inter
    own = ExpertShape(
        "model", hidden, inter, expert_bytes / weights, slot_bytes_per_weight=slot_bytes / weights or None
    )
    shape = EXPERT_SHAPES.get(config.expert_shape, own)
    return _local_model(shape) if hardware == "local" else CostModel(HARDWARE[hardware], shape)


def streaming_costs(
    config: HybridMoEConfig, device_type: str, hidden: int, inter: int, expert_bytes: int, slot_bytes: int = 0
) -> CostModel | None:
    """The cost model a prefill step's staging ring plans with, on CUDA: the configured one, else this machine's
    measured profile; None (no streaming) with no buffers, or where the accelerator is the CPU itself (a copy
    into CPU buffers gains nothing there)."""
    if not config.staging_slots or device_type != "cuda":
        return None
    return live_costs(config, hidden, inter, expert_bytes, config.hardware or "local", slot_bytes)


def policy_context(
    config: HybridMoEConfig,
    info: LayerInfo,
    hidden: int,
    inter: int,
    router: Router | None = None,
    link: LinkClock | None = None,
) -> dict[str, object]:
    """Everything a live layer offers its policies (`Registry.create` passes each the keys it names): its
    own router is what gate-based prefetchers apply to the previous layer's hidden states; `size` (only
    prefetchers take it) is offered only when set, so that each prefetcher otherwise keeps its own default. The
    timeline is the layer's view of `link`, the model's asynchronous copies (CUDA), timed by the cost model;
    without either, an idle link."""
    sized = {"size": config.prefetch_size} if config.prefetch_size else {}
    costs = live_costs(config, hidden, inter, info.expert_bytes, slot_bytes=info.slot_bytes)
    timeline: Timeline = (
        IdleLink() if link is None or costs is None else CopyTimeline(link, costs.t_transfer(), info.num_experts)
    )
    return {"info": info, "costs": costs, "timeline": timeline, "router": router, **sized}
