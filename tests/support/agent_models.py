"""Model directories for the Responses / Messages fixtures: the simulator's tokenizer with two templates.

``sim``: the simulated fleet's own template (``SIM_CHAT_TEMPLATE``: takes system messages anywhere).
``strict``: a template of ours that refuses a system message after the first message (as Qwen's do, so
vLLM merges Anthropic's inline system messages into the first one), renders reasoning, tool-call ids,
tool results with their call ids, the tools, and ``reasoning_effort`` / ``enable_thinking``.

The same builder serves ``tools/agent_fixtures.py`` (which hands the directories to ``vllm launch render``)
and the tests; ``fingerprint`` hashes a directory so a test notices when it is not what vLLM rendered.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from kvrouter.lab.sim.server.tokenizer import SIM_CHAT_TEMPLATE
from tokenizer_cache import default_tokenizer_path

MAX_MODEL_LEN = 16384

STRICT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}"
    "{%- if not loop.first -%}{{- raise_exception('system messages must come first') -}}{%- endif -%}"
    "{{- '[SYSTEM]' + m['content'] + '\\n' -}}"
    "{%- elif m['role'] == 'user' -%}"
    "{{- '[USER]' + m['content'] + '\\n' -}}"
    "{%- elif m['role'] == 'assistant' -%}"
    "{{- '[ASSISTANT]' -}}"
    "{%- if m['reasoning_content'] is defined and m['reasoning_content'] -%}"
    "{{- '<think>' + m['reasoning_content'] + '</think>' -}}"
    "{%- endif -%}"
    "{{- m['content'] or '' -}}"
    "{%- if m['tool_calls'] is defined and m['tool_calls'] -%}"
    "{%- for c in m['tool_calls'] -%}"
    "{{- '[CALL ' + (c['id'] or '') + '] ' + c['function']['name'] + ' ' -}}"
    "{{- c['function']['arguments'] | tojson -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '\\n' -}}"
    "{%- elif m['role'] == 'tool' -%}"
    "{{- '[RESULT ' + (m['tool_call_id'] or '') + ']' + m['content'] + '\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if tools -%}{{- '[TOOLS]' + (tools | tojson) + '\\n' -}}{%- endif -%}"
    "{%- if reasoning_effort is defined and reasoning_effort -%}{{- '[EFFORT ' + reasoning_effort + ']' -}}"
    "{%- endif -%}"
    "{%- if add_generation_prompt -%}{{- '[ASSISTANT]' -}}"
    "{%- if enable_thinking is defined and enable_thinking -%}{{- '<think>' -}}{%- endif -%}"
    "{%- endif -%}"
)

TEMPLATES = {"sim": SIM_CHAT_TEMPLATE, "strict": STRICT_TEMPLATE}


def build_model(name: str, directory: Path) -> Path:
    """Write the model directory ``name`` (tokenizer.json, tokenizer_config.json, config.json)."""
    src = Path(default_tokenizer_path())
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src / "tokenizer.json", directory / "tokenizer.json")
    config = json.loads((src / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["chat_template"] = TEMPLATES[name]
    config["model_max_length"] = MAX_MODEL_LEN
    _write(directory / "tokenizer_config.json", config)
    vocab = len(json.loads((src / "tokenizer.json").read_text(encoding="utf-8"))["model"]["vocab"]) + 1024
    _write(
        directory / "config.json",
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "num_hidden_layers": 2,
            "vocab_size": vocab,
            "max_position_embeddings": MAX_MODEL_LEN,
            "torch_dtype": "float32",
        },
    )
    return directory


def fingerprint(directory: Path) -> str:
    """sha256 over the directory's files (names and bytes), in name order."""
    h = hashlib.sha256()
    for p in sorted(directory.iterdir()):
        if p.is_file():
            h.update(p.name.encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def _write(path: Path, value: object) -> None:
    path.write_text(json.dumps(value, ensure_ascii=False, indent=1, sort_keys=True), encoding="utf-8")
