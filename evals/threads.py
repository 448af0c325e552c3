"""Threads and OpenMP waiting of a run, chosen when ``run.py`` starts, from how busy the machine is.

torch and numba each keep an OpenMP pool whose idle threads spin (libgomp's default) before they sleep. Alone on
its cores that is the fastest; beside other CPU-bound processes the spinning threads take the cores the others
need: ``k`` evaluations at once each run far more than ``k`` times slower than alone (docs/benchmarks.md, "Threads
and OpenMP waiting"). So :func:`at_startup` looks at the machine before torch and numba are imported (libgomp reads
``OMP_WAIT_POLICY``, ``GOMP_SPINCOUNT`` and ``OMP_NUM_THREADS`` when it loads):

- cores: the CPUs this process may run on (``os.sched_getaffinity``, else ``os.cpu_count``);
- others: the runnable threads of the machine besides this one, the first number of ``/proc/loadavg``'s
  fourth field (``R/T``) minus this process, the median of :data:`SAMPLES` readings :data:`SAMPLE_GAP_S` apart.
  An instantaneous count sees a CPU-bound process at once (the 1-minute load average takes a minute to); it
  counts the whole machine, so it is scaled by ``cores / online CPUs`` when this process may use only some of
  them. A niced process counts as a whole competitor. Without ``/proc/loadavg`` (macOS, some sandboxes) the
  load is unknown and the run keeps the alone behaviour;
- jobs: the jobs of a ``-m`` sweep that run at once (``hydra/launcher=local`` starts a batch of jobs together;
  ``hydra.sweeper.max_batch_size`` bounds the batch; the basic launcher runs one at a time).

:func:`decide`: ``sharers = jobs + others`` processes share the cores. Alone (``sharers == 1``) the libraries keep
their defaults (every core, spinning). Otherwise each process gets ``max(1, cores // sharers)`` threads, and its
idle threads sleep at once (``OMP_WAIT_POLICY=PASSIVE``) when the sharers outnumber the cores (each passive
parallel region then pays a thread wake-up instead of starving the others). The settings
``threads: auto|<n>`` and ``omp_wait: auto|spin|passive`` (conf/config.yaml) force either; ``OMP_NUM_THREADS``,
``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` in the environment win over both. The choice is exported to the
environment for the job processes of a sweep (:data:`PLAN_VAR`), applied per job by :func:`for_job` and recorded
in ``timing.json`` (``environment.thread_choice``, :func:`record`).
"""
from __future__ import annotations

import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .task import ConfigError

OMP_WAIT_CHOICES = ("auto", "spin", "passive")
WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")  # how libgomp's idle threads wait, read when it loads
LOADAVG = Path("/proc/loadavg")
SAMPLES, SAMPLE_GAP_S = 5, 0.02  # /proc/loadavg readings per decision, and the seconds between two of them
PLAN_VAR = "ICECACHE_THREAD_CHOICE"  # the start-up choice (JSON), inherited by a sweep's job processes
LOCAL_LAUNCHERS = ("local", "submitit_local")  # conf/hydra/launcher/local.yaml: jobs of a batch run at once

_startup: Choice | None = None
_job: Choice | None = None


@dataclass(frozen=True)
class Load:
    """What competes for this process's cores."""

    cores: int  # CPUs this process may run on
    online: int  # CPUs of the machine, the scope of /proc/loadavg
    runnable_others: int | None  # runnable threads of the machine besides this process; None: unknown
    jobs: int = 1  # jobs of a sweep running at once, this one included

    @property
    def sharers(self) -> int:
        """Processes that share this process's cores, itself and its sibling jobs included."""
        others = self.runnable_others or 0
        return self.jobs + round(others * self.cores / max(self.online, self.cores))


@dataclass(frozen=True)
class Choice:
    """Threads per pool (None: the libraries' defaults, every core) and OpenMP waiting (``spin``, ``passive``,
    or the environment's rule as :func:`environment_wait` names it), each with what chose it (``auto``,
    ``config`` or ``environment``), and the load behind them."""

    threads: int | None
    omp_wait: str
    threads_by: str
    omp_wait_by: str
    load: Load

    @property
    def adapted(self) -> bool:
        """The load, not a setting, moved the run off the alone behaviour."""
        return ((self.threads_by == "auto" and self.threads is not None)
                or (self.omp_wait_by == "auto" and self.omp_wait != "spin"))

    def as_record(self) -> dict:
        return {"threads": self.threads, "omp_wait": self.omp_wait, "threads_by": self.threads_by,
                "omp_wait_by": self.omp_wait_by, **asdict(self.load), "sharers": self.load.sharers}

    @classmethod
    def from_record(cls, rec: dict) -> Choice:
        load = Load(rec["cores"], rec["online"], rec["runnable_others"], rec["jobs"])
        return cls(rec["threads"], rec["omp_wait"], rec["threads_by"], rec["omp_wait_by"], load)


