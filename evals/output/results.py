"""Run directories: one per (eval, model, cache, budget, other overrides), derived from the config.

Layout: ``<results_dir>/<eval>/<model>/<cache>-b<budget>[-limit<N>]-<hash of other settings>/`` holding
``predictions.jsonl`` (appended, flushed and fsynced per sample; a rerun skips finished ids),
``metrics.json``, ``timing.json`` and ``config.yaml`` (atomic writes, readable by the group and others
as the umask allows). A directory written by a different config is never reused: ``config_hash`` is
checked. ``limit`` selects the samples, so it is part of a run's identity when set: a limited run has a
directory of its own (``-limit<N>`` in its name, the limit in its hash) and never mixes with the whole run,
and a rerun with the same limit resumes it; a run without limit keeps the identity it had before ``limit``
counted (:data:`SET_ONLY`).

Provenance: ``resolved.json`` records what ran (:func:`resolved_record`): the method as constructed (every
init field after its presets resolved), the suite's options, the model's path and checksum, and the commit,
dirty flag and environment of the process that last wrote rows; every row's timing names its commit. The
identity of a run (directory name and ``config_hash``) is its config with the ``cache`` group replaced by the
method's resolved fields (:func:`resolved_method`), so a change of a preset or a default that changes what a
method computes gives a new directory, while spelling a default out (``cache.page_size=8`` where the preset
resolves to 8) is the same run.

Integrity: one process at a time writes a run directory (an exclusive ``flock`` on ``.lock``; a second
process waits for it). A torn last line (a kill mid-write) is dropped; a malformed line elsewhere is moved
to ``predictions.quarantine.jsonl`` and reported, and every valid row around it is kept.
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import fields
from pathlib import Path

# Settings that do not change what a run computes, hence not part of its identity. ``official_source``: where a
# suite's official setting of the method came from (conf/suite_cache/); the values themselves are in ``cache``.
NON_SEMANTIC = ("results_dir", "data_dir", "wandb", "hydra", "debug", "progress", "profile", "threads",
                "omp_wait", "official_source")
# Settings that are part of a run's identity only when set (None: the default, left out of the identity).
SET_ONLY = ("limit",)
QUARANTINE = "predictions.quarantine.jsonl"
RESOLVED = "resolved.json"
REPO_ROOT = Path(__file__).resolve().parents[2]
PLAN_PROMPT_TOKENS = 1 << 20  # the prompt length a fractional budget is resolved at before any prompt is known
METHOD_TOP_LEVEL = ("budget", "debug")  # method fields set by top-level settings (budget: the name; debug: none)


class RunDirError(RuntimeError):
    """A run directory that belongs to another configuration, or that cannot be written."""


def canonical(value):
    """Numbers in one spelling: a whole float is an int (``budget=64.0`` is the run ``budget=64``)."""
    if isinstance(value, dict):
        return {k: canonical(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [canonical(v) for v in value]
    if isinstance(value, float) and math.isfinite(value) and value == int(value):
        return int(value)
    return value


def _semantic(cfg: dict, drop: tuple[str, ...] = ()) -> str:
    """The settings that define what a run computes, as canonical JSON: the config without
    :data:`NON_SEMANTIC` keys (nor :data:`SET_ONLY` keys that are None), its ``cache`` group replaced by the
    method's resolved fields."""
    method = resolved_method(cfg) if isinstance(cfg.get("cache"), dict) else None
    if method is not None:
        cfg = dict(cfg, cache={k: v for k, v in method.items() if k not in METHOD_TOP_LEVEL})
    kept = {k: v for k, v in canonical(cfg).items()
            if k not in NON_SEMANTIC and k not in drop and not (k in SET_ONLY and v is None)}
    return json.dumps(kept, sort_keys=True, default=str)


def config_hash(cfg: dict) -> str:
    return hashlib.sha256(_semantic(cfg).encode()).hexdigest()[:12]


def run_dir_for(cfg: dict) -> Path:
    """The run directory of a resolved config (plain dict with ``eval``, ``model``, ``cache`` groups)."""
    budget, limit = canonical(cfg.get("budget")), canonical(cfg.get("limit"))
    name = f"{cfg['cache']['name']}-b{budget if budget is not None else 'none'}"
    name += f"-limit{limit}" if limit is not None else ""
    name += "-" + hashlib.sha256(_semantic(cfg, drop=("budget",)).encode()).hexdigest()[:8]
    return Path(cfg["results_dir"]) / cfg["eval"]["name"] / cfg["model"]["name"] / name


