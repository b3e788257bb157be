"""Figures of simulator runs, saved as PNG: the CPU / GPU / PCIe lanes of a few steps (`Event`s), and hit rate
and decode speed against the cache ratio for several stacks.

matplotlib is optional (`pip install torch-hybrid-moe[plot]`) and imported only when a figure is drawn; figures
are drawn on matplotlib's Agg canvas without pyplot, so no global backend is touched.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from tqdm.auto import tqdm

from ..cost_model import CostModel
from ..traces import Trace
from .calibration import Calibration
from .replay import Event, GraphStep, SimResult, simulate
from .stacks import Stack

LANES = ("pcie", "gpu", "cpu")  # bottom to top
KIND_COLOURS = {
    "expert": "tab:blue",
    "deferred": "tab:cyan",
    "dense": "tab:gray",
    "placement": "tab:purple",
    "fetch": "tab:red",
    "prefetch": "tab:orange",
    "admit": "tab:green",
}
DEFAULT_RATIOS = (0.125, 0.25, 0.375, 0.5, 0.75, 1.0)
BAR_HEIGHT = 0.7


def _figure(width: float = 10.0, height: float = 4.0):
    try:
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError("plots need matplotlib: pip install 'torch-hybrid-moe[plot]'") from err
    return Figure(figsize=(width, height), layout="constrained")


def window(events: Iterable[Event], first_step: int, steps: int) -> list[Event]:
    """The events of steps first_step .. first_step + steps - 1 (steps as the replay numbers them, from 0)."""
    return [e for e in events if first_step <= e.step < first_step + steps]


def draw_timeline(ax, events: Iterable[Event], first_step: int = 1, steps: int = 3) -> list[Event]:
    """One horizontal bar per busy interval of the chosen steps on its lane (cpu, gpu, pcie), coloured by kind,
    in milliseconds from the window's first event; returns the events drawn, in drawing order."""
    shown = window(events, first_step, steps)
    if not shown:
        raise ValueError(f"no events in steps {first_step}..{first_step + steps - 1}")
    origin = min(e.start for e in shown)
    drawn: list[Event] = []
    for kind, colour in KIND_COLOURS.items():
        of_kind = [e for e in shown if e.kind == kind]
        if of_kind:
            ax.barh(
                [LANES.index(e.lane) for e in of_kind],
                [(e.end - e.start) * 1e3 for e in of_kind],
                left=[(e.start - origin) * 1e3 for e in of_kind],
                height=BAR_HEIGHT,
                color=colour,
                edgecolor="black",
                linewidth=0.3,
                label=kind,
            )
            drawn += of_kind
    for step in range(first_step + 1, first_step + steps):  # where each later step begins
        starts = [e.start for e in shown if e.step == step and e.lane != "pcie"]
        if starts:
            ax.axvline((min(starts) - origin) * 1e3, color="grey", linestyle=":", linewidth=0.8)
    ax.set_yticks(range(len(LANES)), LANES)
    ax.set_xlabel("time (ms)")
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize="small")
    return drawn


def plot_timeline(
    events: Iterable[Event], path: str | Path, first_step: int = 1, steps: int = 3, title: str | None = None
) -> Path:
    """Save the lanes of steps first_step .. first_step + steps - 1 as a PNG at `path`; returns the path."""
    fig = _figure()
    ax = fig.add_subplot()
    draw_timeline(ax, events, first_step, steps)
    ax.set_title(title or f"steps {first_step}-{first_step + steps - 1}")
    return _save(fig, path)


def sweep_cache_ratio(
    trace: Trace,
    stacks: Iterable[Stack],
    costs: CostModel,
    ratios: Sequence[float] = DEFAULT_RATIOS,
    batch: int = 1,
    calibration: Calibration | None = None,
    progress: bool = False,
    done: Iterable[SimResult] = (),
    graph: GraphStep | None = None,
) -> dict[str, list[SimResult]]:
    """`simulate` of each stack at each cache ratio (ascending): stack name -> results in ratio order, decode
    steps replayed as `graph` runs them where given. `done`: results already run on the same trace, costs, batch,
    calibration and graph, reused for their stack and ratio instead of running again."""
    calibration = calibration or Calibration.from_trace(trace)
    stacks, ratios = list(stacks), sorted(set(ratios))
    known = {(r.stack, r.cache_ratio): r for r in done if r.batch == batch and r.hardware == costs.hardware.name}
    runs = [(s, r) for s in stacks for r in ratios if (s.name, r) not in known]
    for stack, ratio in tqdm(runs, desc="cache-ratio sweep", unit="run", leave=False, disable=not progress):
        known[stack.name, ratio] = simulate(trace, stack, costs, batch, ratio, calibration, graph=graph)
    return {s.name: [known[s.name, r] for r in ratios] for s in stacks}


def _plot_sweep(
    sweep: dict[str, list[SimResult]], path: str | Path, metric: str, label: str, title: str | None
) -> Path:
    fig = _figure(7.0, 4.5)
    ax = fig.add_subplot()
    for name, results in sweep.items():
        ax.plot([r.cache_ratio for r in results], [getattr(r, metric) for r in results], marker="o", label=name)
    ax.set_xlabel("cache ratio (slots / experts per layer)")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    if title:
        ax.set_title(title)
    return _save(fig, path)


def plot_hit_rate(sweep: dict[str, list[SimResult]], path: str | Path, title: str | None = None) -> Path:
    """Hit rate against cache ratio, one line per stack that keeps experts in slots (the others never hit)."""
    with_slots = {name: rs for name, rs in sweep.items() if any(r.hits for r in rs)}
    return _plot_sweep(with_slots or sweep, path, "hit_rate", "hit rate", title)


def plot_decode_speed(sweep: dict[str, list[SimResult]], path: str | Path, title: str | None = None) -> Path:
    """Decode tokens per second against cache ratio, one line per stack."""
    return _plot_sweep(sweep, path, "decode_tok_s", "decode tok/s", title)


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path
