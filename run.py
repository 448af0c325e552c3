"""Hydra entry point: ``python run.py eval=longbench cache=icecache budget=64``.

Composes the config, validates it (types, ranges, names, device, paths, data; evals/config.py)
before loading anything heavy, runs the suite and prints ``results: <run dir>`` as its last line. It
writes nothing outside the run directory (no ``outputs/`` folder; a sweep's ``multirun.yaml`` and launcher
logs go under ``<results_dir>/sweeps/``; conf/config.yaml). User errors print one line and exit 2: a bad
value, and before Hydra composes anything, an unknown group option (``cache=icecahe``: the nearest name and
the valid ones), an unknown key (``cache.page_sise=8``: the nearest key and the valid ones), an override that
cannot be parsed, an unknown flag, or a list of values without ``-m`` (:func:`command_line_error`); ``-m`` may
come anywhere on the command line (:func:`settings_first`). ``debug=true`` or
``HYDRA_FULL_ERROR=1`` shows the traceback. In a sweep (``-m``) a user error found while a job runs is also
raised, so the launcher (basic or submitit) records that job as failed, the other jobs still run, and Hydra
reports the failed overrides at the end (exit status 1). Ctrl-C prints one line (the run directory and how
many samples it keeps; rerunning the same command resumes) and exits 2, the status of every
user-side stop (a script tells "the user stopped or mistyped it" from a crash by exit 2 alone).
"""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path