# ---------------------------------------------------------------- provenance: which code and configuration ran
@functools.lru_cache(maxsize=None)
def git_state(root: Path = REPO_ROOT) -> dict:
    """``{"commit": <sha of HEAD>, "dirty": <tracked files modified>}`` of the checkout at ``root``, read once
    per process (the code a process imported is the code at its start). Untracked files do not count
    (``git status --untracked-files=no``). Both are ``"unknown"`` when ``root`` is not the top of a git
    checkout (an installed copy, no git, a repository of another owner)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "--no-optional-locks", "-C", str(root), *args], capture_output=True,
                              text=True, timeout=60, check=True).stdout
    try:
        top, commit = git("rev-parse", "--show-toplevel", "HEAD").split()
        if Path(top).resolve() != Path(root).resolve():
            raise ValueError(f"{root} is inside the checkout {top}")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no").strip())
    except (OSError, ValueError, subprocess.SubprocessError):
        return {"commit": "unknown", "dirty": "unknown"}
    return {"commit": commit, "dirty": dirty}


def method_record(method, name: str | None = None) -> dict:
    """A constructed method's configuration: every init field of its ``@dataclass`` as the instance holds it,
    i.e. after ``__post_init__`` filled the fields its preset resolves, as plain JSON values, under ``name``
    (the registry name, which may differ from the class's ``name``)."""
    values = {f.name: getattr(method, f.name) for f in fields(method) if f.init}
    return {"name": name or type(method).name, **json.loads(json.dumps(values, default=str))}


def resolved_method(cfg: dict) -> dict | None:
    """:func:`method_record` of the method a config's ``cache`` group builds at its budget (a fractional budget
    resolved for a :data:`PLAN_PROMPT_TOKENS`-token prompt, as the harness checks it), or None when the group
    cannot build one (a config the harness refuses; it is then identified by its settings as given)."""
    from ..registry import method_for_prompt

    options = dict(cfg["cache"])
    name = options.pop("name", None)
    try:
        method = method_for_prompt(name, cfg.get("budget"), PLAN_PROMPT_TOKENS, debug=bool(cfg.get("debug")), **options)
    except (TypeError, ValueError, ImportError):
        return None
    return method_record(method, name)


def row_provenance(method, name: str | None = None) -> dict:
    """What a benchmark row records to be traceable: ``commit`` and ``dirty`` (:func:`git_state`) and the
    method as constructed under ``method_config`` (:func:`method_record`)."""
    return {**git_state(), "method_config": method_record(method, name)}


def read_resolved(run_dir: Path) -> dict | None:
    """A run directory's ``resolved.json``, or None (a run written before it existed, or still starting)."""
    try:
        record = json.loads((Path(run_dir) / RESOLVED).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_text(path: Path, text: str) -> None:
    """Writes ``path`` all at once (temp file, fsync, rename) with the usual ``0666 & ~umask`` mode."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, 0o666 & ~_umask())
    os.replace(tmp, path)


def write_json(path: Path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def _lock(path: Path):
    """An exclusive lock on ``path/.lock``, waiting (with one notice) while another process holds it."""
    f = open(path / ".lock", "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "?"
        print(f"waiting: {path} is being written by another process (pid {holder})", file=sys.stderr, flush=True)
        fcntl.flock(f, fcntl.LOCK_EX)
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


class RunDir:
    """A run directory opened (and locked) for appending predictions; :meth:`close` releases it."""

    def __init__(self, path: Path, cfg: dict, config_yaml: str):
        self.path = Path(path)
        self.created = not self.path.exists()
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise RunDirError(f"cannot create the run directory {self.path}: {err.strerror}") from None
        self._lock = _lock(self.path)
        self.hash = config_hash(cfg)
        stamp = self.path / "config_hash"
        if stamp.exists() and stamp.read_text().strip() != self.hash:
            self.close()
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

    def close(self) -> None:
        if self._lock is not None and not self._lock.closed:
            self._lock.close()

    def discard_if_empty(self) -> None:
        """Removes a directory this run created and never wrote a row to (a run that failed early)."""
        if self.created and not self.rows and not self.predictions.exists():
            shutil.rmtree(self.path, ignore_errors=True)


def _parse(line: bytes) -> dict | None:
    """A prediction row, or None when the line is not a JSON object with an ``id``."""
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return row if isinstance(row, dict) and "id" in row else None


def load_predictions(path: Path, repair: bool = False) -> list[dict]:
    """Rows of a predictions file, one per id (first wins). A torn last line (no newline, as left by a
    kill mid-write) is dropped; any other line that is not a valid row is skipped. With ``repair`` the file
    is rewritten with the valid rows only and each bad line is kept in ``predictions.quarantine.jsonl``."""
    if not path.exists():
        return []
    data = path.read_bytes()
    rows, seen, kept, bad = [], set(), [], []
    for lineno, line in enumerate(data.splitlines(keepends=True), start=1):
        row = _parse(line) if line.endswith(b"\n") else None
        if row is None:
            if line.endswith(b"\n") and line.strip():
                bad.append((lineno, line))
            continue
        kept.append(line)
        if row["id"] not in seen:
            seen.add(row["id"])
            rows.append(row)
    if repair and len(b"".join(kept)) < len(data):
        _quarantine(path, bad)
        atomic_write_text(path, b"".join(kept).decode("utf-8", errors="replace"))
    return rows


def prediction_key(row: dict) -> tuple[str, int | None]:
    """The key of a row's predictions in a cache of them: its run directory and, for a view, its sample count."""
    return row["run_dir"], row.get("first_n")


def run_predictions(row: dict) -> list[dict]:
    """A row's ``predictions.jsonl`` rows: all of them, or for a view of :func:`evals.output.pairing.first_n_views` its first
    ``first_n``."""
    return load_predictions(Path(row["run_dir"]) / "predictions.jsonl")[:row.get("first_n")]


def _quarantine(path: Path, bad: list[tuple[int, bytes]]) -> None:
    if not bad:
        return
    side = path.with_name(QUARANTINE)
    with open(side, "ab") as f:
        f.write(b"".join(line for _, line in bad))
    lines = ", ".join(str(n) for n, _ in bad)
    print(f"warning: {path}: malformed line(s) {lines} moved to {side}; the valid rows are kept",
          file=sys.stderr, flush=True)
