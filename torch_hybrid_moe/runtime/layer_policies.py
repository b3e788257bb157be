"""One MoE layer's policies, built once from the config's names: by the patching step, before it changes anything,
and handed to the layer (whose replay-safe path derives their tensor forms from the same objects)."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import AUTO, HybridMoEConfig
from ..cost_model import CostModel
from ..policies import CACHE_POLICIES, PREFETCHERS, SCHEDULERS, CachePolicy, Prefetcher, Scheduler
from .link_clock import CopyTimeline


@dataclass(frozen=True)
class LayerPolicies:
    scheduler: Scheduler
    cache_policy: CachePolicy
    prefetcher: Prefetcher
    streaming: CostModel | None = None  # what plans prefill streaming (runtime.costs.streaming_costs); None: none
    timeline: CopyTimeline | None = None  # the link the policies see, which the store's copies advance; None: idle


def build_policies(
    config: HybridMoEConfig, context: dict[str, object], capture: bool, streaming: CostModel | None = None
) -> LayerPolicies:
    """The layer's scheduler, cache policy and prefetcher from what it offers them (`runtime.costs.policy_context`).
    One that cannot run live (a cost-aware scheduler without `hardware=`) fails here, and so, with `capture` (decode
    steps captured as CUDA graphs), does one without a tensor form. `config` is the one made concrete for the
    slots' device (`HybridMoEConfig.for_device`)."""
    if AUTO in (config.scheduler, config.cache_policy):
        raise ValueError("build_policies needs a concrete stack: pass config.for_device(device), not an 'auto' one")
    policies = LayerPolicies(
        SCHEDULERS.create(config.scheduler, **context),
        CACHE_POLICIES.create(config.cache_policy, **context, **dict(config.cache_options)),
        PREFETCHERS.create(config.prefetcher, **context),
        streaming,
        timeline if isinstance(timeline := context.get("timeline"), CopyTimeline) else None,
    )
    if capture:
        for registry, name in (
            (SCHEDULERS, config.scheduler),
            (CACHE_POLICIES, config.cache_policy),
            (PREFETCHERS, config.prefetcher),
        ):
            registry.tensor_form(name)
    return policies
