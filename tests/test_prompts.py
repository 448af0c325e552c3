"""Golden prompts per paper model: the wrapper each model's config chooses, checked as exact strings
built from the official templates' text, with tokenizer stubs (byte-level, one token per byte, the model's
BOS) where the weights and tokenizers are absent. Sources: THUDM/LongBench config/dataset2prompt.json and
pred.py build_chat, IceCache benchmark/longbench_pred.py build_chat, FastChat vicuna_v1.1, NVIDIA/RULER
scripts/data/template.py, IceCache benchmark/passkey_pred.py, mit-han-lab/Quest evaluation/passkey/passkey.py."""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers import DATA_DIR
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from evals.config import compose_config
from evals.tasks.longbench import LongBench
from evals.tasks.passkey import GARBAGE, QUESTION, TASK, Passkey, depth_grid, passkey_correct
from evals.tasks.ruler import Ruler

PAPER_MODELS = ["llama-3.1-8b-instruct", "mistral-7b-instruct-v0.2", "longchat-7b-v1.5", "qwen3-32b",
                "qwen3-4b-instruct-2507"]

# The no-tools branch of the official Llama-3.1-8B-Instruct tokenizer_config.json chat_template (system message
# trimmed, "Cutting Knowledge Date" header, every message trimmed, generation prompt).
LLAMA31_TEMPLATE = (
    "{{- bos_token }}{%- if not date_string is defined %}{%- set date_string = \"26 Jul 2024\" %}{%- endif %}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content']|trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system_message = \"\" %}{%- endif %}"
    "{{- \"<|start_header_id|>system<|end_header_id|>\\n\\n\" }}{{- \"Cutting Knowledge Date: December 2023\\n\" }}"
    "{{- \"Today Date: \" + date_string + \"\\n\\n\" }}{{- system_message }}{{- \"<|eot_id|>\" }}"
    "{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    "+ message['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")
# Qwen3's official template, user turns and generation prompt (its enable_thinking=false branch).
QWEN3_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}")
# Qwen3-4B-Instruct-2507 is non-thinking only: its template has no <think> block (enable_thinking is ignored).
QWEN3_2507_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
# Mistral-7B-Instruct-v0.2's tokenizer template would put a space inside [INST] ... [/INST]; never used here.
MISTRAL_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} "
                    "[/INST]{% endif %}{% endfor %}")
STUBS = {  # model -> (BOS the tokenizer adds, chat template of the real tokenizer or a stand-in)
    "llama-3.1-8b-instruct": ("<|begin_of_text|>", LLAMA31_TEMPLATE),
    "mistral-7b-instruct-v0.2": ("<s>", MISTRAL_TEMPLATE),
    "longchat-7b-v1.5": ("<s>", None),
    "qwen3-32b": (None, QWEN3_TEMPLATE),
    "qwen3-4b-instruct-2507": (None, QWEN3_2507_TEMPLATE),
}
# LongBench config/dataset2prompt.json, "2wikimqa" (exact)
WIKI_TEMPLATE = ("Answer the question based on the given passages. Only give me the answer and do not output any "
                 "other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the "
                 "given passages. Only give me the answer and do not output any other words.\n\nQuestion: "
                 "{input}\nAnswer:")
ROW = {"input": "Who directed the film?", "context": "Passage 1:\nThe film was directed by A. Smith.",
       "answers": ["A. Smith"], "length": 9, "all_classes": None, "_id": "w0"}
USER = WIKI_TEMPLATE.format(**ROW)
VICUNA = ("A chat between a curious user and an artificial intelligence assistant. The assistant gives helpful, "
          "detailed, and polite answers to the user's questions.")
