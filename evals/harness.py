"""Compose config -> validate (cheap, before any heavy work) -> model, cache, suite -> run -> results.

``run.py`` is the Hydra front end; this module takes a plain resolved config dict so tests, notebooks
and sweeps can call :func:`run_eval` directly.

Provenance: every process that writes rows records ``resolved.json`` in the run directory
(:func:`resolved_record`: the method as constructed, the suite's options, the model and its checkpoint
checksum, the commit, dirty flag and environment), and every row's timing names its commit and dirty flag, so
a run directory alone says which configuration and which code produced it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from icecache.kv import BudgetError, KVMethod, UnknownNameError
from icecache.kv.recall import RecallProbe, pool_recall

from . import prefill_cache
from .models import (RANDOM_CONFIGS, ModelUnavailableError, load_model, load_tokenizer, model_entry, resolve_path,
                     tiny_config)
from .output import results, wandb_log
from .task import DataError
from .config import ConfigError, check_config, check_results_dir
from .registry import budget_multiple, method_for_prompt, suite_class
from .runner import generate
from .output.schema import limit_warning
from .output.timing import peak_memory_bytes, pool_timing, provenance, run_environment

REPO_ROOT = results.REPO_ROOT

# Errors caused by the user's input: reported in one line, without a traceback (run.py).
USER_ERRORS = (ConfigError, BudgetError, UnknownNameError, DataError, ModelUnavailableError,
               results.RunDirError, FileNotFoundError)
__all__ = ["ConfigError", "USER_ERRORS", "Plan", "plan", "run_eval"]


def repo_path(p: str | None) -> Path | None:
    """A configured path: absolute as given, relative to the repository root otherwise."""
    if p is None:
        return None
    path = Path(p)
    return path if path.is_absolute() else REPO_ROOT / path


def cache_options(cfg: dict) -> tuple[str, dict]:
    opts = dict(cfg["cache"])
    return opts.pop("name"), opts


@dataclass
class Plan:
    """A validated run: everything that can fail cheaply has been checked."""

    cfg: dict
    method_name: str
    method_options: dict
    suite_cls: type
    suite_options: dict
    run_dir: Path
    resolved_method: dict | None = None  # results.resolved_method(cfg): the method as constructed at plan time
    prefill: prefill_cache.PrefillStore | None = None  # prefill_cache=DIR: prompts prefilled once, then replayed

    def method(self, n_prompt_tokens: int) -> KVMethod:
        return method_for_prompt(self.method_name, self.cfg.get("budget"), n_prompt_tokens,
                                 debug=bool(self.cfg.get("debug")), **self.method_options)


def plan(cfg: dict) -> Plan:
    """Validates types, names, budget, limit, paths and data before loading anything heavy."""
    cfg, store = prefill_cache.from_config(cfg)  # not part of the run's identity (evals/prefill_cache.py)
    cfg = check_config(cfg)
    cfg["model"] = _model_settings(cfg["model"])
    budget = cfg.get("budget")
    name, options = cache_options(cfg)
    try:  # a bad name, budget or hyperparameter fails here, before any model is loaded
        method_for_prompt(name, budget, 1 << 20, **options)
    except (TypeError, ValueError) as err:
        if isinstance(err, BudgetError) and isinstance(budget, float) and 0 < budget < 1:
            raise BudgetError(f"{err} (checked at a {1 << 20}-token prompt: budget={budget} is a fraction of each "
                              f"prompt, resolved to a multiple of {budget_multiple(name, options)} tokens, at least "
                              "64, which this method does not always accept; give it a whole number of tokens)") from None
        if isinstance(err, (BudgetError, UnknownNameError)):
            raise
        raise ConfigError(f"cache '{name}': {err}") from None
    suite_opts = {k: v for k, v in cfg["eval"].items() if k != "name"}
    suite_cls = suite_class(cfg["eval"]["name"])
    data_dir = repo_path(cfg.get("data_dir"))
    if getattr(suite_cls, "needs_data", False) and (data_dir is None or not data_dir.is_dir()):
        raise FileNotFoundError(f"eval '{cfg['eval']['name']}' needs its data, but data_dir={data_dir} is not a "
                                "directory; pass data_dir=/path/to/data (see docs/data.md)")
    results_dir = repo_path(cfg.get("results_dir") or "results")
    check_results_dir(results_dir)
    cfg = dict(cfg, results_dir=str(results_dir), data_dir=None if data_dir is None else str(data_dir))
    return Plan(cfg, name, options, suite_cls, suite_opts, results.run_dir_for(cfg), results.resolved_method(cfg),
                prefill=store)


def _model_settings(model: dict) -> dict:
    """The model group with its name checked (a custom name needs ``model.path``), its local files
    checked, and, for an unregistered local model, the context length read from its ``config.json``."""
    path = model.get("path")
    if path is not None:
        path = str(repo_path(path))
    entry = model_entry(model["name"], path)
    if entry.source == "local" and entry.max_length:
        model = dict(model, max_length=entry.max_length)
    return dict(model, path=path)


def run_eval(cfg: dict, config_yaml: str = "", on_row=None) -> Path:
    """Runs (or resumes) one evaluation and writes its run directory; returns its path."""
    p = plan(cfg)
    cfg = p.cfg
    tokenizer = load_tokenizer(cfg["model"]["name"], cfg["model"].get("path"))
    suite = _suite(p, tokenizer)
    samples = list(suite.samples())
    if not samples:
        raise DataError(f"eval '{cfg['eval']['name']}' has no samples (empty data file or task list); "
                        f"data_dir={cfg.get('data_dir')}")
    n_total = suite.n_total()
    if cfg.get("limit") is not None:
        print(limit_warning(cfg["limit"], len(samples), n_total), file=sys.stderr, flush=True)
    run = results.RunDir(p.run_dir, cfg, config_yaml or yaml.safe_dump(cfg, sort_keys=False))
    try:
        _run(p, suite, samples, run, on_row, n_total)
    except BaseException:
        run.discard_if_empty()
        raise
    finally:
        run.close()
    return p.run_dir


def _suite(p: Plan, tokenizer):
    cfg = p.cfg
    try:
        max_length = {"max_length": cfg["model"]["max_length"]} if cfg["model"].get("max_length") else {}
        return p.suite_cls(tokenizer, data_dir=cfg["data_dir"], seed=cfg.get("seed", 0), limit=cfg.get("limit"),
                           **max_length, **p.suite_options)
    except TypeError as err:
        raise ConfigError(f"eval '{cfg['eval']['name']}': {err}") from None
    except ValueError as err:
        if isinstance(err, DataError):
            raise
        raise ConfigError(f"eval '{cfg['eval']['name']}': {err}") from None


def _up_to_date(run_dir: Path, rows: list[dict]) -> bool:
    """metrics.json and timing.json exist and were computed from every row now in the directory."""
    try:
        metrics = json.loads((run_dir / "metrics.json").read_text())
        json.loads((run_dir / "timing.json").read_text())
    except (OSError, ValueError):
        return False
    return metrics.get("n_samples") == len(rows)


def _recall_up_to_date(run_dir: Path, rows: list[dict]) -> bool:
    """recall.json exists and pools every row now in the directory (runs with ``diagnostics=recall``)."""
    try:
        pooled = json.loads((run_dir / "recall.json").read_text())
    except (OSError, ValueError):
        return False
    return (pooled or {}).get("n_samples", 0) == sum(1 for r in rows if r.get("recall"))


def _run(p: Plan, suite, samples: list, run: results.RunDir, on_row, n_total: int | None) -> None:
    """Generates the samples not yet in ``run``, then (re)computes metrics and timing from all its rows;
    metrics.json records the run's ``limit`` and the suite's ``n_total`` (:func:`~evals.output.schema.run_status`)."""
    cfg = p.cfg
    todo = [s for s in samples if s.id not in run.done_ids()]
    # Optional W&B logging (a no-op unless wandb.enabled=true): samples log as they finish, then the run's
    # summary and tables; a rerun of a finished directory logs its existing results.
    with wandb_log.session(cfg, p.run_dir) as wb:
        stale = not _up_to_date(p.run_dir, run.rows) or (cfg.get("diagnostics") and
                                                          not _recall_up_to_date(p.run_dir, run.rows))
        if todo or stale:
            results.write_json(p.run_dir / results.RESOLVED, resolved_record(p, suite))
            _generate_rows(p, suite, todo, run, _with_live_log(on_row, wb, len(run.rows)))
            results.write_json(p.run_dir / "metrics.json", {**suite.aggregate(run.rows), "version": suite.version,
                                                             "limit": cfg.get("limit"), "n_total": n_total})
            covered = sum(bool((r.get("timing") or {}).get("budget_covers_context")) for r in run.rows)
            results.write_json(p.run_dir / "timing.json",
                               {**pool_timing(run.rows, cfg), "prefill": prefill_cache.prefill_counts(run.rows),
                                "budget_covers_context": covered})
            if covered:  # once per run: such samples are full attention, not a point of the budget curve
                print(f"warning: budget={cfg.get('budget')} covers the whole context (prompt + generated tokens) of "
                      f"{covered} of {len(run.rows)} samples, which ran as full attention (timing.json: "
                      "budget_covers_context); a budget below the prompt length measures the method", file=sys.stderr)
            if cfg.get("diagnostics"):
                results.write_json(p.run_dir / "recall.json", pool_recall(run.rows))
        if len(run.rows) > len(samples):
            print(f"note: {p.run_dir} holds {len(run.rows)} samples and its metrics cover all of them (the suite "
                  f"now selects {len(samples)})", file=sys.stderr)
        wandb_log.log_run(cfg, p.run_dir, wb)


def _with_live_log(on_row, wb, done: int):
    """``on_row`` plus, when a W&B run is open, one W&B step per finished sample."""
    if wb is None:
        return on_row
    count = [done]

    def both(row: dict) -> None:
        count[0] += 1
        wb.log(wandb_log.sample_scalars(row, count[0]))
        if on_row is not None:
            on_row(row)
    return both


def _generate_rows(p: Plan, suite, todo: list, run: results.RunDir, on_row) -> None:
    if not todo:
        return
    cfg = p.cfg
    show = cfg.get("progress", "auto") is not False
    model = load_model(cfg["model"]["name"], cfg["model"].get("path"), cfg["model"].get("dtype", "auto"),
                       cfg["device"], seed=cfg.get("seed", 0), progress=show)
    tokenizer = suite.tokenizer
    judge = suite.judge(model, tokenizer, cfg["model"]["name"], cfg["device"])
    segment = f"{socket.gethostname()}:{os.getpid()}:{time.time():.0f}"  # this process's part of the run
    code = results.git_state()  # each row names the code that wrote it (a run may be resumed by other code)
    for sample in _progress(todo, cfg, p.run_dir):
        torch.manual_seed(cfg.get("seed", 0))
        probe = _probe(cfg, suite, sample)
        method = p.method(len(sample.prompt_ids))
        gen = generate(model, tokenizer, method, sample.prompt_ids,
                       sample.max_new_tokens, decode_ids=sample.decode_ids, stop=sample.stop,
                       ignore_eos=sample.ignore_eos, stop_token_ids=sample.stop_token_ids,
                       min_new_tokens=sample.min_new_tokens, profile=bool(cfg.get("profile")),
                       sampling=sample.sampling, eos_token_ids=sample.eos_token_ids, probe=probe,
                       prefilled=p.prefill)
        timing = dict(gen.timing(), peak_memory_bytes=peak_memory_bytes(), segment=segment, **code,
                      # the budget holds every prompt and generated token: nothing was evicted or left unselected
                      budget_covers_context=method.budget is not None
                      and method.budget >= gen.n_prompt_tokens + len(gen.token_ids))
        row = {"id": sample.id, "task": sample.task, "prediction": gen.text, "reference": sample.reference,
               "scores": suite.score(sample, gen.text, judge), "meta": sample.meta, "timing": timing,
               "output_ids": list(gen.token_ids)}  # the generated ids (final EOS dropped): evals/output/agreement.py
        record = results.method_record(method, p.method_name)
        if record != p.resolved_method:  # a fractional budget: this prompt's own budget and presets
            row["method"] = record
        if gen.method_bound:  # fields resolved from the model (e.g. layer ids scaled to its depth)
            row["method_bound"] = gen.method_bound
        if probe is not None:
            row["recall"] = gen.recall
        run.append(row)
        if on_row is not None:
            on_row(row)


def resolved_record(p: Plan, suite) -> dict:
    """``resolved.json``: what the run computes and with which code. ``method``: every init field of the method
    as constructed, presets resolved (with a fractional budget, as built for a
    :data:`~evals.output.results.PLAN_PROMPT_TOKENS`-token prompt; each row built otherwise holds its own under
    ``method``); ``suite``: its options after defaults and its version; ``model``: :func:`model_record`;
    ``provenance``: commit, dirty flag and environment of this process (:func:`evals.output.timing.provenance`)."""
    options = suite.options if dataclasses.is_dataclass(getattr(suite, "options", None)) else None
    return {"method": p.resolved_method,
            "suite": {"name": p.cfg["eval"]["name"], **(dataclasses.asdict(options) if options else {}),
                      "version": getattr(suite, "version", None)},
            "model": model_record(p.cfg["model"]), "provenance": provenance(run_environment(p.cfg))}


def model_record(model: dict) -> dict:
    """The model a run loads: its name, source, path (a folder or a hub id), the folder its files were found in
    (a hub snapshot's folder name is its revision) and :func:`checkpoint_checksum`. Tiny and random models,
    whose weights are drawn from the seed, are identified by a sha256 of their ``config.json``."""
    name, entry = model["name"], model_entry(model["name"], model.get("path"))
    if entry.source in ("tiny", "random"):
        config = tiny_config(name) if entry.source == "tiny" else RANDOM_CONFIGS[name]()
        checksum = "config-sha256:" + hashlib.sha256(config.to_json_string().encode()).hexdigest()
        return {"name": name, "source": entry.source, "path": None, "folder": None, "checksum": checksum}
    where = resolve_path(name, model.get("path"))
    folder = _checkpoint_folder(where)
    return {"name": name, "source": entry.source, "path": where, "folder": None if folder is None else str(folder),
            "checksum": "unknown" if folder is None else checkpoint_checksum(folder)}


def _checkpoint_folder(where: str) -> Path | None:
    """A local checkpoint folder, or the hub cache's snapshot folder of a hub id (None if not cached)."""
    if Path(where).is_dir():
        return Path(where)
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(where, "config.json")
    return Path(found).parent if isinstance(found, str) else None


def checkpoint_checksum(folder: Path) -> str:
    """``sha256:`` of a checkpoint's ``config.json`` bytes and each weight file's name, size and modification
    time (``*.safetensors``, ``*.bin``): cheap at any size, as no weight is read; a rewritten file changes it,
    and so may a copy of the same weights that does not keep the modification times."""
    config = folder / "config.json"
    digest = hashlib.sha256(config.read_bytes() if config.is_file() else b"")
    for file in sorted([*folder.glob("*.safetensors"), *folder.glob("*.bin")]):
        stat = file.stat()
        digest.update(f"{file.name}:{stat.st_size}:{stat.st_mtime_ns}\n".encode())
    return "sha256:" + digest.hexdigest()


def _probe(cfg: dict, suite, sample) -> RecallProbe | None:
    """The ``diagnostics=recall`` probe of one sample (following its needle tokens), or None."""
    diagnostics = cfg.get("diagnostics")
    if not diagnostics:
        return None
    return RecallProbe(every=diagnostics.get("every", 1), needle=suite.needle_positions(sample))


def _progress(items, cfg, run_dir):
    """A tqdm bar on a TTY; otherwise (cluster logs) a plain line at most every 60 s. ``progress=false``
    silences both."""
    show = cfg.get("progress", "auto")
    if show is False or show == "false":
        return items
    label = "/".join(run_dir.parts[-3:])
    if sys.stderr.isatty() or show is True:
        from tqdm import tqdm
        return tqdm(items, desc=label, unit="sample")
    return _log_lines(items, label)


def _log_lines(items, label, every_s: float = 60.0):
    start = last = time.monotonic()
    for done, item in enumerate(items):
        yield item
        now = time.monotonic()
        if now - last >= every_s or done + 1 == len(items):
            eta = (now - start) / (done + 1) * (len(items) - done - 1)
            print(f"[{label}] {done + 1}/{len(items)} samples, ETA {eta / 60:.1f} min", file=sys.stderr, flush=True)
            last = now