def _interrupted_at_start(signum, frame):
    print("interrupted before the run started: nothing was written", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":  # Ctrl-C while the imports below load (seconds) is one line too
    signal.signal(signal.SIGINT, _interrupted_at_start)
    # Threads and OpenMP waiting, chosen from the load before torch and numba load (libgomp reads its
    # environment then): alone every core, spinning; beside other busy processes or parallel sweep jobs a share
    # of the cores, idle threads passive. threads=<n> and omp_wait=spin|passive force a choice; OMP_NUM_THREADS,
    # OMP_WAIT_POLICY and GOMP_SPINCOUNT in the environment win (evals/threads.py, docs/benchmarks.md).
    from evals import threads as _threads
    _threads.at_startup(sys.argv[1:], Path(__file__).resolve().parent / "conf")

import difflib  # noqa: E402
import itertools  # noqa: E402

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from hydra.types import RunMode  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402
from omegaconf.errors import OmegaConfBaseException  # noqa: E402

from evals.config import register  # noqa: E402

register()  # the cache/<method> and eval/<suite> groups, generated from the dataclasses

REPO = Path(__file__).resolve().parent
# A relative results_dir resolves against the repository root (evals/harness.py); so does the sweep dir under it.
OmegaConf.register_new_resolver("repo_path", lambda p: str(p if Path(p).is_absolute() else REPO / p), replace=True)
NAMED_GROUPS = ("model", "cache", "eval")  # groups whose node records the chosen option as ``name``
MAX_SWEEP_CHECKS = 64  # sweep combinations composed up front (each takes ~0.1 s)
VALUE_FLAGS = ("-c", "--cfg", "-p", "--package", "-cp", "--config-path", "-cn", "--config-name", "-cd",
               "--config-dir", "--experimental-rerun")  # Hydra's flags that take the next word as their value


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> str:
    from evals import threads
    from evals.harness import USER_ERRORS, run_eval
    from evals.output.summary import print_run

    debug = cfg.get("debug") is True or os.environ.get("HYDRA_FULL_ERROR") == "1"
    multirun = HydraConfig.get().mode == RunMode.MULTIRUN
    plain = None
    try:
        plain = OmegaConf.to_container(cfg, resolve=True)
        adapted = threads.for_job(plain)  # this job's threads; omp_wait checked against the start-up's
        if adapted:
            print(adapted)
        run_dir = run_eval(plain)  # config.yaml records the validated config (device=auto resolved)
    except (*USER_ERRORS, OmegaConfBaseException) as err:
        if debug:
            raise
        print(f"error: {_one_line(err)}", file=sys.stderr)
        if multirun:
            raise  # the launcher records this job as failed; the sweep's other jobs still run
        sys.exit(2)
    except KeyboardInterrupt:
        if debug:
            raise
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C does not cut the one line short
        print(interrupted(plain, multirun), file=sys.stderr)
        sys.exit(2)
    print_run(run_dir)
    print(f"results: {run_dir}")
    return str(run_dir)


def interrupted(plain: dict | None, multirun: bool = False) -> str:
    """The line printed on Ctrl-C: what the run directory keeps and how to resume."""
    from evals import harness
    from evals.output import results

    again = "rerun the same command to resume" + (" (finished jobs and samples are skipped)" if multirun else
                                                   " (finished samples are skipped)")
    try:
        run_dir = harness.plan(plain).run_dir
    except Exception:
        return "interrupted before the run started: nothing was written"
    n = len(results.load_predictions(run_dir / "predictions.jsonl"))
    if n == 0:
        return f"interrupted before the first sample finished: nothing was saved; {again}"
    return f"interrupted: {run_dir} keeps the {n} finished sample{'s' if n != 1 else ''}; {again}"


def _one_line(err: BaseException) -> str:
    """An error message on one line (OmegaConf adds ``full_key``/``object_type`` lines; Hydra a search path)."""
    lines = [line.strip() for line in str(err).split("Config search path:")[0].splitlines()]
    lines = [line for line in lines if line and not line.startswith(("full_key:", "object_type=", "See https://"))]
    text = "; ".join(lines) if lines else err.__class__.__name__
    full_key = getattr(err, "full_key", None)
    return f"{full_key}: {text}" if isinstance(err, OmegaConfBaseException) and full_key else text


# ---------------------------------------------------------------- command-line mistakes, before Hydra composes
def command_line_error(argv: list[str]) -> str | None:
    """The one-line error of a command line that Hydra would refuse to compose, or None (also when the command
    line is Hydra's business: ``--help``, ``--info``, other config files). Each combination of a sweep's group
    choices (``-m cache=full,icecache``) is composed, up to :data:`MAX_SWEEP_CHECKS`."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException, OverrideParseException

    args, problem = _read_flags(settings_first(argv))
    if problem:
        return problem
    if any(getattr(args, flag, None) for flag in ("help", "hydra_help", "info", "shell_completion",
                                                   "experimental_rerun", "config_path", "config_name",
                                                   "config_dir")):
        return None
    try:
        parsed = OverridesParser.create().parse_overrides(args.overrides)
    except OverrideParseException as err:
        reason = err.message.splitlines()[0] if err.message else "not key=value"
        return (f"cannot read the override {err.override!r}: {reason} (the override grammar: "
                "https://hydra.cc/docs/advanced/override_grammar/basic/)")
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        loader = GlobalHydra.instance().config_loader()
        fixed, sweeps = [], []
        for text, override in zip(args.overrides, parsed):
            if not override.is_sweep_override():
                fixed.append(text)
                continue
            key = override.get_key_element()
            try:
                values = list(override.sweep_string_iterator())
            except HydraException:  # glob(...) and other sweeps Hydra expands itself
                return None
            if not args.multirun:
                return (f"{text} lists several values: add -m to sweep over them (python run.py -m {text} ...), "
                        f"or write '{key}=[{','.join(values)}]' for one list value")
            if loader.get_group_options(override.key_or_group):  # a group choice: check every option
                sweeps.append([f"{key}={v}" for v in values])
            else:  # any one value composes the same structure; each job checks its own value
                fixed.append(f"{key}={values[0]}")
        for combo in itertools.islice(itertools.product(*sweeps), MAX_SWEEP_CHECKS):
            problem = _compose_error(compose, [*fixed, *combo])
            if problem:
                return problem + (f" (in the sweep's job {' '.join(combo)})" if combo else "")
    return None


def _read_flags(argv: list[str]):
    """Hydra's reading of a command line: ``(its argparse namespace, None)`` or ``(None, the one-line error)``
    for an unknown flag, a flag without its value or with a bad one, or two flags that exclude each other."""
    import contextlib
    import io

    from hydra._internal.utils import get_args_parser

    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            args, extra = get_args_parser().parse_known_args(argv)
    except SystemExit:  # argparse's last line, without the usage text
        reason = (said.getvalue().strip().splitlines() or ["cannot read the command line"])[-1]
        return None, f"{reason.split(': error: ', 1)[-1]} (python run.py --hydra-help lists the flags)"
    if extra:
        return None, (f"unknown flag {' '.join(extra)}: settings are key=value (python run.py eval=passkey "
                      "budget=64); python run.py --hydra-help lists the flags")
    modes = [flag for flag, on in (("--run", args.run), ("--multirun", args.multirun), ("--cfg", args.cfg),
                                   ("--info", args.info), ("--shell-completion", args.shell_completion)) if on]
    if len(modes) > 1:
        return None, f"{' and '.join(modes)} exclude each other: give one of them"
    return args, None


def _compose_error(compose, overrides: list[str]) -> str | None:
    from hydra.errors import ConfigCompositionException, HydraException, MissingConfigException

    try:
        compose("config", overrides=overrides)
    except MissingConfigException as err:
        return _unknown_option(err) or _one_line(err)
    except ConfigCompositionException as err:
        return _unknown_key(err.__cause__, compose, overrides) or _one_line(err)
    except (HydraException, OmegaConfBaseException) as err:
        return _one_line(err)
    return None


def _unknown_option(err) -> str | None:
    """``cache=icecahe``: the nearest option of the group and all of them."""
    group, _, name = (err.missing_cfg_file or "").rpartition("/")
    options = list(err.options or [])
    if not group or not options:
        return None
    near = difflib.get_close_matches(name, options, n=1)
    hint = f": did you mean {group}={near[0]}?" if near else ";"
    return f"{group}={name} is not an option of {group}{hint} {group} options: {', '.join(options)}"


def _unknown_key(cause, compose, overrides: list[str]) -> str | None:
    """``cache.page_sise=8``: the group (and its chosen option), the nearest key and the valid keys."""
    full_key, node = getattr(cause, "full_key", None), getattr(cause, "parent_node", None)
    if not isinstance(full_key, str) or node is None or not hasattr(node, "keys"):
        return None
    parent, _, key = full_key.rpartition(".")
    valid = sorted(str(k) for k in node.keys() if parent or k != "hydra")
    typed = next((o for o in overrides if o.split("=", 1)[0] == full_key), f"{full_key}=")
    value = typed.split("=", 1)[1]
    near = difflib.get_close_matches(key, valid, n=1)
    name = node.get("name") if parent in NAMED_GROUPS else None
    where = f"{parent}={name}" if isinstance(name, str) else parent
    if near:
        hint = f"did you mean {parent + '.' if parent else ''}{near[0]}={value}?"
    else:
        hint = _hint_elsewhere(parent, where, key, value, compose, [o for o in overrides if o != typed])
    hint = f" ({hint})" if hint else ""
    if not parent:
        return f"there is no setting {key!r}{hint}; the settings: {', '.join(valid)}"
    return f"{where} has no option {key!r}{hint}; {where} options: {', '.join(valid)}"


def _hint_elsewhere(parent: str, where: str, key: str, value: str, compose, overrides: list[str]) -> str | None:
    """``cache.budget=64`` is the top-level ``budget=64``; ``cache.page_sise`` under ``cache=full`` is close to
    an option of other methods (``cache=icecache cache.page_size=8``)."""
    from evals import config, registry

    try:
        top = [k for k in compose("config", overrides=overrides) if k != "hydra"]
    except Exception:
        top = []
    if key in top:
        return f"did you mean {key}={value}? {key} is a top-level setting"
    if parent not in ("cache", "eval"):
        return None
    table = registry.METHODS if parent == "cache" else registry.SUITES
    found: dict[str, list[str]] = {}
    for option in table:
        near = difflib.get_close_matches(key, [k for k in config.defaults(parent, option) if k != "name"], n=1)
        if near:
            found.setdefault(near[0], []).append(option)
    if not found:
        return None
    best = difflib.get_close_matches(key, list(found), n=1)[0]
    owners = f"{parent}={', '.join(found[best])}"
    if best == key:
        return f"{key} is an option of {owners}, not of {where}"
    return f"did you mean {parent}.{best}={value}, an option of {owners}?"


def settings_first(argv: list[str]) -> list[str]:
    """The command line with the settings before Hydra's flags (``-m``, ``-c job``, ...): its parser reads the
    settings on one side of the flags only, so ``run.py eval=passkey -m budget=32,64`` would otherwise fail
    with the whole usage text (and a trailing ``--info`` takes no setting as its value). A setting never
    starts with ``-``; ``--info``'s optional value is a word without ``=``."""
    flags, settings, i = [], [], 0
    while i < len(argv):
        token = argv[i]
        if not token.startswith("-"):
            settings.append(token)
            i += 1
            continue
        follows = argv[i + 1] if i + 1 < len(argv) else None
        takes_value = token in VALUE_FLAGS or (token in ("-i", "--info") and follows is not None
                                                and "=" not in follows and not follows.startswith(("-", "~")))
        flags += argv[i:i + 1 + takes_value]
        i += 1 + takes_value
    return settings + flags


def options_of_swept_groups(argv: list[str]) -> list[str]:
    """The command line with each option of a swept group (``cache.budget_layout=fixed`` beside ``-m
    cache=icecache,page_oracle``) written ``++cache.budget_layout=fixed``. Hydra composes a multirun's first
    config with the group's default in place of the swept choice (``cache=full``), which lacks the option and
    refuses it; ``++`` sets it there and in every job. :func:`command_line_error` has composed each job with the
    option as written, so an option that one of the swept choices lacks is still refused."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType

    args, problem = _read_flags(argv)
    if problem or not args.multirun:
        return argv
    try:
        parsed = OverridesParser.create().parse_overrides(args.overrides)
    except Exception:  # command_line_error reported it
        return argv
    swept = {o.key_or_group for o in parsed if o.is_sweep_override() and "." not in o.key_or_group}
    forced = {o.input_line for o in parsed  # an option (group.key=value) of a swept group, written without + or ~
              if o.type == OverrideType.CHANGE and "." in o.key_or_group and o.key_or_group.split(".")[0] in swept}
    return [f"++{token}" if token in forced else token for token in argv]


if __name__ == "__main__":
    sys.argv[1:] = settings_first(sys.argv[1:])
    if os.environ.get("HYDRA_FULL_ERROR") != "1":
        problem = command_line_error(sys.argv[1:])
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            sys.exit(2)
    sys.argv[1:] = options_of_swept_groups(sys.argv[1:])
    signal.signal(signal.SIGINT, signal.default_int_handler)  # KeyboardInterrupt: main() reports the run
    try:
        main()
    except KeyboardInterrupt:  # while Hydra composes, before main() starts the run
        print("interrupted before the run started: nothing was written", file=sys.stderr)
        sys.exit(2)
