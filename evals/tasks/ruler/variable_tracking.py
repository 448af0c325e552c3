"""Variable tracking (NVIDIA/RULER ``scripts/data/synthetic/variable_tracking.py``)."""
from __future__ import annotations

import dataclasses
import string

from ...task import GARBAGE
from .cell import Cell
from .constants import TEMPLATES


class VariableTracking:
    """``variable_tracking.py`` (noise haystack): one 5-letter chain ``VAR A = 12345``, ``VAR B = VAR A`` ...,
    preceded by a randomised 3-letter in-context example sized to 500 tokens."""

    def __init__(self, cell: Cell, num_chains: int, num_hops: int):
        self.cell, self.num_chains, self.num_hops = cell, num_chains, num_hops
        spec = TEMPLATES["variable_tracking"]
        self.raw_template = spec["template"] + spec["answer_prefix"]

    def chains(self, is_icl: bool) -> tuple[list[list[str]], list[list[str]]]:
        rng, k = self.cell.rng, (3 if is_icl else 5)
        hops = min(10, self.num_hops) if is_icl else self.num_hops
        names = ["".join(rng.choices(string.ascii_uppercase, k=k)).upper() for _ in range((hops + 1) * self.num_chains)]
        while len(set(names)) < self.num_chains * (hops + 1):
            names.append("".join(rng.choices(string.ascii_uppercase, k=k)).upper())
        out_vars, out_chains = [], []
        for i in range(0, len(names), hops + 1):
            these = names[i:i + hops + 1]
            out_vars.append(these)
            root = "12345" if is_icl else str(self.cell.nprng.randint(10000, 99999))
            out_chains.append([f"VAR {these[0]} = {root}"]
                              + [f"VAR {these[j + 1]} = VAR {these[j]} " for j in range(hops)])
        return out_vars, out_chains

    def build(self, num_noises: int, is_icl: bool = False) -> tuple[str, list[str]]:
        variables, chains = self.chains(is_icl)
        value = chains[0][0].split("=")[-1].strip()
        sentences = [GARBAGE] * num_noises
        for chain in chains:
            positions = sorted(self.cell.rng.sample(range(len(sentences)), len(chain)))
            for j, pos in enumerate(positions):
                sentences.insert(pos + j, chain[j])
        context = "\n".join(sentences).replace(". \n", ".\n")
        template = self.raw_template if is_icl else self.cell.template
        return template.format(context=context, query=value, num_v=self.num_hops + 1), variables[0]

    def icl_example(self) -> str:
        """``sys_vartrack_w_noise_random(num_samples=1, max_seq_length=500, ...)`` as ``main`` builds it first:
        unwrapped, 3-letter names, root 12345, 500 tokens, nothing reserved for generation, same RNG."""
        icl = dataclasses.replace(self.cell, task="vt in-context example", length=500, tokens_to_generate=0)
        icl.rng, icl.nprng = self.cell.rng, self.cell.nprng
        incremental = 5
        n = icl.haystack_size(lambda m: self.build(m, True)[0], incremental)
        text, answers, _ = icl.step_down(lambda m: self.build(m, True), n, incremental)
        return text + " " + " ".join(answers) + "\n"

    def randomize_icl(self, icl: str) -> str:
        for item in icl.strip().split()[-self.num_hops - 1:]:
            icl = icl.replace(item, "".join(self.cell.rng.choices(string.ascii_uppercase, k=len(item))).upper())
        return icl.replace("12345", str(self.cell.nprng.randint(10000, 99999)))

    def samples(self, num: int) -> list[tuple[str, list[str], int]]:
        cell = self.cell
        icl = self.icl_example()
        example_tokens = cell.count(icl)
        incremental = 5 if cell.length < 4096 else 10
        n = cell.haystack_size(lambda m: self.build(m)[0], incremental, extra=example_tokens)
        head = TEMPLATES["variable_tracking"]["template"][:20]

        def with_example(m: int) -> tuple[str, list[str]]:
            text, answers = self.build(m)
            cut = text.index(head)
            return text[:cut] + self.randomize_icl(icl) + "\n" + text[cut:], answers

        return [cell.step_down(with_example, n, incremental) for _ in range(num)]
