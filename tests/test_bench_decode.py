"""The decode benchmark script end to end on the tiny model: isolated cells with peak RSS, resume."""
import json

import pytest

from evals.bench import decode
from tests.conftest import DATA_DIR

pytestmark = pytest.mark.skipif(not (DATA_DIR / "pg_essays").is_dir(), reason=f"no essays under {DATA_DIR}")


def bench(out, *extra, budget=32, length=96):
    decode.main(["--model", "tiny-llama", "--lengths", str(length), "--new-tokens", "4", "--budget", str(budget),
                 "--threads", "1",
                 "--data-dir", str(DATA_DIR), "--out", str(out), *extra])
    return json.loads(out.read_text())


def test_isolated_cells_record_peak_rss_and_resume_skips_finished_cells(tmp_path, capsys):
    out = tmp_path / "bench.json"
    first = bench(out, "--methods", "full", "--isolate")
    row = first["full"]["96"]
    assert row["peak_rss_bytes"] > 50 * 2**20 and row["tpot_s"] > 0 and row["tt2t_s"] >= row["ttft_s"]
    assert set(row["breakdown"]) == {"select", "transfer", "attention", "update", "other"}
    assert first["environment"]["isolate"] and first["environment"]["threads"] == 1
    capsys.readouterr()
    second = bench(out, "--methods", "full", "streaming_llm", "--isolate", "--resume")
    printed = capsys.readouterr().out
    assert second["full"] == first["full"] and "streaming_llm" in second
    assert "full     96" not in printed and "streaming_llm     96" in printed and "ratio to full" in printed
    with pytest.raises(SystemExit, match="budget=32"):
        decode.main(["--model", "tiny-llama", "--lengths", "96", "--budget", "64", "--new-tokens", "4",
                     "--out", str(out), "--resume"])


def test_in_process_run_writes_every_method(tmp_path):
    result = bench(tmp_path / "bench.json", "--methods", "full", "icecache", budget=64, length=200)
    assert {"full", "icecache", "environment"} <= set(result)
    assert "peak_rss_bytes" not in result["icecache"]["200"]
