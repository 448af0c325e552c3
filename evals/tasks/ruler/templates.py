"""RULER's model templates: :data:`RULER_TEMPLATES` is ``NVIDIA/RULER`` ``scripts/data/template.py``
``Templates`` (text is data: copied exactly); the family of each model follows ``scripts/config_models.sh``
(llama3.1 -> ``meta-llama3``, llama2 -> ``meta-chat``) and is chosen in ``conf/model/<model>.yaml``
(``prompt.ruler``).
"""
from __future__ import annotations

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


def ruler_wrapper(name: str) -> tuple[str, str]:
    """(head, tail) of RULER's model template ``name`` around ``{task_template}``."""
    if name not in RULER_TEMPLATES:
        raise ValueError(f"unknown RULER model template {name!r}; valid: auto, chat, {', '.join(RULER_TEMPLATES)}")
    head, tail = RULER_TEMPLATES[name].split("{task_template}")
    return head, tail