LONGBENCH_GOLDEN = {
    # PQCache/IceCache: system turn + tokenizer(chat text) adds a second <|begin_of_text|>
    "llama-3.1-8b-instruct": ("<|begin_of_text|><|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
                              "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\nYou are a helpful "
                              "assistant.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n" + USER
                              + "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"),
    "mistral-7b-instruct-v0.2": "<s>[INST]" + USER + "[/INST]",
    "longchat-7b-v1.5": "<s>" + VICUNA + " USER: " + USER + " ASSISTANT:",
    "qwen3-32b": "<|im_start|>user\n" + USER + "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
    "qwen3-4b-instruct-2507": "<|im_start|>user\n" + USER + "<|im_end|>\n<|im_start|>assistant\n",
}
NIAH_1 = ("A special magic number is hidden within the following text. Make sure to memorize it. I will quiz you "
          "about the number afterwards.\n")
NIAH_1_END = "\nWhat is the special magic number for {q} mentioned in the provided text?"
NIAH_1_PREFIX = " The special magic number for {q} mentioned in the provided text is"
RULER_GOLDEN = {  # model -> (head, tail) around the task template (RULER scripts/data/template.py)
    "llama-3.1-8b-instruct": ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n",
                              "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"),
    "mistral-7b-instruct-v0.2": ("[INST] ", " [/INST]"),
    "longchat-7b-v1.5": (VICUNA + " USER: ", " ASSISTANT:"),
    "qwen3-32b": ("<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"),
    "qwen3-4b-instruct-2507": ("<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n"),
}


