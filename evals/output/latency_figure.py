"""TPOT vs context length from a decode benchmark file (:mod:`evals.bench.decode`), with each method's floor:
``python -m evals.output.latency_figure bench_decode.json -o docs/figures/tpot_vs_context.png``.

One solid line with markers per method: the cell's median TPOT (``tpot_p50_s``, the benchmark's statistic) at
every measured length, on a log2 length axis. Each method's floor (``floor_s``, :mod:`evals.bench.floor`) is a
dashed line of the same colour without markers, so the vertical gap between a method's two lines is its
``tpot_over_floor`` on the log TPOT axis (log because TPOTs span an order of magnitude across methods).
``--floors icecache`` draws only the named methods' floors (methods whose dense layers are equal have nearly
equal floors, and one reads better than several on top of each other); cells without a floor draw no dashed
point. Series are dodged sideways a little (evals/output/plot_style.py) so equal values never hide one another.
The title names the model, budget, new tokens, hardware (CPU model, or GPU), threads and dtype from the file's
``environment``, and the repeats per cell counted from the rows (``runs``; a range where cells differ); every
legend entry states its method's repeats as ``n``.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FormatStrFormatter  # noqa: E402

from .plot_style import FOOTER, dodge_factors, legend_outside, method_color, method_markers, save  # noqa: E402

TPOT = "tpot_p50_s"  # the decode benchmark's TPOT statistic (evals.bench.decode.TPOT)
NOT_METHODS = ("environment", "summary", "configurations")  # the keys that are not cells (evals.bench.decode)


def method_cells(bench: dict) -> dict[str, dict[int, dict]]:
    """``{method: {length: row}}`` of the measured cells of a decode benchmark file (failed cells left out),
    lengths sorted."""
    return {m: {int(L): rows[L] for L in sorted(rows, key=int) if "error" not in rows[L]}
            for m, rows in bench.items() if m not in NOT_METHODS}


def repeats(row: dict) -> int:
    """The repeats behind a cell's row: its successful ``runs``, else 1."""
    return sum("error" not in r for r in row["runs"]) if "runs" in row else 1


def repeats_text(rows) -> str:
    counts = sorted({repeats(r) for r in rows})
    return "?" if not counts else str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"


def title_text(bench: dict) -> str:
    """Model, budget, new tokens, hardware, threads, dtype and repeats per cell."""
    env = bench.get("environment", {})
    chip = env.get("gpu") or " ".join(filter(None, (env.get("cpu_model"), env.get("cpu_signature")))) \
        or "unrecorded hardware"
    dtype = str(env.get("dtype", "?")).removeprefix("torch.")
    rows = [r for cells in method_cells(bench).values() for r in cells.values()]
    repeats = repeats_text(rows)
    return (f"TPOT vs context: {env.get('model', '?')}, budget {env.get('budget', '?')}, "
            f"{env.get('new_tokens', '?')} new tokens\n{chip}, {env.get('threads', '?')} threads, {dtype}, "
            f"{repeats} {'repeat' if repeats == '1' else 'repeats'} per cell")


def _length_ticks(ax, lengths) -> None:
    ticks = sorted(set(lengths))
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [f"{t // 1024}k" if t % 1024 == 0 else str(t) for t in ticks])
    ax.minorticks_off()


def draw_tpot_vs_context(bench: dict, floors: list[str] | None = None):
    """The figure (module docstring); ``floors``: the methods whose floor is drawn (None: every method). Every
    line carries a gid: ``tpot:<method>`` or ``floor:<method>``."""
    cells = {m: c for m, c in method_cells(bench).items() if c}
    markers = method_markers(cells)
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for (method, rows), factor in zip(cells.items(), dodge_factors(len(cells), 0.2)):
        color = method_color(method)
        xs = [L * factor for L in rows]
        ax.plot(xs, [1000 * r[TPOT] for r in rows.values()], marker=markers[method], color=color, lw=1.2, ms=5,
                label=f"{method} (n={repeats_text(rows.values())})", gid=f"tpot:{method}")
        floored = [(x, r["floor_s"]) for x, r in zip(xs, rows.values()) if r.get("floor_s")]
        if floored and (floors is None or method in floors):
            ax.plot([x for x, _ in floored], [1000 * f for _, f in floored], ls="--", color=color, lw=1.0,
                    alpha=0.8, label=f"{method} floor", gid=f"floor:{method}")
    _length_ticks(ax, [L for rows in cells.values() for L in rows])
    ax.set_yscale("log")
    for axis_formatter in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
        axis_formatter(FormatStrFormatter("%g"))  # 20, 30, 100 ms rather than powers of ten
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("TPOT, median per-token interval (ms)")
    ax.set_title(title_text(bench), fontsize=9)
    ax.grid(alpha=0.3, which="both")
    legend_outside(ax)
    fig.text(0.01, 0.0, "solid: TPOT | dashed: floor = full's other + full's attention share of the dense layers\n"
             "+ exact attention over the budget in the budgeted layers (docs/benchmarks.md, Floor) | "
             "n = repeats per cell | series dodged sideways", ha="left", va="top", fontsize=7, color="#444444",
             gid=FOOTER)
    return fig


def tpot_vs_context(bench: dict, out: Path, floors: list[str] | None = None) -> Path:
    """Writes :func:`draw_tpot_vs_context` to ``out``."""
    return save(draw_tpot_vs_context(bench, floors), Path(out))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bench", help="a bench_decode.json written by python -m evals.bench.decode")
    parser.add_argument("-o", "--out", default="tpot_vs_context.png")
    parser.add_argument("--floors", nargs="+", default=None, help="draw only these methods' floors (default: all)")
    args = parser.parse_args(argv)
    print(f"wrote {tpot_vs_context(json.loads(Path(args.bench).read_text()), args.out, args.floors)}")


if __name__ == "__main__":
    main()
