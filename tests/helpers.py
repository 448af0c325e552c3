"""Helpers every test module imports (``from helpers import ...``): tiny random models built in-process, the
full-attention oracle, an in-process byte tokenizer, and the per-method contract cases (in the spirit of NVIDIA
kvpress' ``tests/default_presses.py``): :data:`METHOD_ROWS` holds the rows a method needs, :func:`method_case`
gives every registered method (``evals.registry.METHODS``) its case, a row's or one derived from its class, and
the ``check_*`` functions are the contract tests/test_contract.py runs on each."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from evals.registry import METHODS, make_cache, make_method, method_class
from evals.models import tiny_config
from icecache.kv import KVMethod

DATA_DIR = Path(os.environ.get("ICECACHE_DATA_DIR", Path(__file__).resolve().parents[1].parent / "shared" / "data"))

# (name, H_kv, H_q): MQA (H_kv = 1), GQA (1 < H_kv < H_q), MHA (H_kv = H_q, like LongChat), Qwen3 q/k-norm
TINY_SHAPES = [("tiny-llama", 1, 4), ("tiny-llama", 2, 4), ("tiny-llama", 4, 4), ("tiny-qwen3", 2, 4)]


@dataclass(frozen=True)
class MethodCase:
    """A method's contract case: with ``covering`` its budget covers a ``prompt_len + new_tokens`` context
    (it must equal full attention); with ``small`` it must stay within the budget under ``debug=True``;
    ``invalid`` is one hyperparameter value :meth:`KVMethod.validate` must reject. ``derived``: the case was
    derived from the method's class (:func:`derived_case`), not written as a row of :data:`METHOD_ROWS`."""

    name: str
    covering: dict = field(default_factory=dict)  # budget and hyperparameters
    small: dict = field(default_factory=dict)
    invalid: dict = field(default_factory=dict)
    prompt_len: int = 48
    new_tokens: int = 8
    requires: str | None = None  # an optional package the method needs (its tests skip without it)
    derived: bool = False


# the M-DCI search visits every page, so a covering budget retrieves the whole prompt through the index; the
# official candidate rule (the C code's add_to_list) ranks only each level-1 node's K best children, so a page
# none of whose keys is among them is never a candidate, whatever the budget: the exhaustive case ranks every
# scored key (the official code never indexes a prompt the budget covers, which the default short_prompt keeps)
ICECACHE_EXHAUSTIVE = dict(always_index=True, prop_to_retrieve=1.0, min_fov=1 << 20, candidate_rule="scored")

# The rows of the methods whose derived case (:func:`derived_case`) does not fit: a paged or index-based method
# whose covering budget needs more than the context or other hyperparameters, one with a validation to check
# (``invalid``), one that needs an optional package. A method without a row gets its derived case.
METHOD_ROWS = [
    MethodCase("full", covering=dict(budget=None)),
    MethodCase("streaming_llm", covering=dict(budget=56), small=dict(budget=16), invalid=dict(n_sink=-1)),
    MethodCase("h2o", covering=dict(budget=54), small=dict(budget=16), invalid=dict(chunk_size=0)),
    MethodCase("snapkv", covering=dict(budget=54), small=dict(budget=40), invalid=dict(kernel_size=4)),
    MethodCase("snapkv_pinned", covering=dict(budget=54), small=dict(budget=40), invalid=dict(decode_window=-1)),
    MethodCase("quest", covering=dict(budget=64), small=dict(budget=48, n_dense_layers=0),
               invalid=dict(n_dense_layers=-1)),
    # 4-token pages: 16 pages cover the 56-token context; 8 pages (2 sink, 2 window, top 4 - 3 = 1) do not
    MethodCase("arkvale", covering=dict(budget=64, page_size=4), small=dict(budget=32, page_size=4),
               invalid=dict(digest="sphere")),
    MethodCase("topk", covering=dict(budget=54), small=dict(budget=16), invalid=dict(heads="all")),
    # IceCache's layout and index with exact page ranking: covered once the prompt is indexed (always_index)
    MethodCase("page_oracle", covering=dict(budget=256, always_index=True), small=dict(budget=64),
               invalid=dict(gqa_merge="all"), prompt_len=200),
    MethodCase("pqcache", covering=dict(budget=60), small=dict(budget=24), invalid=dict(n_bits=0)),
    MethodCase("omnikv", covering=dict(budget=48, filter_layers=[1], wait_layers=0),
               small=dict(budget=16, filter_layers=[1], wait_layers=0), invalid=dict(selector="first")),
    # the official configuration attends 4 sinks + 64 local tokens and samples with K = 10 whatever the budget;
    # the rows give it a local window the 48-token prompt does not fill, and with K = 0 the same sampled path
    # (offload, hash, lookup, weights) is exact, which is what the covering row checks
    MethodCase("magicpig", covering=dict(budget=56, n_bits=0, local_window=26), small=dict(budget=24, local_window=10),
               invalid=dict(n_tables=0)),
    MethodCase("magicpig_calibrated", covering=dict(budget=56), small=dict(budget=24),
               invalid=dict(min_collisions=0)),
    MethodCase("icecache", covering=dict(budget=256, **ICECACHE_EXHAUSTIVE), small=dict(budget=64),
               invalid=dict(gqa_candidates=-1), prompt_len=200),
    MethodCase("icecache_tuned", covering=dict(budget=256, **ICECACHE_EXHAUSTIVE), small=dict(budget=64),
               invalid=dict(candidate_rule="all"), prompt_len=200),
    MethodCase("icecache_reuse", covering=dict(budget=256, **ICECACHE_EXHAUSTIVE), small=dict(budget=64),
               invalid=dict(n_reuse_layers=0), prompt_len=200),
    MethodCase("icecache_reuse_rerank", covering=dict(budget=256, **ICECACHE_EXHAUSTIVE), small=dict(budget=64),
               invalid=dict(rerank=1), prompt_len=200),
    # generated tokens are kept (kvpress' decoding), so a budget of the prompt covers the context
    MethodCase("kvpress", covering=dict(budget=48, press="SnapKVPress", press_kwargs=dict(window_size=8)),
               small=dict(budget=16, press="ExpectedAttentionPress"), invalid=dict(press="AdaKVPress"),
               requires="kvpress"),
]

