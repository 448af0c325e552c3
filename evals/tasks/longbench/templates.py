"""LongBench's prompt wrappers (``chat_format``), as the official evaluation scripts build them (text is data:
copied exactly from the files cited below). Which wrapper runs is chosen per model in ``conf/model/<model>.yaml``
(``prompt.longbench``) and reaches the suite through ``conf/eval/longbench.yaml``, so
``python run.py --cfg job model=<m> eval=longbench`` shows it and every run records it in its resolved config.

After ``THUDM/LongBench`` ``LongBench/pred.py`` ``build_chat`` and the IceCache benchmark
``IceCache/benchmark/longbench_pred.py`` ``build_chat`` (PQCache ``LongBench/pred.py`` is the same):

- ``template``: the tokenizer's chat template, with an optional system turn; ``chat_template_kwargs`` are
  passed through (Qwen3: ``enable_thinking=False``, as IceCache's script passes for every "qwen" model;
  :func:`evals.task.chat_text`).
- ``inst``: ``f"[INST]{prompt}[/INST]"`` (official llama2 branch; IceCache/PQCache Mistral branch).
- ``vicuna``: FastChat's ``get_conversation_template("vicuna")`` conversation (``vicuna_v1.1``), as both
  scripts build it for "longchat"/"vicuna" models: :func:`vicuna_prompt`.
- ``none``: no wrapper.
"""
from __future__ import annotations

# FastChat fastchat/conversation.py, register_conv_template(Conversation(name="vicuna_v1.1", ...)):
# system_message, roles ("USER", "ASSISTANT"), sep_style ADD_COLON_TWO, sep " ", sep2 "</s>".
VICUNA_SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. "
                 "The assistant gives helpful, detailed, and polite answers to the user's questions.")

LONGBENCH_CHAT_FORMATS = ("template", "inst", "vicuna", "none")


def inst_prompt(prompt: str) -> str:
    """``f"[INST]{prompt}[/INST]"``: LongBench ``pred.py`` (llama2) and IceCache/PQCache (Mistral), no spaces."""
    return f"[INST]{prompt}[/INST]"


def vicuna_prompt(prompt: str) -> str:
    """FastChat ``vicuna_v1.1`` with one user turn and an empty assistant turn, as LongBench ``pred.py``
    builds it (``conv.append_message(USER, prompt); conv.append_message(ASSISTANT, None); conv.get_prompt()``):
    ADD_COLON_TWO renders ``system + sep``, then ``"USER: " + prompt + sep``, then ``"ASSISTANT:"``."""
    return f"{VICUNA_SYSTEM} USER: {prompt} ASSISTANT:"
