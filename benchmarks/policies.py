"""Issue 5's scoreboard: every paper's stack, ours (tuned on a calibration trace) and the oracle, on the
embedded models' traces and one hardware preset; plus DALI's greedy against the exact optimum and the papers'
qualitative claims (cache hit-rate order, residual vs plain-gate prefetch accuracy).

    python benchmarks/policies.py [--hardware dali] [--batches 1 16] [--ratios 0.25 0.5] [--json FILE]

Ours is tuned on the `-at512` trace and judged on the `-at0` trace (different prompts of the held-out text);
all policies calibrate (routers, residuals, popularity, past requests) on `-at512` as well. Two approximate
rows, kept out of the exact ranking, add KTransformers' Expert Deferral (decode, max(1, top-k - 2) experts of
each token deferred, as `hybrid-moe eval-ppl --mode expert_deferral` defaults) to KTransformers' stack and ours.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace
from pathlib import Path

from torch_hybrid_moe.cli import bounded, writable
from torch_hybrid_moe.cost_model import EXPERT_SHAPES, HARDWARE, CostModel
from torch_hybrid_moe.policies.schedulers import SCHEDULERS, DaliGreedy, Optimal, makespan
from torch_hybrid_moe.simulator import STACKS, SimResult, Stack, simulate
from torch_hybrid_moe.simulator.calibration import Calibration
from torch_hybrid_moe.simulator.stacks import PAPERS
from torch_hybrid_moe.simulator.tuning import oracle, tune
from torch_hybrid_moe.traces import Trace

TRACES = Path(__file__).resolve().parent.parent / "torch_hybrid_moe" / "embedded" / "traces"
CACHES = ("lru", "mrs", "dali_window", "eam", "daop")  # hit-rate order under the same placement
PREFETCHERS = ("gate", "residual", "eam")  # accuracy under the same placement and cache


class GreedyVersusOptimum(DaliGreedy):
    """DALI's greedy that also solves each step exactly, to compare the two makespans on the same states."""

    totals = {"greedy": 0.0, "optimum": 0.0}

    def place(self, counts, resident):
        plan = super().place(counts, resident)
        exact = Optimal(self.info, self.costs).place(counts, resident)
        self.totals["greedy"] += makespan(counts, resident, plan.accelerator, self.costs)
        self.totals["optimum"] += makespan(counts, resident, exact.accelerator, self.costs)
        return plan


SCHEDULERS.register("dali_greedy_vs_optimum")(GreedyVersusOptimum)