ROWS = {row.name: row for row in METHOD_ROWS}


def smallest_valid_budget(cls: type[KVMethod], start: int, stop: int) -> int | None:
    """The smallest budget in ``[start, stop)`` that ``cls`` accepts with its default hyperparameters."""
    for budget in range(start, stop):
        try:
            cls(budget=budget)
        except (ValueError, TypeError):
            continue
        return budget
    return None


def derived_case(name: str) -> MethodCase:
    """The contract case of a registered method without a row, derived from its class: a method without a budget
    (``needs_budget = False``) runs with none; otherwise its covering budget is the smallest valid one from the
    whole ``prompt_len + new_tokens`` context up, and its small budget the smallest valid one below it."""
    case = MethodCase(name, derived=True)
    cls = method_class(name)
    if not cls.needs_budget:
        return replace(case, covering=dict(budget=None))
    context = case.prompt_len + case.new_tokens
    covering = smallest_valid_budget(cls, context, 8 * context) or context  # an invalid one fails with its error
    small = smallest_valid_budget(cls, 1, context)
    return replace(case, covering=dict(budget=covering), small=dict(budget=small) if small else {})


def method_case(name: str) -> MethodCase:
    """The contract case of the registered method ``name``: its row in :data:`METHOD_ROWS`, else its derived
    case."""
    return ROWS[name] if name in ROWS else derived_case(name)


def method_cases() -> list[MethodCase]:
    """Every registered method's case, in the registry's order."""
    return [method_case(name) for name in METHODS]


METHOD_CASES = method_cases()


def row_needed(case: MethodCase, what: str, err: BaseException) -> str:
    """The failure of a derived case: which row to add, where, and what the derived case did."""
    cls = method_class(case.name).__name__
    return (f"add a MethodCase row for '{case.name}' to METHOD_ROWS in tests/helpers.py: {what} (e.g. "
            f"MethodCase('{case.name}', covering=dict(budget=...), small=dict(budget=...))); the case derived from "
            f"{cls} (covering={case.covering}, small={case.small}, prompt_len={case.prompt_len}, "
            f"new_tokens={case.new_tokens}) failed: {err}")


def skip_without_requirement(method: str) -> None:
    """Skips the calling test when ``method`` needs an optional package that is not installed (its
    ``MethodCase.requires``: kvpress)."""
    import pytest

    requires = ROWS[method].requires if method in ROWS else None
    if requires:
        pytest.importorskip(requires, reason=f"{method} needs the optional package {requires}")


def check_covering_equals_full(case: MethodCase) -> None:
    """The contract's first check: at the case's covering budget the method equals full attention (tokens and
    logits, under ``debug=True``)."""
    skip_without_requirement(case.name)
    try:
        assert_matches_full(build_tiny("tiny-llama", 2, 4), case.name, prompt_len=case.prompt_len,
                            new_tokens=case.new_tokens, debug=True, **case.covering)
    except (AssertionError, ValueError, TypeError) as err:
        if not case.derived:
            raise
        raise AssertionError(row_needed(case, "a `covering` budget and hyperparameters with which it equals full "
                                              "attention on a prompt_len + new_tokens context", err)) from err


