"""Run directories: one per (eval, model, cache, budget, other overrides), derived from the config.

Layout: ``<results_dir>/<eval>/<model>/<cache>-b<budget>[-<hash of other settings>]/`` holding
``predictions.jsonl`` (appended, flushed and fsynced per sample; a rerun skips finished ids; a torn last
line from a killed run is repaired), ``metrics.json``, ``timing.json`` and ``config.yaml`` (atomic
writes). A directory written by a different config is never reused: ``config_hash`` is checked.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

# Settings that do not change what a run computes, hence not part of its identity.
NON_SEMANTIC = ("results_dir", "data_dir", "wandb", "hydra", "debug", "progress", "profile", "limit")


class RunDirError(RuntimeError):
    """A run directory that belongs to another configuration."""


def config_hash(cfg: dict) -> str:
    semantic = {k: v for k, v in cfg.items() if k not in NON_SEMANTIC}
    return hashlib.sha256(json.dumps(semantic, sort_keys=True, default=str).encode()).hexdigest()[:12]


def run_dir_for(cfg: dict) -> Path:
    """The run directory of a resolved config (plain dict with ``eval``, ``model``, ``cache`` groups)."""
    budget = cfg.get("budget")
    name = f"{cfg['cache']['name']}-b{budget if budget is not None else 'none'}"
    extras = {k: v for k, v in cfg.items() if k not in (*NON_SEMANTIC, "budget")}
    defaults_key = json.dumps(extras, sort_keys=True, default=str)
    name += "-" + hashlib.sha256(defaults_key.encode()).hexdigest()[:8]
    return Path(cfg["results_dir"]) / cfg["eval"]["name"] / cfg["model"]["name"] / name


def atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_json(path: Path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


class RunDir:
    """A run directory opened for appending predictions."""

    def __init__(self, path: Path, cfg: dict, config_yaml: str):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.hash = config_hash(cfg)
        stamp = self.path / "config_hash"
        if stamp.exists() and stamp.read_text().strip() != self.hash:
            raise RunDirError(f"{self.path} was written by a different configuration (hash {stamp.read_text().strip()}"
                              f" != {self.hash}); use another results_dir or delete that directory")
        atomic_write_text(stamp, self.hash + "\n")
        atomic_write_text(self.path / "config.yaml", config_yaml)
        self.predictions = self.path / "predictions.jsonl"
        self.rows = load_predictions(self.predictions, repair=True)

    def done_ids(self) -> set[str]:
        return {r["id"] for r in self.rows}

    def append(self, row: dict) -> None:
        line = json.dumps(row, sort_keys=True, default=str) + "\n"
        with open(self.predictions, "a") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        self.rows.append(row)


def load_predictions(path: Path, repair: bool = False) -> list[dict]:
    """Rows of a predictions file, one per id (first wins). A torn last line (no newline or not valid
    JSON, as left by a kill mid-write) is dropped and, with ``repair``, cut from the file."""
    if not path.exists():
        return []
    data = path.read_bytes()
    rows, seen, good_until = [], set(), 0
    for line in data.splitlines(keepends=True):
        try:
            if not line.endswith(b"\n"):
                raise ValueError("torn line")
            row = json.loads(line)
        except ValueError:
            break
        good_until += len(line)
        if row["id"] not in seen:
            seen.add(row["id"])
            rows.append(row)
    if repair and good_until < len(data):
        with open(path, "r+b") as f:
            f.truncate(good_until)
    return rows
