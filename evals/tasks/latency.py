"""Latency: a context-length sweep with a fixed number of generated tokens (PQCache's timing definitions).

One prompt per (length, repeat), cut from natural text (Paul Graham essays in ``data_dir`` when present,
else the passkey filler) to exactly ``length`` tokens; ``new_tokens`` tokens are generated greedily with
EOS ignored, so every method decodes the same number of steps. The headline per length is TT2T, TPOT
(tokens 3..N) and the TPOT breakdown, pooled over repeats — the data behind the paper's latency and
scaling figures. ``score`` is the mean TPOT in milliseconds (lower is better).
"""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from ..task import GARBAGE, DataError, Sample, Suite
from ..output.timing import tpot_stats

FILLER = "passkey filler"  # the prompt text when no essays are found


@dataclass
class LatencyOptions:
    lengths: list[int] = field(default_factory=lambda: [2048, 4096, 8192, 16384])
    new_tokens: int = 32
    repeats: int = 1
    beyond_max_length: bool = True  # SmolLM2 is trained to 8k; latency does not need trained quality


class Latency(Suite):
    name = "latency"
    Options = LatencyOptions

    def configure(self, lengths, new_tokens, repeats, beyond_max_length) -> None:
        self.lengths, self.new_tokens, self.repeats = [int(n) for n in lengths], int(new_tokens), int(repeats)
        if self.new_tokens < 3:
            raise ValueError("latency needs new_tokens >= 3 (TPOT is measured over tokens 3..N)")
        too_long = [n for n in self.lengths if n > self.max_length]
        if too_long and not beyond_max_length:
            raise ValueError(f"latency lengths {too_long} exceed the model's {self.max_length} tokens; set "
                             "eval.beyond_max_length=true to time them anyway (quality is not measured here)")

    def text_source(self) -> str:
        """Where the prompts are cut from: the essays file, or :data:`FILLER` when ``data_dir`` has none
        (recorded by the decode benchmark: the text shapes the keys every index is built on)."""
        essays = None if self.data_dir is None else self.data_dir / "pg_essays" / "PaulGrahamEssays.json"
        return str(essays) if essays is not None and essays.exists() else FILLER

    def _text(self) -> str:
        source = self.text_source()
        if source == FILLER:
            return " ".join([GARBAGE] * 20000)
        try:
            return json.loads(Path(source).read_text())["text"]
        except (ValueError, KeyError) as err:
            raise DataError(f"{source}: expected a JSON object with a 'text' field ({err})") from None

    def samples(self) -> Iterator[Sample]:
        ids = self.tokenizer(self._text(), add_special_tokens=False)["input_ids"]
        for length in self.lengths:
            while len(ids) < length + self.repeats:
                ids = ids + ids
            for r in range(self.repeats)[: self.limit]:
                yield Sample(id=f"latency-{length}-{r}", task=f"latency_{length}", prompt_ids=ids[r:r + length],
                             max_new_tokens=self.new_tokens, reference=None, ignore_eos=True,
                             meta={"length": length, "repeat": r})

    def score(self, sample: Sample, prediction: str, generate=None) -> dict[str, float]:
        return {}

    def aggregate(self, rows: list[dict]) -> dict:
        lengths: dict[str, dict] = {}
        for length in sorted({r["meta"]["length"] for r in rows}):
            timings = [r["timing"] for r in rows if r["meta"]["length"] == length]
            intervals = [x for t in timings for x in t["intervals_s"]]
            phases: dict[str, float] = {}
            for t in timings:
                for p, sec in t["breakdown_s"].items():
                    phases[p] = phases.get(p, 0.0) + sec / max(len(intervals), 1)
            lengths[str(length)] = {"tt2t_s": statistics.fmean(t["tt2t_s"] for t in timings),
                                    "ttft_s": statistics.fmean(t["ttft_s"] for t in timings),
                                    **tpot_stats(intervals), "breakdown": phases}
        score = statistics.fmean(v["tpot_s"] for v in lengths.values()) * 1000 if lengths else None
        return {"score": score, "score_name": "tpot_ms", "lengths": lengths, "n_samples": len(rows)}
