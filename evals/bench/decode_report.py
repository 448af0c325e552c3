"""What the decode benchmark (:mod:`evals.bench.decode`) prints and summarises from its cells: one line per
measured repeat (:func:`print_cell`), TPOT by length with its growth and its phases (:func:`summary`,
:func:`print_summary`), the floors (:func:`print_floors`) and the ratios to the full cache (:func:`print_ratios`)."""
from __future__ import annotations

from icecache.kv.timing import PHASES

TPOT = "tpot_p50_s"  # the statistic of the printed table and the summary: the median per-token interval
BREAKDOWN = (*PHASES, "other")
NOT_CELLS = ("environment", "summary", "configurations")  # the keys of bench_decode.json that are not cells


def print_cell(method: str, length: int, row: dict, floor_s: float | None = None) -> None:
    """One measured repeat of a cell, with its cell's floor (:mod:`evals.bench.floor`) once full's row at that
    length is known."""
    if "error" in row:
        print(f"{method:>15} {length:>6}: FAILED {row['error'].strip().splitlines()[-1]}", flush=True)
        return
    rss = f"  peak RSS {row['peak_rss_bytes'] / 2**30:.2f} GiB" if "peak_rss_bytes" in row else ""
    print(f"{method:>15} {length:>6}: TT2T {row['tt2t_s']:.3f} s  TPOT {1000 * row[TPOT]:.2f} ms  " +
          " ".join(f"{p} {1000 * v:.2f}" for p, v in row["breakdown"].items()) + rss +
          (f"  omp {row['omp_wait']}" if "omp_wait" in row else "") +
          (f"  floor {1000 * floor_s:.2f} ms ({row[TPOT] / floor_s:.2f}x)" if floor_s and row[TPOT] else ""), flush=True)


def method_rows(results: dict) -> dict:
    """``{method: {length: row}}`` of the measured cells (no summary, environment or failed cells)."""
    return {m: {L: r for L, r in rows.items() if "error" not in r} for m, rows in results.items()
            if m not in NOT_CELLS}


def growth(rows: dict, lo: int, hi: int) -> dict | None:
    """TPOT growth of one method from ``lo`` to ``hi`` tokens (the nearest measured lengths inside the
    range when those are missing): total and per phase, in seconds, and the TPOT ratio."""
    lengths = sorted(int(L) for L in rows)
    inside = [L for L in lengths if lo <= L <= hi] or lengths
    if len(inside) < 2:
        return None
    a, b = rows[str(inside[0])], rows[str(inside[-1])]
    return {"from": inside[0], "to": inside[-1], "growth_s": b[TPOT] - a[TPOT],
            "growth_x": b[TPOT] / a[TPOT],
            "phase_growth_s": {p: b["breakdown"].get(p, 0.0) - a["breakdown"].get(p, 0.0) for p in BREAKDOWN}}


def summary(results: dict, lo: int, hi: int) -> dict:
    """Per method: TPOT by length and its growth from ``lo`` to ``hi`` (see :func:`growth`), and its floor and
    TPOT over the floor by length (:func:`evals.bench.floor.annotate`; None where unknown)."""
    return {m: {TPOT: {L: r[TPOT] for L, r in rows.items()}, "growth": growth(rows, lo, hi),
                **{key: {L: r.get(key) for L, r in rows.items()} for key in ("floor_s", "tpot_over_floor")}}
            for m, rows in method_rows(results).items() if rows}


def print_summary(results: dict, lo: int, hi: int) -> None:
    table = summary(results, lo, hi)
    lengths = sorted({int(L) for t in table.values() for L in t[TPOT]})
    if not lengths:
        return
    print("\nTPOT (ms) by context length; growth = TPOT(to) - TPOT(from), ms and x, and its phases (ms):")
    print(f"{'method':>15} " + " ".join(f"{L:>8}" for L in lengths) + f" {'growth':>16}  " +
          " ".join(f"{p:>9}" for p in BREAKDOWN))
    for method, t in table.items():
        cells = " ".join(f"{1000 * t[TPOT][str(L)]:8.2f}" if str(L) in t[TPOT] else f"{'-':>8}"
                         for L in lengths)
        g = t["growth"]
        grown = (f"{1000 * g['growth_s']:+8.2f} {g['growth_x']:5.2f}x  " +
                 " ".join(f"{1000 * g['phase_growth_s'][p]:+9.2f}" for p in BREAKDOWN)) if g else f"{'-':>16}"
        print(f"{method:>15} {cells} {grown}")
    if table and any(t["growth"] for t in table.values()):
        g = next(t["growth"] for t in table.values() if t["growth"])
        print(f"(growth from {g['from']} to {g['to']} tokens)")


def print_floors(results: dict) -> None:
    """Per method and length: the floor (ms) and TPOT over it; ``-`` where the floor is unknown."""
    rows = method_rows(results)
    lengths = sorted({int(L) for r in rows.values() for L in r})
    if not any(r.get("floor_s") for cells in rows.values() for r in cells.values()):
        return
    print("\nfloor ms (TPOT / floor) by context length:")
    print(f"{'method':>15} " + " ".join(f"{L:>16}" for L in lengths))
    for method, cells in rows.items():
        text = [f"{1000 * r['floor_s']:7.2f} ({r['tpot_over_floor']:5.2f}x)" if (r := cells.get(str(L), {})).get(
            "tpot_over_floor") else f"{'-':>16}" for L in lengths]
        print(f"{method:>15} " + " ".join(text))


def print_ratios(results: dict) -> None:
    results = method_rows(results)
    if "full" not in results:
        return
    print("\nratio to full (TT2T / TPOT):")
    for method, rows in results.items():
        if method == "full":
            continue
        full = results["full"]
        cells = [f"{L}: {r['tt2t_s'] / full[L]['tt2t_s']:.2f} / {r[TPOT] / full[L][TPOT]:.2f}"
                 for L, r in rows.items() if L in full]
        print(f"{method:>15}  " + "  ".join(cells))