def row(r: SimResult) -> str:
    acc = f"{r.prefetch_accuracy:.1%}" if r.prefetch_accuracy is not None else "-"
    return (
        f"| {r.stack} | {r.decode_tok_s:.1f} | {r.prefill_tok_s:.1f} | {r.hit_rate:.1%} | {acc} | "
        f"{r.pcie_gb:.2f} | {r.planning_us:.0f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hardware", default="dali", choices=sorted(HARDWARE))
    parser.add_argument("--expert-shape", default="deepseek-v2-lite", choices=sorted(EXPERT_SHAPES))
    shipped = sorted(p.name.removesuffix("-heldout-at0.safetensors") for p in TRACES.glob("*-heldout-at0.safetensors"))
    parser.add_argument("--models", nargs="+", default=["deepseek-tiny", "mixtral-tiny"], choices=shipped)
    parser.add_argument("--batches", nargs="+", type=bounded(int, 1), default=[1, 16])
    parser.add_argument("--ratios", nargs="+", type=bounded(float, 0, 1), default=[0.25, 0.5])
    parser.add_argument("--json", type=writable, help="write every record here (a new file)")
    args = parser.parse_args()
    if 0 in args.ratios:  # no slots: every stack runs all on the CPU, alike
        parser.error("--ratios: a cache ratio of 0 leaves no slots, where every stack is the same; give ratios above 0")
    traces = {
        model: tuple(Trace.load(TRACES / f"{model}-heldout-at{at}.safetensors") for at in (0, 512))
        for model in args.models
    }
    fewest = min(len(t.sequence.unique()) for pair in traces.values() for t in pair)
    if max(args.batches) > fewest:
        parser.error(f"--batches: at most {fewest}, the sequences the traces hold")
    costs = CostModel(HARDWARE[args.hardware], EXPERT_SHAPES[args.expert_shape])
    records, summary = [], []
    print(f"hardware {args.hardware}: {costs.hardware.description}; experts sized as {args.expert_shape}")
    for model in args.models:
        trace, held = traces[model]
        calibration = Calibration.from_trace(trace, held)
        for batch in args.batches:
            for ratio in args.ratios:
                ours, _ = tune(held, costs, batch, ratio, calibration)
                deferred = max(1, trace.meta["top_k"] - 2)
                ceiling = oracle(trace, ours, costs, batch, ratio, calibration)
                stacks = [*STACKS.values(), ours, ceiling]
                stacks += [
                    replace(
                        s,
                        name=f"{s.name}+deferral",
                        deferred=deferred,
                        description=f"{s.description}; Expert Deferral of {deferred} (approximate)",
                    )
                    for s in (STACKS["ktransformers"], ours)
                ]
                stacks += [Stack(f"cache:{c}", "cached_on_accelerator", c, True, "hit-rate comparison") for c in CACHES]
                stacks += [
                    Stack(f"prefetch:{p}", "cached_on_accelerator", "dali_window", True, "accuracy comparison", p)
                    for p in PREFETCHERS
                ]
                stacks.append(
                    Stack(
                        "dali-greedy-vs-optimum",
                        "dali_greedy_vs_optimum",
                        "dali_window",
                        True,
                        "DALI's stack, each step also solved exactly",
                        "residual",
                    )
                )
                GreedyVersusOptimum.totals = {"greedy": 0.0, "optimum": 0.0}
                results = {s.name: simulate(trace, s, costs, batch, ratio, calibration) for s in stacks}
                print(
                    f"\n### {model}, batch {batch}, cache ratio {ratio:g} (ours: {ours.description}; oracle: "
                    f"{ceiling.description})\n"
                )
                print(
                    "| stack | decode tok/s | prefill tok/s | hit rate | prefetch acc | PCIe GB | planning us/layer |"
                )
                print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
                for r in results.values():
                    print(row(r))
                best = max(PAPERS, key=lambda n: results[n].decode_tok_s)
                mine, best_foresight = results["ours"].decode_tok_s, results["oracle"].decode_tok_s
                greedy = GreedyVersusOptimum.totals
                entry = {
                    "model": model,
                    "batch": batch,
                    "cache_ratio": ratio,
                    "ours": ours.description,
                    "ours_decode": mine,
                    "best_paper": best,
                    "best_paper_decode": results[best].decode_tok_s,
                    "ours_over_best_paper": mine / results[best].decode_tok_s,
                    "ours_over_oracle": mine / best_foresight,
                    "optimum_over_greedy_makespan": greedy["optimum"] / greedy["greedy"],
                    "hit_rates": {c: results[f"cache:{c}"].hit_rate for c in CACHES},
                    "prefetch_accuracy": {p: results[f"prefetch:{p}"].prefetch_accuracy for p in PREFETCHERS},
                    "deferral_gain": {
                        n: results[f"{n}+deferral"].decode_tok_s / results[n].decode_tok_s
                        for n in ("ktransformers", "ours")
                    },
                }
                summary.append(entry)
                records += [asdict(r) | {"model": model} for r in results.values()]
                print(
                    f"\nours / best paper ({best}): {entry['ours_over_best_paper']:.3f}; ours / oracle: "
                    f"{entry['ours_over_oracle']:.3f}; DALI greedy makespan vs exact optimum on the same states: "
                    f"optimum / greedy = {entry['optimum_over_greedy_makespan']:.3f}"
                )
    print("\n## Summary\n")
    print(
        "| model | batch | cache | ours / best paper | ours / oracle | optimum / greedy | hit rate "
        + " / ".join(CACHES)
        + " | prefetch acc "
        + " / ".join(PREFETCHERS)
        + " | deferral gain kt / ours |"
    )
    print("| --- | ---: | ---: | --- | ---: | ---: | --- | --- | --- |")
    for e in summary:
        hits = " / ".join(f"{e['hit_rates'][c]:.1%}" for c in CACHES)
        accs = " / ".join(f"{e['prefetch_accuracy'][p]:.1%}" for p in PREFETCHERS)
        print(
            f"| {e['model']} | {e['batch']} | {e['cache_ratio']:g} | {e['ours_over_best_paper']:.3f} "
            f"({e['best_paper']}) | {e['ours_over_oracle']:.3f} | {e['optimum_over_greedy_makespan']:.3f} | "
            f"{hits} | {accs} | {e['deferral_gain']['ktransformers']:.3f} / {e['deferral_gain']['ours']:.3f} |"
        )
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "records": records}, indent=1))


if __name__ == "__main__":
    main()