# ---------------------------------------------------------------- the machine
def usable_cores() -> int:
    """The CPUs this process may run on (its affinity mask; ``os.cpu_count`` where there is none)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def runnable_others(path: Path = LOADAVG, samples: int = SAMPLES, gap_s: float = SAMPLE_GAP_S) -> int | None:
    """Runnable threads of the machine besides this one: the median over ``samples`` readings of the ``R`` in
    ``/proc/loadavg``'s ``R/T`` field, minus 1 (the reading thread); None when the file is absent or unreadable."""
    counts = []
    for i in range(samples):
        try:
            running = int(path.read_text().split()[3].split("/")[0])
        except (OSError, IndexError, ValueError):
            return None
        counts.append(max(0, running - 1))
        if i + 1 < samples:
            time.sleep(gap_s)
    return round(statistics.median(counts))


def detect(jobs: int = 1, path: Path = LOADAVG) -> Load:
    """The load on this process's cores now."""
    return Load(usable_cores(), os.cpu_count() or 1, runnable_others(path), jobs)


# ---------------------------------------------------------------- the choice
def environment_wait(environ=os.environ) -> str:
    """How idle OpenMP threads wait under ``environ``: ``spin N`` when ``GOMP_SPINCOUNT`` sets it, else
    ``OMP_WAIT_POLICY`` lower-cased, or ``default`` (libgomp's ~300k-iteration spin, then sleep)."""
    spin = environ.get("GOMP_SPINCOUNT")
    return f"spin {spin}" if spin else environ.get("OMP_WAIT_POLICY", "default").lower()


def _environment_threads(environ) -> int | None:
    """The thread count ``OMP_NUM_THREADS`` gives (its first level), or None."""
    try:
        return max(1, int(environ["OMP_NUM_THREADS"].split(",")[0]))
    except (KeyError, ValueError):
        return None


