"""What policies learn before a replay, from a calibration trace: routers, residuals, popularity, and past
requests' activation matrices."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import InputError
from ..policies.prefetching import Router, group_limit
from ..traces import Trace

# Where each architecture's checkpoint keeps layer L's router (Mixtral's original name, everyone else's).
_ROUTER_KEYS = ("model.layers.{}.mlp.gate", "model.layers.{}.block_sparse_moe.gate")


def residual_vectors(trace: Trace | str | Path) -> dict[int, torch.Tensor]:
    """DALI's res_vec(l) = mean over rows of (gate input of the next MoE layer - gate input of layer l), from
    the rows whose gate inputs a trace (a `traces.Trace` or its file) kept; keyed by l, the last layer has none.
    Accumulated in float64, returned as float32."""
    if isinstance(trace, (str, Path)):
        trace = Trace.load(trace)
    order = list(trace.layers)
    vectors = {}
    for layer, nxt in zip(order, order[1:]):
        here, there = trace.layers[layer], trace.layers[nxt]
        if here.hidden.shape[0] == 0 or not torch.equal(here.hidden_rows, there.hidden_rows):
            raise ValueError(f"layers {layer} and {nxt}: the trace has no gate inputs of the same rows to calibrate on")
        vectors[layer] = (there.hidden.double() - here.hidden.double()).mean(0).float()
    return vectors


def load_routers(model: str | Path, layers: Sequence[int]) -> dict[int, Router]:
    """The routers of `layers` from a model directory's safetensors (or an embedded model's name), as the
    model's config scores them (sigmoid with bias and group limit for DeepSeek-V3, softmax otherwise)."""
    from ..embedded import resolve_model

    directory = Path(resolve_model(str(model)))
    files = sorted(directory.glob("*.safetensors"))
    if not (directory / "config.json").exists() or not files:
        raise InputError(f"{model}: no model directory with config.json and safetensors weights to read routers from")
    config = json.loads((directory / "config.json").read_text())
    sigmoid = config["model_type"] in ("deepseek_v3",)
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), "pt") as f:
            tensors |= {
                k: f.get_tensor(k) for k in f.keys() if k.endswith((".gate.weight", ".e_score_correction_bias"))
            }
    routers = {}
    for layer in layers:
        prefix = next((p.format(layer) for p in _ROUTER_KEYS if p.format(layer) + ".weight" in tensors), None)
        if prefix is None:
            raise InputError(f"{directory}: no router weight for layer {layer} (looked for {', '.join(_ROUTER_KEYS)})")
        routers[layer] = Router(
            tensors[prefix + ".weight"],
            config["num_experts_per_tok"],
            "sigmoid" if sigmoid else "softmax",
            tensors.get(prefix + ".e_score_correction_bias"),
            **group_limit(config["model_type"], config),
        )
    return routers


class RouterUnavailable(InputError):
    """The traced model's routers cannot be read or do not fit the trace (the gate prefetchers replay them)."""


@dataclass
class Calibration:
    """What policies may learn before serving, from a calibration trace (best another one than the trace
    replayed): per MoE layer its router, DALI's residual to the next layer's gate input, and its popularity
    (tokens per expert); and the calibration requests' activation matrices (MoE-Infinity's collection)."""

    routers: dict[int, Router]
    residuals: dict[int, torch.Tensor]
    popularity: dict[int, list[int]]
    requests: list[torch.Tensor]

    @classmethod
    def from_trace(cls, trace: Trace, calibration: Trace | None = None, model: str | Path | None = None) -> Calibration:
        """Routers of the traced model (`model`, default the trace's model name; none for synthetic traces),
        everything else learnt from `calibration` (default: the trace itself, less the requests it replays)."""
        source = calibration or trace
        if source.meta["num_experts"] != trace.meta["num_experts"] or source.meta["layers"] != trace.meta["layers"]:
            raise InputError(
                f"the calibration trace ({source.meta['model']}: {source.meta['num_experts']} experts, layers "
                f"{source.meta['layers']}) must come from the same model as the trace it calibrates for "
                f"({trace.meta['model']}: {trace.meta['num_experts']} experts, layers {trace.meta['layers']})"
            )
        # routers only where both traces kept gate inputs: the judged trace's replay feeds them its own
        gated = source.gate_inputs and trace.gate_inputs
        try:
            routers = load_routers(model or trace.meta["model"], trace.meta["layers"]) if gated else {}
        except InputError as err:
            raise RouterUnavailable(str(err)) from None
        for idx, router in routers.items():  # checked here, before any stack replays them
            if tuple(router.weight.shape) != (trace.meta["num_experts"], trace.meta["hidden_size"]):
                raise RouterUnavailable(
                    f"the router of layer {idx} is [{router.weight.shape[0]} experts, {router.weight.shape[1]} "
                    f"inputs], the trace's model has {trace.meta['num_experts']} experts and hidden size "
                    f"{trace.meta['hidden_size']}: pass the traced model's routers"
                )
        learnt = cls.learn(source, routers)
        # learnt from the trace replayed, MoE-Infinity's collection would hold each request before it is served (and
        # the ones after it): it starts empty and gathers them as they finish, as a server's would
        return learnt if calibration is not None else replace(learnt, requests=[])

    @classmethod
    def learn(cls, source: Trace, routers: dict[int, Router]) -> Calibration:
        """Everything but the routers (which are the model's weights, not learnt) from the trace `source`."""
        gate_inputs = bool(routers) and source.gate_inputs
        residuals = residual_vectors(source) if gate_inputs else {}
        num_experts = source.meta["num_experts"]
        popularity = {
            idx: torch.bincount(t.topk_ids.long().flatten(), minlength=num_experts).tolist()
            for idx, t in source.layers.items()
        }
        requests = [
            torch.stack(
                [
                    torch.bincount(t.topk_ids[source.sequence == seq].long().flatten(), minlength=num_experts).double()
                    for t in source.layers.values()
                ]
            )
            for seq in sorted(set(source.sequence.tolist()))
        ]
        return cls(routers, residuals, popularity, requests)
