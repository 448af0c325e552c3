"""The claims table (evals/output/claims.py) on crafted run directories: the scores, the paired difference and
whether its interval resolves it, and the runs a claim still lacks."""
from __future__ import annotations

from evals.output import claims
from test_tables import write_run


def test_a_claim_reads_both_runs_and_their_paired_difference(tmp_path):
    folder = tmp_path / claims.FOLDER / "passkey"
    write_run(folder, "full", 64, [1, 1, 1, 1, 1])
    write_run(folder, "icecache", 256, [0, 0, 0, 0, 0])
    write_run(folder, "icecache", 64, [1, 1, 1, 1, 0], page_size=8)  # not the official configuration
    claim = claims.Claim("IceCache keeps the full cache's pass keys", "passkey", ("icecache", 256, None),
                         ("full", 256, None), "99% vs 100%")
    row = claims.claim_row(claim, tmp_path, draws=200)
    assert row == ("| IceCache keeps the full cache's pass keys | 99% vs 100% | 0.0 vs 100.0 (n = 5) "
                   "| -100.0 [-100.0, -100.0] | yes |")
    official_64 = claims.Claim("x", "passkey", ("icecache", 64, None), ("full", 64, None), "-")
    assert "missing rows: icecache at 64 |" in claims.claim_row(official_64, tmp_path, draws=200)


def test_a_claim_without_rows_names_the_missing_runs(tmp_path):
    claim = claims.CLAIMS[-1]
    assert claims.claim_row(claim, tmp_path, draws=10).endswith(
        "| missing rows: icecache at 0.1 (first 50), pqcache at 0.1 (first 50) | - | - |")