def decide(threads="auto", omp_wait="auto", load: Load | None = None, environ=os.environ) -> Choice:
    """The threads and OpenMP waiting for ``load`` (the module docstring's rule); an explicit setting
    (``threads`` a whole number, ``omp_wait`` spin or passive) wins over the load, the environment over both."""
    load = load or detect()
    sharers = load.sharers
    if "OMP_NUM_THREADS" in environ:
        n, threads_by = _environment_threads(environ), "environment"
    elif isinstance(threads, int) and not isinstance(threads, bool) and threads >= 1:
        n, threads_by = threads, "config"
    else:
        n, threads_by = (max(1, load.cores // sharers) if sharers > 1 else None), "auto"
    if any(environ.get(var) for var in WAIT_VARS):
        wait, wait_by = environment_wait(environ), "environment"
    elif omp_wait in ("spin", "passive"):
        wait, wait_by = omp_wait, "config"
    else:
        wait, wait_by = ("passive" if sharers > load.cores else "spin"), "auto"
    return Choice(n, wait, threads_by, wait_by, load)


# ---------------------------------------------------------------- start-up (before torch and numba load)
def _value(text: str):
    """A setting's value as Hydra reads a plain word: an int, or the text."""
    return int(text) if text.lstrip("-").isdigit() else text


def _sweep_sizes(overrides: list[str]) -> tuple[list[int], set[str]]:
    """The number of values of each swept override and the keys they sweep (Hydra's override parser)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception:  # run.py reports the unreadable override
        return [], set()
    sizes, keys = [], set()
    for override in parsed:
        if override.is_sweep_override():
            keys.add(override.key_or_group)
            try:
                sizes.append(len(list(override.sweep_string_iterator())))
            except Exception:  # glob(...) and other sweeps Hydra expands against the config
                sizes.append(1)
    return sizes, keys


def startup_settings(argv: list[str], conf_dir: Path) -> tuple:
    """``(threads, omp_wait, jobs at once)`` from conf/config.yaml and the command line, read without composing
    (a swept or unreadable setting counts as ``auto``; each job applies its own: :func:`for_job`)."""
    import yaml

    try:
        base = yaml.safe_load((conf_dir / "config.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        base = {}
    settings = {"threads": base.get("threads", "auto"), "omp_wait": base.get("omp_wait", "auto")}
    launcher = next((entry.get("override hydra/launcher") for entry in base.get("defaults", [])
                     if isinstance(entry, dict) and "override hydra/launcher" in entry), "basic")
    overrides = [a for a in argv if "=" in a and not a.startswith("-")]
    sizes, swept = _sweep_sizes(overrides)
    batch = None
    for text in overrides:
        key, value = text.lstrip("+~").split("=", 1)
        if key in settings:
            settings[key] = "auto" if key in swept else _value(value)
        elif key == "hydra/launcher":
            launcher = value
        elif key == "hydra.sweeper.max_batch_size" and value.isdigit():
            batch = int(value)
    jobs = 1
    if ("-m" in argv or "--multirun" in argv) and launcher in LOCAL_LAUNCHERS:
        jobs = max(1, min(math.prod(sizes), batch or math.prod(sizes)))
    omp_wait = settings["omp_wait"] if settings["omp_wait"] in OMP_WAIT_CHOICES else "auto"
    return settings["threads"], omp_wait, jobs


def at_startup(argv: list[str], conf_dir: Path, environ=os.environ, loadavg: Path = LOADAVG) -> Choice:
    """Decides from the settings and the load, then exports the choice for libgomp and numba (idle threads
    passive: ``OMP_WAIT_POLICY=PASSIVE``; a thread count: ``OMP_NUM_THREADS`` and ``NUMBA_NUM_THREADS``, unless
    set) and for a sweep's job processes (:data:`PLAN_VAR`). Call it before torch and numba are imported."""
    global _startup
    threads, omp_wait, jobs = startup_settings(argv, conf_dir)
    choice = decide(threads, omp_wait, detect(jobs, loadavg), environ)
    if choice.omp_wait == "passive" and choice.omp_wait_by != "environment":
        environ["OMP_WAIT_POLICY"] = "PASSIVE"
    if choice.threads is not None and choice.threads_by != "environment":
        environ["OMP_NUM_THREADS"] = str(choice.threads)
        environ.setdefault("NUMBA_NUM_THREADS", str(choice.threads))
    environ[PLAN_VAR] = json.dumps(choice.as_record())
    _startup = choice
    return choice


# ---------------------------------------------------------------- each job (torch and numba loaded)
def startup_choice(environ=os.environ) -> Choice | None:
    """This process's start-up choice, or its sweep parent's (:data:`PLAN_VAR`); None when run.py did not start
    this process."""
    if _startup is not None:
        return _startup
    try:
        return Choice.from_record(json.loads(environ[PLAN_VAR]))
    except (KeyError, ValueError, TypeError):
        return None


def check_thread_settings(cfg: dict) -> None:
    """``threads``: auto or a whole number >= 1; ``omp_wait``: auto, spin or passive. Raises :class:`ConfigError`
    (:func:`evals.config.check_config` runs this check too)."""
    threads = cfg.get("threads", "auto")
    if threads != "auto" and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 1):
        raise ConfigError(f"threads must be auto or a whole number >= 1, got {threads!r}")
    if cfg.get("omp_wait", "auto") not in OMP_WAIT_CHOICES:
        raise ConfigError(f"omp_wait must be {', '.join(OMP_WAIT_CHOICES[:-1])} or {OMP_WAIT_CHOICES[-1]}, "
                          f"got {cfg.get('omp_wait')!r}")


def for_job(cfg: dict, environ=os.environ) -> str | None:
    """Applies the job's threads (its ``threads`` setting, which may differ per job of a sweep, else the
    start-up choice) to torch and numba, checks its ``omp_wait`` against the one the process started with, and
    keeps the choice for :func:`record`. Returns the line to print when the load changed the behaviour."""
    global _job
    check_thread_settings(cfg)
    threads, omp_wait = cfg.get("threads", "auto"), cfg.get("omp_wait", "auto")
    base = startup_choice(environ) or _late_choice(threads, environ)
    if isinstance(threads, int) and base.threads_by != "environment":
        base = Choice(threads, base.omp_wait, "config", base.omp_wait_by, base.load)
    if omp_wait != "auto" and base.omp_wait_by != "environment" and omp_wait != base.omp_wait:
        raise ConfigError(f"omp_wait={omp_wait}, but this process's OpenMP waiting is {base.omp_wait}: libgomp reads "
                          "it when the process starts, so a sweep runs one omp_wait (one sweep per value)")
    if base.threads is not None:
        set_threads(base.threads)
    _job = base
    return describe(base) if base.adapted else None


def _late_choice(threads, environ) -> Choice:
    """The choice in a process run.py did not start: threads from the load, the waiting the environment gave
    libgomp when it loaded (too late to change)."""
    choice = decide(threads, "auto", detect(), environ)
    wait = environment_wait(environ)
    if wait == "default":
        return Choice(choice.threads, "spin", choice.threads_by, "auto", choice.load)
    return Choice(choice.threads, wait, choice.threads_by, "environment", choice.load)


def set_threads(n: int) -> None:
    """``n`` threads for torch's pool and numba's (IceCache's search, MagicPIG's buckets), within numba's launch
    count."""
    import numba
    import torch

    torch.set_num_threads(n)
    numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))


def describe(choice: Choice) -> str:
    """One line: the choice and why."""
    load = choice.load
    n = load.runnable_others
    others = "load unknown" if n is None else f"{n} other runnable thread{'s' if n != 1 else ''}"
    jobs = f", {load.jobs} jobs at once" if load.jobs > 1 else ""
    return (f"threads: {choice.threads} per pool, OpenMP waiting {choice.omp_wait} ({others}{jobs} on "
            f"{load.cores} core{'s' if load.cores != 1 else ''}; threads=<n> and omp_wait=spin|passive choose)")


def record() -> dict | None:
    """The running job's choice for ``timing.json`` (None outside run.py)."""
    choice = _job or startup_choice()
    return None if choice is None else choice.as_record()
