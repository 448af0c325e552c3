"""Method configurations of the benchmarks, by name and options.

- :func:`parse_spec`: ``name:key=value,...`` (``arkvale:n_dense_layers=2,page_topks=16``; a list value keeps its
  commas inside brackets, ``magicpig:dense_layers=[0,1]``), the form the decode benchmark's ``--methods`` and the
  ablation runner's ``--baselines`` take; :func:`typed_options` types each value as its dataclass field (the
  checks ``cache.<key>=...`` gets in a run, :func:`evals.config.check_method_options`).
- :func:`suite_setting`: a suite's official setting of a method, the ``cache`` values of
  ``conf/suite_cache/<suite>_<name>.yaml`` (the file ``run.py eval=<suite> cache=<name>`` composes) with the official
  source recorded for each.
- :func:`plan`: the decode benchmark's cells. Its default row set runs every method at a suite's official setting
  (``--suite``, LongBench by default) with the command line's options on top; each ``--equal-dense N`` adds a row
  set in which every budgeted method keeps exactly its first ``N`` layers dense (:func:`dense_options`), so that a
  latency difference can be split into the method's and its dense layers'.
"""
from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from evals.config import check_method_options, method_defaults
from evals.harness import REPO_ROOT
from evals.output.row_tables import dense_layers
from evals.registry import make_method, method_class
from evals.task import ConfigError
from icecache.kv import BudgetError

SUITE_CACHE = REPO_ROOT / "conf" / "suite_cache"
FILTER_LAYERS_REASON = (
    "its dense layers are its layer roles (OmniKV: the layers before its first filter layer, each filter layer, "
    "which attends the whole context to choose the tokens of the sparse layers after it, and the wait layer after "
    "each); making only the first N layers dense would leave one filter layer and no wait layer, another method")
NO_DENSE_OPTION = "no dense-layer option (every layer is budgeted): on equal terms only at --equal-dense 0"


class OptionError(ValueError):
    """A bad method name, option key or value: one line, exit code 2 in the benchmarks."""


def _split_pairs(text: str) -> list[str]:
    """``text`` split at the commas outside brackets and braces."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch in "[{") - (ch in "]}")
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return [p for p in [*parts, text[start:]] if p]


def parse_spec(spec: str, where: str | None = None) -> tuple[str, dict[str, str]]:
    """``"name:key=value,..."`` -> ``(name, {key: value text})``, the values untyped (:func:`typed_options`);
    errors start with ``where`` (default: the spec)."""
    where = where or repr(spec)
    name, _, rest = spec.partition(":")
    if not name:
        raise OptionError(f"{where}: expected METHOD or METHOD:KEY=VALUE,...")
    options: dict[str, str] = {}
    for pair in _split_pairs(rest):
        key, eq, value = pair.partition("=")
        if not eq or not key:
            raise OptionError(f"{where}: expected KEY=VALUE after '{name}:', got {pair!r}")
        if key in options:
            raise OptionError(f"{where}: option '{key}' given twice")
        options[key] = value
    return name, options


def _scalar(text: str, default):
    """``text`` read as the type of ``default``: text as is for a text field, else a YAML value, with the numbers
    YAML 1.1 reads as text (``1e-3``) read as numbers."""
    if isinstance(default, str):
        return text
    value = yaml.safe_load(text) if text else None
    if isinstance(value, str) and not isinstance(default, bool):
        for kind in (int, float):
            try:
                return kind(text)
            except ValueError:
                pass
    return value


def field_defaults(name: str, where: str = "") -> dict:
    """``{option: default}`` of method ``name`` (its init fields less ``budget`` and ``debug``)."""
    try:
        known = method_defaults(name)
    except ValueError as e:  # UnknownNameError: the valid names are in its message
        raise OptionError(f"{where}: {e}" if where else str(e)) from None
    known.pop("name")
    return known


def check_values(name: str, values: dict, where: str) -> dict:
    """``values`` of method ``name`` checked against its fields (known key, type of the default, list-shaped
    fields given lists) and typed as the field (a whole number given to a float field becomes a float)."""
    known = field_defaults(name, where)
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise OptionError(f"{where}: {name} has no option {', '.join(map(repr, unknown))}; "
                          f"valid: {', '.join(sorted(known))}")
    try:
        checked = check_method_options(name, values, prefix=f"{name}:")
    except ConfigError as e:
        raise OptionError(f"{where}: {e}") from None
    return {k: float(v) if isinstance(known[k], float) and isinstance(v, int) and not isinstance(v, bool) else v
            for k, v in checked.items()}


def typed_options(name: str, raw: dict[str, str], where: str) -> dict:
    """The option texts of :func:`parse_spec` as values of the method's fields (:func:`check_values`)."""
    known = field_defaults(name, where)
    return check_values(name, {k: _scalar(v, known.get(k)) for k, v in raw.items()}, where)


