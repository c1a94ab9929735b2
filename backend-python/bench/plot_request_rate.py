"""Plots of request_rate_benchmark.py results, one JSON per server: latency against request rate
(end-to-end, time to first token and inter-token latency; median solid, p99 dashed) and output
throughput against request rate, as PNGs for docs/images/.

    python bench/plot_request_rate.py out/rate_albatross.json out/rate_classic.json --output ../docs/images
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt

PANELS = (("e2e_ms", "end-to-end latency (ms)"), ("ttft_ms", "time to first token (ms)"), ("itl_ms", "inter-token latency (ms)"))


def _series(run: dict, key: str, quantile: str) -> tuple[list[float], list[float]]:
    # nan: no request; inf: not by the load's deadline (side_by_side.py); neither has a place on a log axis
    points = [(r["rate"], r[key][quantile]) for r in _rated(run) if math.isfinite(r[key][quantile])]
    return [p[0] for p in points], [p[1] for p in points]


def _rated(run: dict) -> list[dict]:
    """The Poisson loads of a run (a burst, rate = inf, has no place on a rate axis)."""
    return [r for r in run["rates"] if math.isfinite(r["rate"])]


def plot(runs: list[dict], output: Path) -> list[Path]:
    """Write request_rate_latency.png and request_rate_throughput.png into `output`; nothing when
    no run has a Poisson load (a burst alone: `side_by_side.py --rates ,`)."""
    if not any(_rated(run) for run in runs):
        return []
    output.mkdir(parents=True, exist_ok=True)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    figure, axes = plt.subplots(1, len(PANELS), figsize=(15, 4.5))
    for axis, (key, title) in zip(axes, PANELS):
        for colour, run in zip(colours, runs):
            for quantile, style in (("p50", "-"), ("p99", "--")):
                rates, values = _series(run, key, quantile)
                axis.plot(rates, values, style, marker="o", color=colour, label=f"{run['label']} {quantile}")
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("request rate (requests/s, Poisson)")
        axis.set_title(title)
        axis.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    figure.suptitle(f"streaming latency against request rate ({runs[0].get('length_mix', '')})", fontsize=8)
    figure.tight_layout()
    latency = output / "request_rate_latency.png"
    figure.savefig(latency, dpi=110)
    plt.close(figure)

    figure, axis = plt.subplots(figsize=(6, 4.5))
    for colour, run in zip(colours, runs):
        rates = [r["rate"] for r in _rated(run)]
        axis.plot(rates, [r["output_tokens_per_s"] for r in _rated(run)], marker="o", color=colour, label=run["label"])
    axis.set_xscale("log", base=2)
    axis.set_xlabel("request rate (requests/s, Poisson)")
    axis.set_ylabel("generated tokens/s")
    axis.grid(True, which="both", alpha=0.3)
    axis.legend()
    figure.tight_layout()
    throughput = output / "request_rate_throughput.png"
    figure.savefig(throughput, dpi=110)
    plt.close(figure)
    return [latency, throughput]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", type=Path, help="request_rate_benchmark.py JSON files, one per server")
    parser.add_argument("--output", type=Path, default=Path("out"))
    args = parser.parse_args(argv)
    runs = []
    for path in args.results:
        data = json.loads(path.read_text())
        runs.extend(data["servers"] if "servers" in data else [data])  # side_by_side.py writes several
    written = plot(runs, args.output)
    for path in written:
        print(f"wrote {path}")
    if not written:
        print("no plots: no server ran a Poisson load (a burst has no place on a rate axis)")


if __name__ == "__main__":
    main()
