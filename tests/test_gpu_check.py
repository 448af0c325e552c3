"""scripts/gpu_check.sh, the CUDA install check: the test file it runs exists, its decode cell (both the GPU and
the ``--cpu`` one) parses as ``evals.bench.decode`` arguments naming a registered method and model, and an
unknown option is refused with its usage. Running it takes minutes (the CUDA tests), so no test runs it whole."""
from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

from evals.bench import decode
from evals.models import MODELS
from evals.registry import METHODS

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def test_the_check_runs_an_existing_test_file_and_a_valid_decode_cell():
    text = SCRIPT.read_text()
    assert re.search(r"pytest (\S+) -m cuda", text).group(1) == "tests/test_cuda.py"
    assert (ROOT / "tests" / "test_cuda.py").exists()
    fixed = shlex.split(re.search(r"-m evals\.bench\.decode (.*?) \"\$\{cell\[@\]\}\"", text).group(1))
    cells = re.findall(r"^\s*cell=\((.*)\)$", text, re.M)
    assert len(cells) == 2  # the GPU cell and the --cpu one
    for cell in cells:
        args = decode.parse_args(fixed + shlex.split(cell))
        assert args.model in MODELS and set(args.methods) <= set(METHODS) and len(args.lengths) == 1
        assert not args.isolate  # in-process: a failing cell fails the check


def test_an_unknown_option_is_refused_with_the_usage():
    out = subprocess.run(["bash", str(SCRIPT), "--deadline", "5"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "usage: scripts/gpu_check.sh [OUTDIR] [--cpu]" in out.stderr
