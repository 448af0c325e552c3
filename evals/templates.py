"""Prompt wrappers of the paper models, as the official evaluation scripts build them (text is data: copied
exactly from the files cited below).

Which wrapper a suite uses is chosen per model in ``conf/model/<model>.yaml`` (``prompt:`` block) and passed
to the suites through ``conf/eval/*.yaml`` interpolations, so ``python run.py --cfg job model=<m> eval=<s>``
shows it and every run records it in its resolved config.

LongBench (``chat_format``), after ``THUDM/LongBench`` ``LongBench/pred.py`` ``build_chat`` and the IceCache
benchmark ``IceCache/benchmark/longbench_pred.py`` ``build_chat`` (PQCache ``LongBench/pred.py`` is the same):

- ``template``: the tokenizer's chat template, with an optional system turn; ``chat_template_kwargs`` are
  passed through (Qwen3: ``enable_thinking=False``, as IceCache's script passes for every "qwen" model).
- ``inst``: ``f"[INST]{prompt}[/INST]"`` (official llama2 branch; IceCache/PQCache Mistral branch).
- ``vicuna``: FastChat's ``get_conversation_template("vicuna")`` conversation (``vicuna_v1.1``), as both
  scripts build it for "longchat"/"vicuna" models: :func:`vicuna_prompt`.
- ``none``: no wrapper.

RULER: :data:`RULER_TEMPLATES` is ``NVIDIA/RULER`` ``scripts/data/template.py`` ``Templates``; the family of
each model follows ``scripts/config_models.sh`` (llama3.1 -> ``meta-llama3``, llama2 -> ``meta-chat``).
"""
from __future__ import annotations

# FastChat fastchat/conversation.py, register_conv_template(Conversation(name="vicuna_v1.1", ...)):
# system_message, roles ("USER", "ASSISTANT"), sep_style ADD_COLON_TWO, sep " ", sep2 "</s>".
VICUNA_SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. "
                 "The assistant gives helpful, detailed, and polite answers to the user's questions.")

# NVIDIA/RULER scripts/data/template.py (exact).
RULER_TEMPLATES: dict[str, str] = {
    "base": "{task_template}",
    "meta-chat": "[INST] {task_template} [/INST]",
    "vicuna-chat": "A chat between a curious user and an artificial intelligence assistant. The assistant gives "
                   "helpful, detailed, and polite answers to the user's questions. USER: {task_template} ASSISTANT:",
    "lwm-chat": "You are a helpful assistant. USER: {task_template} ASSISTANT: ",
    "command-r-chat": "<BOS_TOKEN><|START_OF_TURN_TOKEN|><|USER_TOKEN|>{task_template}<|END_OF_TURN_TOKEN|>"
                      "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>",
    "chatglm-chat": "[gMASK]sop<|user|> \n {task_template}<|assistant|> \n ",
    "RWKV": "User: hi\n\nAssistant: Hi. I am your assistant and I will provide expert full response in full details. "
            "Please feel free to ask any question and I will always answer it\n\nUser: {task_template}\n\nAssistant:",
    "Phi3": "<|user|>\n{task_template}<|end|>\n<|assistant|>\n",
    "meta-llama3": "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n{task_template}<|eot_id|>"
                   "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "jamba": "<|startoftext|><|bom|><|system|> <|eom|><|bom|><|user|> {task_template}<|eom|><|bom|><|assistant|>",
}

LONGBENCH_CHAT_FORMATS = ("template", "inst", "vicuna", "none")


def inst_prompt(prompt: str) -> str:
    """``f"[INST]{prompt}[/INST]"``: LongBench ``pred.py`` (llama2) and IceCache/PQCache (Mistral), no spaces."""
    return f"[INST]{prompt}[/INST]"


def vicuna_prompt(prompt: str) -> str:
    """FastChat ``vicuna_v1.1`` with one user turn and an empty assistant turn, as LongBench ``pred.py``
    builds it (``conv.append_message(USER, prompt); conv.append_message(ASSISTANT, None); conv.get_prompt()``):
    ADD_COLON_TWO renders ``system + sep``, then ``"USER: " + prompt + sep``, then ``"ASSISTANT:"``."""
    return f"{VICUNA_SYSTEM} USER: {prompt} ASSISTANT:"


def chat_text(tokenizer, user: str, system: str | None = None, chat_template_kwargs: dict | None = None) -> str:
    """The tokenizer's chat template rendered as text for one user turn (after an optional system turn),
    generation prompt added; ``chat_template_kwargs`` (e.g. ``enable_thinking=False``) reach the template."""
    messages = [{"role": "user", "content": user}]
    if system:
        messages.insert(0, {"role": "system", "content": system})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         **dict(chat_template_kwargs or {}))


def ruler_wrapper(name: str) -> tuple[str, str]:
    """(head, tail) of RULER's model template ``name`` around ``{task_template}``."""
    if name not in RULER_TEMPLATES:
        raise ValueError(f"unknown RULER model template {name!r}; valid: auto, chat, {', '.join(RULER_TEMPLATES)}")
    head, tail = RULER_TEMPLATES[name].split("{task_template}")
    return head, tail