def suite_setting(suite: str | None, name: str) -> tuple[dict, Path | None, dict]:
    """``(values, file, sources)``: the ``cache`` values of ``conf/suite_cache/<suite>_<name>.yaml`` (``{}`` where
    the suite has no such file or ``suite`` is None), the file, and ``{key: official source}`` from its
    ``official_source`` where it records one."""
    path = SUITE_CACHE / f"{suite}_{name}.yaml"
    if suite is None or not path.is_file():
        return {}, None, {}
    data = yaml.safe_load(path.read_text()) or {}
    values = check_values(name, dict(data.get("cache") or {}), str(path.relative_to(REPO_ROOT)))
    sources = {k: v.get("source") for k, v in (data.get("official_source") or {}).items() if isinstance(v, dict)}
    return values, path, sources


def dense_options(name: str, n: int) -> dict | str:
    """The options that make exactly the first ``n`` layers of method ``name`` attend the whole context, or why it
    cannot be set so: ``n_dense_layers`` (IceCache and its variants, the page oracle, Quest, ArkVale, top-k),
    ``dense_layers = [0, ..., n - 1]`` (MagicPIG); OmniKV's dense layers are its layer roles; a method without a
    dense-layer option budgets every layer (``{}`` at ``n = 0``: it already is on those terms)."""
    names = {f.name for f in dataclasses.fields(method_class(name)) if f.init}
    if "n_dense_layers" in names:
        return {"n_dense_layers": n}
    if "dense_layers" in names:
        return {"dense_layers": list(range(n))}
    if "filter_layers" in names:
        return FILTER_LAYERS_REASON
    return {} if n == 0 else NO_DENSE_OPTION


def _text(value) -> str:
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))


def cell_label(name: str, explicit: dict, dense: int | None = None) -> str:
    """``name`` with the command line's options and the equal-dense count in brackets (``arkvale``,
    ``arkvale[page_topks=16]``, ``arkvale[dense=0]``); a suite's official values are the bare name's."""
    parts = [f"{k}={_text(v)}" for k, v in explicit.items()] + ([f"dense={dense}"] if dense is not None else [])
    return name + (f"[{','.join(parts)}]" if parts else "")


@dataclass
class Cell:
    """A benchmarked configuration: its label (the key of its rows), method and the options its class gets."""

    label: str
    method: str
    options: dict = field(default_factory=dict)

    def build(self, budget: int):
        return make_method(self.method, budget=None if self.method == "full" else budget, **self.options)

    def to_json(self) -> str:
        return json.dumps({"method": self.method, "options": self.options})

    @classmethod
    def from_json(cls, label: str, text: str) -> Cell:
        data = json.loads(text)
        return cls(label, data["method"], data["options"])


def _validate(cell: Cell, budget: int, where: str) -> None:
    """A value the method refuses is an :class:`OptionError`; one that only the budget makes invalid is left to its
    cells, which fail and are recorded with the reason (as every failed cell)."""
    try:
        cell.build(budget)
    except BudgetError:
        pass
    except (ValueError, TypeError) as e:
        raise OptionError(f"{where}: {e}") from None


def plan(specs: list[str], suite: str | None, equal_dense: list[int], budget: int) -> tuple[list[Cell], dict]:
    """The cells of a decode benchmark, each default cell followed by its equal-dense cells, and their record
    ``{"suite", "cells": {label: {...}}, "row_sets": {...}}``: per label the method, its row set, the options its
    class gets, which came from the command line and which from the suite file (with the file and each value's
    official source), and for an equal-dense cell the options that set its dense layers; per row set its cells by
    default label, and for an equal-dense one the methods already on those terms (the default row serves) and
    those that cannot be (with why)."""
    defaults: dict[str, list[Cell]] = {}
    records: dict[str, dict] = {}
    for spec in specs:
        where = f"--methods {spec}"
        name, raw = parse_spec(spec, where)
        explicit = typed_options(name, raw, where)
        suite_values, path, sources = suite_setting(suite, name)
        cell = Cell(cell_label(name, explicit), name, {**suite_values, **explicit})
        _validate(cell, budget, where)
        if cell.label in defaults:
            continue
        defaults[cell.label] = [cell]
        records[cell.label] = {
            "method": name, "row_set": "default", "options": cell.options, "from_command_line": explicit,
            "from_suite": {k: v for k, v in suite_values.items() if k not in explicit},
            "suite_overridden": {k: v for k, v in suite_values.items() if k in explicit},
            "suite_file": str(path.relative_to(REPO_ROOT)) if path else None,
            "official_source": {k: sources[k] for k in suite_values if k in sources}}
    row_sets = {"default": {"suite": suite, "cells": {label: label for label in defaults}}}
    for n in equal_dense:
        members, same, refused = {}, [], {}
        for label, (cell, *_) in defaults.items():
            if cell.method == "full":
                continue
            dense = dense_options(cell.method, n)
            if isinstance(dense, str):
                refused[label] = dense
                continue
            options = {**cell.options, **dense}
            if _same({**field_defaults(cell.method), **options}, {**field_defaults(cell.method), **cell.options}):
                members[label] = label
                same.append(label)
                continue
            new = Cell(cell_label(cell.method, records[label]["from_command_line"], n), cell.method, options)
            _validate(new, budget, f"--equal-dense {n} ({label})")
            defaults[label].append(new)
            members[label] = new.label
            record = records[label]
            records[new.label] = {**record, "row_set": f"dense={n}", "options": options, "equal_dense": dense, **{
                key: {k: v for k, v in record[key].items() if k not in dense}
                for key in ("from_command_line", "from_suite", "official_source")}}
        row_sets[f"dense={n}"] = {"n_dense": n, "cells": members, "same_as_default": same, "not_equalised": refused}
    cells = [c for group in defaults.values() for c in group]
    return cells, {"suite": suite, "cells": records, "row_sets": row_sets}


