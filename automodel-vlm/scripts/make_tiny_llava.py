#!/usr/bin/env python
"""Train the tiny tokenizer and write the tiny Llava configs of the ``vlm/tiny_llava`` example.

Writes, under ``src/automodel_vlm/examples/assets/``:

* ``tiny_tokenizer/``: a byte-level BPE (any text encodes, no ``<unk>`` needed) trained on the questions and
  answers of ``tiny_shapes`` and the chat template's words, so that each of them is one token. Special tokens:
  ``<pad>`` 0, ``<s>`` 1 (bos), ``</s>`` 2 (eos), ``<unk>`` 3 and ``<image>`` 4, the placeholder the processor
  expands into one token per image patch. Its ``chat_template`` renders multimodal messages (content given as
  a string or as ``{"type": "image"}`` / ``{"type": "text", "text": ...}`` parts) as ``role: content`` lines;
  every assistant turn ends with eos, and the generation prompt is ``assistant:``.
* ``tiny_image_processor/preprocessor_config.json``: a CLIPImageProcessor config for 32x32 images (CLIP's mean
  and std). transformers loads it with its Pillow backend when torchvision is absent.
* ``tiny_llava/config.json``: a LlavaConfig joining a 2-layer, 32-wide CLIP vision tower (patch 8: 16 patches
  plus CLS) and a 2-layer, 64-wide Llama with this tokenizer's vocabulary; ``vision_feature_select_strategy:
  default`` drops CLS, so each image is 16 ``<image>`` tokens.

Processor = ``LlavaProcessor(image_processor, tokenizer, patch_size=8, vision_feature_select_strategy="default",
num_additional_image_tokens=1)``, built from these parts by ``automodel_vlm.processor.build_processor`` (see the
example YAML). Everything is deterministic: run it again and the files are the same.

Usage::

    python automodel-vlm/scripts/make_tiny_shapes.py
    python automodel-vlm/scripts/make_tiny_llava.py
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ASSETS = Path(__file__).resolve().parent.parent / "src/automodel_vlm/examples/assets"

PAD, BOS, EOS, UNK, IMAGE = "<pad>", "<s>", "</s>", "<unk>", "<image>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK, IMAGE]

# transformers renders chat templates with trim_blocks=True, so newlines are jinja expressions.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] }}:"
    "{% if message['content'] is string %}{{ ' ' + message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>' }}"
    "{% elif part['type'] == 'text' %}{{ ' ' + part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)

EXTRA_TEXT = ["system: user: assistant:", "Describe the image. What is in the picture?"]

IMAGE_PROCESSOR = {
    "image_processor_type": "CLIPImageProcessor",
    "do_resize": True, "size": {"shortest_edge": 32}, "resample": 3,
    "do_center_crop": True, "crop_size": {"height": 32, "width": 32},
    "do_rescale": True, "rescale_factor": 0.00392156862745098,
    "do_normalize": True, "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "do_convert_rgb": True,
}


def model_config(vocab_size: int, image_token_id: int) -> dict:
    return {
        "architectures": ["LlavaForConditionalGeneration"],
        "model_type": "llava",
        "image_token_index": image_token_id,
        "image_seq_length": 16,
        "projector_hidden_act": "gelu",
        "multimodal_projector_bias": True,
        "vision_feature_select_strategy": "default",
        "vision_feature_layer": -1,
        "tie_word_embeddings": False,
        "vision_config": {
            "model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_channels": 3, "image_size": 32, "patch_size": 8,
            "projection_dim": 32, "hidden_act": "quick_gelu", "layer_norm_eps": 1e-05, "attention_dropout": 0.0,
            "initializer_range": 0.02, "initializer_factor": 1.0,
        },
        "text_config": {
            "model_type": "llama", "vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 16,
            "hidden_act": "silu", "max_position_embeddings": 128, "initializer_range": 0.02,
            "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "attention_bias": False, "mlp_bias": False,
            "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
        },
        "pad_token_id": 0,
        "dtype": "float32",
    }


def iter_text(data_dir: Path):
    for split in ("train", "validation"):
        with (data_dir / f"{split}.jsonl").open(encoding="utf-8") as f:
            for line in f:
                for message in json.loads(line)["messages"]:
                    yield f"{message['role']}: " + " ".join(p["text"] for p in message["content"] if "text" in p)
    yield from EXTRA_TEXT


def train(data_dir: Path, vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=1, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(iter_text(data_dir), trainer=trainer)
    return tok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=ASSETS / "tiny_shapes")
    parser.add_argument("--out", type=Path, default=ASSETS)
    parser.add_argument("--vocab-size", type=int, default=384)
    args = parser.parse_args()

    from transformers import PreTrainedTokenizerFast

    tok = train(args.data, args.vocab_size)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   unk_token=UNK, model_max_length=128, padding_side="right")
    out = args.out / "tiny_tokenizer"
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.iterdir():
        stale.unlink()
    fast.save_pretrained(str(out))
    # An explicit layout that does not depend on the transformers version: the chat template and the image
    # token inside tokenizer_config.json, no chat_template.jinja.
    (out / "chat_template.jinja").unlink(missing_ok=True)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    cfg.update({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
                "unk_token": UNK, "add_bos_token": False, "add_eos_token": False, "model_max_length": 128,
                "padding_side": "right", "chat_template": CHAT_TEMPLATE})
    cfg.pop("extra_special_tokens", None)
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")

    image_dir = args.out / "tiny_image_processor"
    image_dir.mkdir(parents=True, exist_ok=True)
    (image_dir / "preprocessor_config.json").write_text(json.dumps(IMAGE_PROCESSOR, indent=2) + "\n")

    vocab = tok.get_vocab_size()
    model_dir = args.out / "tiny_llava"
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(model_config(vocab, tok.token_to_id(IMAGE)), indent=2) + "\n")
    print(f"tokenizer: {vocab} tokens (<image> = {tok.token_to_id(IMAGE)}) in {out}; configs in {image_dir}, "
          f"{model_dir}")


if __name__ == "__main__":
    main()