def stub_tokenizer(bos: str | None, chat_template: str | None) -> PreTrainedTokenizerFast:
    """One token per UTF-8 byte (exact round trip), ``bos`` added in front when the real tokenizer adds one."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    specials = [t for t in (bos, "</s>") if t]
    vocab = {**{t: i for i, t in enumerate(specials)}, **{ch: i + len(specials) for i, ch in enumerate(alphabet)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    if bos:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token="</s>",
                                   chat_template=chat_template, model_max_length=1 << 30)


def model_eval_config(model: str, suite: str) -> tuple[dict, dict]:
    """The resolved ``model`` and ``eval`` groups of ``run.py model=<model> eval=<suite>``."""
    cfg = compose_config([f"model={model}", f"eval={suite}"])
    opts = {k: v for k, v in cfg["eval"].items() if k != "name"}
    return cfg["model"], opts


# ------------------------------------------------------------------------------------------------ LongBench
@pytest.mark.skipif(not (DATA_DIR / "longbench_config").is_dir(), reason=f"no LongBench config at {DATA_DIR}")
@pytest.mark.parametrize("model", PAPER_MODELS)
def test_longbench_prompt_of_each_paper_model_is_its_official_wrapper(tmp_path, model):
    import json

    shutil.copytree(DATA_DIR / "longbench_config", tmp_path / "longbench_config")
    assert json.loads((tmp_path / "longbench_config" / "dataset2prompt.json").read_text())["2wikimqa"] == WIKI_TEMPLATE
    (tmp_path / "longbench").mkdir()
    (tmp_path / "longbench" / "2wikimqa.jsonl").write_text(json.dumps(ROW) + "\n")
    model_cfg, opts = model_eval_config(model, "longbench")
    opts.update(tasks=["2wikimqa"])
    tok = stub_tokenizer(*STUBS[model])
    sample = next(LongBench(tok, data_dir=tmp_path, max_length=model_cfg["max_length"], **opts).samples())
    assert tok.decode(sample.prompt_ids) == LONGBENCH_GOLDEN[model]
    assert sample.meta["chat_format"] == model_cfg["prompt"]["longbench"]


def test_truncation_limits_are_the_icecache_scripts():
    """IceCache longbench_config/model2maxlen.json: llama-3.1 131072, mistral-7b-inst 32768, longchat 32000."""
    limits = {m: model_eval_config(m, "longbench")[0]["max_length"]
              for m in ("llama-3.1-8b-instruct", "mistral-7b-instruct-v0.2", "longchat-7b-v1.5")}
    assert limits == {"llama-3.1-8b-instruct": 131072, "mistral-7b-instruct-v0.2": 32768, "longchat-7b-v1.5": 32000}


# ------------------------------------------------------------------------------------------------ RULER
@pytest.mark.parametrize("model", PAPER_MODELS)
def test_ruler_prompt_of_each_paper_model_is_rulers_template(model):
    model_cfg, opts = model_eval_config(model, "ruler")
    opts.update(tasks=["niah_single_1"], lengths=[2048], num_samples=1)
    tok = stub_tokenizer(*STUBS[model])
    sample = next(Ruler(tok, max_length=model_cfg["max_length"], seed=42, **opts).samples())
    text = tok.decode(sample.prompt_ids)
    head, tail = RULER_GOLDEN[model]
    query = re.search(r"for (\S+) mentioned in the provided text\?", text).group(1)
    bos = STUBS[model][0] if model_cfg["prompt"]["ruler"] != "chat" else None  # chat text is encoded as is
    assert text.startswith((bos or "") + head + NIAH_1)
    assert text.endswith(NIAH_1_END.format(q=query) + tail + NIAH_1_PREFIX.format(q=query))
    assert "Cutting Knowledge" not in text
    # the official counter: no special tokens; the prompt is sized so that it + tokens_to_generate fits
    counted = len(tok(text[len(bos or ""):], add_special_tokens=False)["input_ids"])
    assert counted + 128 <= 2048 and len(sample.prompt_ids) == counted + (1 if bos else 0)
    assert sample.meta["token_count"] == "official"


def test_ruler_base_template_counts_without_the_bos():
    tok = stub_tokenizer("<s>", None)
    official = next(Ruler(tok, tasks=["niah_single_1"], lengths=[1500], num_samples=1, model_template="base",
                          max_length=4096, seed=1).samples())
    exact = next(Ruler(tok, tasks=["niah_single_1"], lengths=[1500], num_samples=1, model_template="base",
                       max_length=4096, seed=1, token_count="exact").samples())
    assert tok.decode(official.prompt_ids).startswith("<s>" + NIAH_1)
    assert len(official.prompt_ids) - 1 + 128 <= 1500 and len(exact.prompt_ids) + 128 <= 1500
    with pytest.raises(ValueError, match="token_count"):
        Ruler(tok, tasks=["niah_single_1"], lengths=[1500], token_count="bos")
    with pytest.raises(ValueError, match="meta-llama3"):
        Ruler(tok, tasks=["niah_single_1"], lengths=[1500], model_template="llama3")


# ------------------------------------------------------------------------------------------------ passkey
def icecache_passkey_text(n_garbage: int, loc: float, pass_key: int) -> str:
    """IceCache passkey_pred.py generate_prompt_landmark, then ``prompt += prompt_postfix``."""
    garbage_inf = " ".join([GARBAGE] * 5000)
    n_prefix = int(n_garbage * loc)
    lines = [TASK, garbage_inf[:n_prefix], f"The pass key is {pass_key}. Remember it. {pass_key} is the pass key.",
             garbage_inf[:n_garbage - n_prefix]]
    return "\n".join(lines) + QUESTION


@pytest.mark.parametrize("model", PAPER_MODELS)
def test_passkey_prompt_is_icecache_script_layout(model):
    model_cfg, opts = model_eval_config(model, "passkey_icecache")
    opts.update(lengths=[200, 300], depths=4)
    tok = stub_tokenizer(*STUBS[model])
    suite = Passkey(tok, max_length=model_cfg["max_length"], seed=42, **opts)
    samples = list(suite.samples())
    keys = np.random.RandomState(42).randint(1, 50000, size=8).tolist()  # drawn in order, lengths then depths
    assert [int(s.reference) for s in samples] == keys
    bos = STUBS[model][0] or ""
    for s, (n, loc) in zip(samples, [(n, i / 4) for n in (200, 300) for i in range(4)]):
        assert tok.decode(s.prompt_ids) == bos + icecache_passkey_text(n, loc, int(s.reference)) and not s.decode_ids
    # the literal text of one case (n_garbage 200, loc 0.5): no newline before the question
    one = next(Passkey(tok, lengths=[200], length_unit="chars", depths=[0.5], max_length=4096).samples())
    key = one.reference
    g = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
    assert tok.decode(one.prompt_ids) == bos + (
        "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. I will quiz "
        f"you about the important information there.\n{g} The grass \nThe pass key is {key}. Remember it. {key} is "
        f"the pass key.\n{g} The grass What is the pass key? The pass key is")


def test_passkey_question_separator_restores_the_newline_layout():
    tok = stub_tokenizer("<s>", None)
    old = next(Passkey(tok, lengths=[200], length_unit="chars", depths=[0.5], question_separator="\\n").samples())
    new = next(Passkey(tok, lengths=[200], length_unit="chars", depths=[0.5]).samples())
    assert tok.decode(old.prompt_ids).endswith("There and back again. The grass \n" + QUESTION)
    assert tok.decode(new.prompt_ids).endswith("There and back again. The grass " + QUESTION)
    assert old.meta["question_separator"] == "\n" and new.meta["question_separator"] == ""


def test_passkey_quest_protocol_depths_and_decoded_tail():
    assert [p for _, p in depth_grid(20, "quest")] == list(range(5, 101, 5))  # Quest: 100 // 20 * (k + 1)
    assert [d for d, _ in depth_grid(20, "linear")] == [i / 20 for i in range(20)]  # IceCache: i / 20
    assert [p for _, p in depth_grid(3, "quest")] == [33, 66, 99]
    tok = stub_tokenizer("<s>", None)
    _, opts = model_eval_config("llama-3.1-8b-instruct", "passkey_quest")
    opts.update(lengths=[1000], length_unit="chars", depths=3)
    suite = Passkey(tok, max_length=4096, **opts)
    for s, pct in zip(suite.samples(), (33, 66, 99)):
        key = int(s.reference)
        garbage_inf = " ".join([GARBAGE] * 10000)
        n_prefix = int(1000 * pct / 100)  # Quest generate_prompt
        text = "\n".join([TASK, garbage_inf[:n_prefix], f"The pass key is {key}. Remember it. {key} is the pass key.",
                          garbage_inf[:1000 - n_prefix], QUESTION])
        assert tok.decode(s.prompt_ids) == "<s>" + text[:-400]  # pipe.tokenizer(text)
        assert s.decode_ids == tok(text[-400:])["input_ids"][1:]  # q_input.input_ids[:, 1:]
        assert len(s.decode_ids) == 400


def test_passkey_answers_compare_as_integers():
    assert passkey_correct("012345 is the key", 12345)  # Quest: int(re.search(r"\d+", response).group())
    assert passkey_correct(" 7.", "0007")
    assert not passkey_correct("1234", 12345) and not passkey_correct("no digits", 1)
    assert not passkey_correct("The key is 99, or 12345", 12345)  # the first number counts
    tok = stub_tokenizer("<s>", None)
    suite = Passkey(tok, lengths=[200], length_unit="chars", depths=1)
    sample = next(suite.samples())
    assert suite.score(sample, "0" + sample.reference)["score"] == 1.0


@pytest.mark.parametrize("model", sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "conf" / "model")
                                         .glob("*.yaml")))
def test_every_model_config_names_its_wrappers_and_every_suite_resolves(model):
    """Each model config's ``prompt:`` block reaches the suites (the run's resolved config records it)."""
    for suite in ("longbench", "ruler", "passkey", "passkey_icecache", "passkey_quest", "gsm8k", "longgenbench"):
        model_cfg, opts = model_eval_config(model, suite)
        if suite == "longbench":
            assert opts["chat_format"] == model_cfg["prompt"]["longbench"]
            assert opts["system_prompt"] == model_cfg["prompt"]["system_prompt"]
            assert opts["chat_template_kwargs"] == model_cfg["prompt"]["chat_template_kwargs"]
        if suite == "ruler":
            assert opts["model_template"] == model_cfg["prompt"]["ruler"]
    qwen = model.startswith("qwen3")
    assert (model_cfg["prompt"]["chat_template_kwargs"] == {"enable_thinking": False}) == qwen
