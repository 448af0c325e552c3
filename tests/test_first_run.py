"""A process's first request is timed like its tenth: no numba kernel is compiled or loaded inside a timed request
(:meth:`icecache.kv.KVMethod.warm_up`, :func:`evals.runner.warm_model`), and first-time set-up (the checkpoint
conversion of :mod:`evals.models`) is safe when several processes start at once."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from helpers import build_tiny, replace_hook

from evals import runner
from evals.registry import make_method
from evals import models
from icecache.kv import compat

REPO = Path(__file__).resolve().parents[1]

# Run in a fresh process (no kernel loaded yet): each case's request, with the numba dispatchers' overloads (compiled
# or loaded signatures) counted when the runner's clock starts and after the request returns.
FIRST_REQUESTS = textwrap.dedent("""
    import json, sys
    import torch
    from numba.core.registry import CPUDispatcher
    from transformers import AutoModelForCausalLM
    from evals import runner
    from evals.registry import make_method
    from evals.models import tiny_config

    def loaded():
        return sum(len(obj.overloads) for name, mod in list(sys.modules.items())
                   if name.startswith(("icecache", "baselines")) for obj in vars(mod).values()
                   if isinstance(obj, CPUDispatcher))

    at_start, real_now = [], runner._now
    def now(device):
        if not at_start:
            at_start.append(loaded())
        return real_now(device)
    runner._now = now
    out = []
    for method, dtype, n_prompt in json.loads(sys.argv[1]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config(), dtype=getattr(torch, dtype)).eval()
        runner.warm_model(model)  # its own generation reads the clock too
        ids = torch.randint(0, 264, (n_prompt,), generator=torch.Generator().manual_seed(1)).tolist()
        at_start.clear()
        before = loaded()
        runner.generate(model, None, make_method(method, budget=64), ids, 8, ignore_eos=True)
        out.append({"method": method, "before": before, "at_start": at_start[0], "after": loaded()})
    print(json.dumps(out))
""")


def test_no_kernel_is_compiled_or_loaded_inside_a_first_request():
    # 3.2k tokens: level 0 of the index takes the anchor path; bf16 keys are other signatures (raw int16, uint16 keys)
    cases = [["icecache", "float32", 3200], ["icecache_tuned", "bfloat16", 300],
             ["icecache_reuse_rerank", "float32", 300], ["magicpig_calibrated", "float32", 300]]
    proc = subprocess.run([sys.executable, "-c", FIRST_REQUESTS, json.dumps(cases)], cwd=REPO, capture_output=True,
                          text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    for row in rows:
        assert row["after"] == row["at_start"], row  # nothing compiled or loaded between the clock start and the end
    first = {row["method"]: row for row in rows}
    assert first["icecache"]["before"] == 0 < first["icecache"]["at_start"]  # the warm-up did load them
    assert first["icecache_tuned"]["at_start"] > first["icecache_tuned"]["before"]  # bf16 signatures
    assert first["magicpig_calibrated"]["at_start"] > first["magicpig_calibrated"]["before"]


def test_warm_up_leaves_the_method_the_outputs_and_the_random_state_as_they_were():
    model = build_tiny()
    ids = torch.randint(0, 264, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    runner.warm_model(model)
    assert model in runner._WARM_MODELS
    for name in ("icecache", "magicpig_calibrated"):
        method = make_method(name, budget=64)
        rng = torch.get_rng_state()
        method.warm_up(compat.model_spec(model), len(ids))
        assert torch.equal(rng, torch.get_rng_state())
        assert method == make_method(name, budget=64)
        warm = runner.generate(model, None, method, ids, 8, ignore_eos=True)
        cold = make_method(name, budget=64)
        replace_hook(cold, "warm_up", lambda spec, n: None)
        assert runner.generate(model, None, cold, ids, 8, ignore_eos=True).token_ids == warm.token_ids


# ---------------------------------------------------------------------------------------------- checkpoint set-up
WRITERS = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from evals.models import build_checkpoint

    def write(folder):
        with open(Path(sys.argv[2]), "a") as log:
            log.write("converted\\n")
        (folder / "config.json").write_text("{}")
        time.sleep(1.0)  # both processes are inside the set-up at once
        (folder / "model.safetensors").write_bytes(sys.argv[3].encode())

    print(build_checkpoint(Path(sys.argv[1]), write))
""")


def leftovers(parent: Path) -> list[str]:
    """Everything beside the checkpoint but its (empty) lock file."""
    return sorted(p.name for p in parent.iterdir() if not p.name.endswith(".lock") and p.name != "ckpt")


def test_two_processes_setting_up_at_once_convert_once_and_leave_one_checkpoint(tmp_path):
    target, log = tmp_path / "cache" / "ckpt", tmp_path / "conversions.log"
    procs = [subprocess.Popen([sys.executable, "-c", WRITERS, str(target), str(log), f"writer {i}"], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    assert {out.strip() for out, _ in outs} == {str(target)}
    assert log.read_text().count("converted") == 1  # the second waited for the first and found the checkpoint
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "model.safetensors"]
    assert leftovers(target.parent) == []


def test_two_concurrent_gguf_conversions_both_succeed(tmp_path, monkeypatch):
    import transformers

    from evals.models import tiny_tokenizer

    barrier, loads = threading.Barrier(2), []

    def load(*args, **kwargs):
        loads.append(1)
        return build_tiny()
    monkeypatch.setenv("ICECACHE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", load)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: tiny_tokenizer())
    target = models.cache_home() / "ckpt"
    results, errors = [], []

    def convert():
        try:
            barrier.wait()
            results.append(models.convert_gguf(tmp_path / "model.gguf", target))
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)
    threads = [threading.Thread(target=convert) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors and results == [target, target]
    assert len(loads) == 1 and models.checkpoint_complete(target)
    assert leftovers(target.parent) == []


def test_publish_discards_ours_when_a_peer_published_first(tmp_path):
    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "config.json").write_text("peer")
    (target / "model.safetensors").write_text("peer")
    ours = tmp_path / ".ckpt.x.tmp"
    ours.mkdir()
    (ours / "config.json").write_text("ours")
    (ours / "model.safetensors").write_text("ours")
    assert models.publish_folder(ours, target) == target  # the rename fails: target is not empty
    assert (target / "model.safetensors").read_text() == "peer"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_publish_replaces_an_incomplete_target(tmp_path):
    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "config.json").write_text("half")
    ours = tmp_path / ".ckpt.x.tmp"
    ours.mkdir()
    (ours / "config.json").write_text("ours")
    (ours / "model.safetensors").write_text("ours")
    models.publish_folder(ours, target)
    assert (target / "config.json").read_text() == "ours"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_failed_or_killed_conversion_leaves_nothing_behind(tmp_path):
    target = tmp_path / "ckpt"

    def fail(folder):
        (folder / "config.json").write_text("{}")
        raise RuntimeError("conversion failed")
    with pytest.raises(RuntimeError, match="conversion failed"):
        models.build_checkpoint(target, fail)
    assert leftovers(tmp_path) == [] and not target.exists()
    killed = tmp_path / ".ckpt.abc123.tmp"  # what a writer killed mid-conversion leaves
    killed.mkdir()
    (killed / "config.json").write_text("{}")
    models.build_checkpoint(target, lambda folder: [(folder / f).write_text("x")
                                                    for f in ("config.json", "model.safetensors")])
    assert models.checkpoint_complete(target) and leftovers(tmp_path) == []
    mask = os.umask(0)
    os.umask(mask)
    assert target.stat().st_mode & 0o777 == 0o777 & ~mask  # not mkdtemp's private mode