def check_small_budget_holds(case: MethodCase) -> None:
    """The contract's second check: at the case's small budget a generation stays within the budget at every
    step (``debug=True`` asserts it) and exercises budgeted layers."""
    skip_without_requirement(case.name)
    try:
        model = build_tiny("tiny-llama", 2, 4)
        ids = torch.randint(0, model.config.vocab_size, (1, case.prompt_len),
                            generator=torch.Generator().manual_seed(0))
        out, cache = generate_with(model, ids, case.new_tokens, case.name, debug=True, **case.small)
        assert out.sequences.shape[1] == case.prompt_len + case.new_tokens
        budgeted = [s.layer_idx for s in cache.states if cache.method.is_budgeted(s)]
        assert budgeted, f"{case.name}: the small case must exercise budgeted layers"
    except (AssertionError, ValueError, TypeError) as err:
        if not case.derived:
            raise
        raise AssertionError(row_needed(case, "a `small` budget and hyperparameters it accepts and keeps under "
                                              "debug=True with budgeted layers", err)) from err


def check_validate_rejects(case: MethodCase) -> None:
    """The contract's third check: the case's small configuration is valid and its ``invalid`` value is not."""
    import pytest

    skip_without_requirement(case.name)
    budget = case.small.get("budget", 64)
    make_method(case.name, budget=budget, **{k: v for k, v in case.small.items() if k != "budget"})  # valid
    with pytest.raises(ValueError, match=next(iter(case.invalid))):
        make_method(case.name, budget=budget, **case.invalid)


# what a method needs to accept the budget of 64 that the table-wide tests (test_integrity, test_reliability)
# give every method: ArkVale's minimum is 8 pages (2 sink + 2 window + page_budgets // 2 - 3 scored), 256
# tokens at its official 32-token pages
BUDGET_64_HP = {"arkvale": dict(page_size=8)}


def build_tiny(name: str = "tiny-llama", n_kv_heads: int = 2, n_heads: int = 4, n_layers: int = 4, seed: int = 0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(name, n_kv_heads=n_kv_heads, n_heads=n_heads,
                                                         n_layers=n_layers), dtype=torch.float32)
    return model.eval()


def generate_reference(model, ids: torch.Tensor, new_tokens: int):
    """Plain transformers greedy generation with its default cache and sdpa attention."""
    model.set_attn_implementation("sdpa")
    return model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                          output_logits=True, return_dict_in_generate=True)


def generate_with(model, ids: torch.Tensor, new_tokens: int, method: str, budget=None, **hp):
    cache = make_cache(method, model, budget=budget, **hp)
    try:
        return model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              past_key_values=cache, output_logits=True, return_dict_in_generate=True), cache
    finally:
        cache.close()


def assert_matches_full(model, method: str, budget=None, prompt_len: int = 48, new_tokens: int = 8,
                        atol: float = 1e-4, seed: int = 0, **hp):
    """A method whose budget covers the whole context must equal full attention: same greedy tokens,
    logits within ``atol``."""
    torch.manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (1, prompt_len))
    ref = generate_reference(model, ids, new_tokens)
    out, cache = generate_with(model, ids, new_tokens, method, budget, **hp)
    assert torch.equal(ref.sequences, out.sequences), f"{method}: greedy tokens differ from full attention"
    worst = max(float((a - b).abs().max()) for a, b in zip(ref.logits, out.logits))
    assert worst <= atol, f"{method}: logits differ from full attention by {worst}"
    return cache

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def build_byte_tokenizer(chat_template: str | None = CHAT_TEMPLATE):
    """A byte-level tokenizer built in-process (one token per UTF-8 byte, exact round trip, BOS ``<s>``
    added, EOS ``</s>``) with a simple chat template; for eval-suite tests that need no real model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<s>": 0, "</s>": 1, **{ch: i + 2 for i, ch in enumerate(sorted(alphabet))}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   chat_template=chat_template, model_max_length=1 << 30)

def natural_prompt_ids(tokenizer, n_tokens: int) -> torch.Tensor:
    """About ``n_tokens`` of natural text (Paul Graham essays when the data is present)."""
    essays = DATA_DIR / "pg_essays" / "PaulGrahamEssays.json"
    text = json.loads(essays.read_text())["text"] if essays.exists() else (
        "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. " * 400)
    return torch.tensor([tokenizer(text)["input_ids"][:n_tokens]])


def generate_twice(model, ids: torch.Tensor, method: str, **options) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Greedy tokens and logits of two 12-token generations, each with a fresh cache of ``method``."""
    outs = []
    for _ in range(2):
        cache = make_cache(method, model, **options)
        try:
            out = model.generate(ids, max_new_tokens=12, do_sample=False, past_key_values=cache,
                                 output_logits=True, return_dict_in_generate=True)
        finally:
            cache.close()
        outs.append((out.sequences, torch.stack(out.logits)))
    return outs


def replace_hook(method, name: str, fn) -> None:
    """Replaces the hook ``name`` of this one method object by ``fn`` (a spy or a stand-in): methods are frozen
    dataclasses, so a test sets the instance attribute past the frozen ``__setattr__``."""
    object.__setattr__(method, name, fn)


def restore_hook(method, name: str) -> None:
    """Undoes :func:`replace_hook`: the method object uses its class's hook ``name`` again."""
    object.__delattr__(method, name)