def configure(args) -> list[Cell]:
    """The cells of ``--methods`` at ``--suite``'s official settings, with the ``--equal-dense`` row sets
    (:func:`plan`, whose record becomes ``args.configurations``); a bad method, option or value is one line on stderr
    and exit code 2."""
    try:
        if any(n < 0 for n in args.equal_dense):
            raise OptionError(f"--equal-dense takes layer counts >= 0, got {args.equal_dense}")
        cells, args.configurations = plan(args.methods, None if args.suite == "none" else args.suite,
                                          args.equal_dense, args.budget)
    except OptionError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    return cells


def _same(a: dict, b: dict) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def resume_conflicts(old: dict, configurations: dict) -> list[str]:
    """The labels whose cells in ``old`` (a decode benchmark file) ran other options than :func:`plan` gives them
    now; a file that records no ``configurations`` ran every method at its class defaults."""
    recorded = (old.get("configurations") or {}).get("cells", {})
    out = []
    for label, record in configurations["cells"].items():
        before = recorded.get(label, {}).get("options", {})
        if label in old and not _same(before, record["options"]):
            out.append(f"'{label}' ran {before or 'the class defaults'}, now {record['options']}")
    return out


def _ratio(row: dict | None, full: dict | None, key: str) -> float | None:
    if not row or not full or "error" in row or "error" in full or not row.get(key) or not full.get(key):
        return None
    return row[key] / full[key]


def tpot_over_full(results: dict, configurations: dict, key: str) -> dict:
    """Per row set, ``{default label: {length: TPOT / full's TPOT}}`` at every measured length (the ``key``
    statistic; full's default row at the same length; None where either cell is missing or failed)."""
    full = results.get("full", {})
    lengths = sorted({L for rows in results.values() for L in rows}, key=int)
    return {name: {base: {L: _ratio(results.get(label, {}).get(L), full.get(L), key) for L in lengths}
                   for base, label in row_set["cells"].items() if base != "full"}
            for name, row_set in configurations["row_sets"].items()}


def print_row_sets(results: dict, configurations: dict, key: str) -> None:
    """The row sets side by side: per method its dense layers (as bound: ``n_dense_layers`` of its rows) and its
    TPOT / full at each length, one ``|``-separated entry per row set; ``=`` marks the default row serving a set
    whose terms it already meets, ``x`` a method that cannot be put on them (why, below the table)."""
    sets = configurations["row_sets"]
    ratios = tpot_over_full(results, configurations, key)
    lengths = sorted({L for table in ratios.values() for cells in table.values() for L in cells}, key=int)
    bases = [b for b in sets["default"]["cells"] if b != "full"]
    if not bases or "full" not in results:
        return
    width, column = max(len(b) for b in [*bases, "method"]), 8 * len(sets)
    print(f"\nTPOT / full by context length, row sets side by side: {' | '.join(sets)} (default: "
          f"{sets['default']['suite'] or 'class defaults'} settings; dense=N: the first N layers dense):")
    print(f"{'method':>{width}}  {'dense layers':>{column}}  " + "  ".join(f"{L:>{column}}" for L in lengths))
    for base in bases:
        dense, cells = [], {L: [] for L in lengths}
        for name, row_set in sets.items():
            label = row_set["cells"].get(base)
            mark = "=" if name != "default" and label == base else " "
            missing = "x" if base in row_set.get("not_equalised", {}) else "-"
            dense.append(f"{missing:>4} " if label is None else f"{dense_layers(results.get(label, {})) or '?':>4}{mark}")
            for L in lengths:
                ratio = ratios[name].get(base, {}).get(L)
                cells[L].append(f"{missing:>4} " if label is None else f"{'-' if ratio is None else f'{ratio:.2f}':>4}"
                                f"{mark}")
        print(f"{base:>{width}}  {' | '.join(dense):>{column}}  " +
              "  ".join(f"{' | '.join(cells[L]):>{column}}" for L in lengths))
    print("(=: the default row, already on those terms; x: cannot be put on them; -: not measured)")
    for name, row_set in sets.items():
        reasons: dict[str, list[str]] = {}
        for base, why in row_set.get("not_equalised", {}).items():
            reasons.setdefault(why, []).append(base)
        for why, bases_ in reasons.items():
            print(f"{name}: {', '.join(bases_)}: {why}")
