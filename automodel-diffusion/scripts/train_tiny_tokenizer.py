#!/usr/bin/env python
"""Train the tiny tokenizers of the diffusion examples on the tiny_shapes captions, and ship them.

* CLIP: a byte-level BPE with CLIP's normalisation, pre-tokenisation and ``</w>`` end-of-word suffix, so it is
  a real ``transformers.CLIPTokenizer`` (what diffusers' text-to-image pipelines load), with a vocabulary small
  enough that every caption word is one token. ``model_max_length`` is 16 (captions are 9 tokens with bos/eos).
  Written to ``tiny_flow/tokenizer``, ``tiny_flow/tokenizer_2`` and ``tiny_unet/tokenizer``.
* T5 (the SD3 pipeline's third encoder): a Unigram model (the captions' word frequencies) with T5's metaspace
  pre-tokenisation, as a ``transformers.T5Tokenizer`` without sentinel tokens. Written to ``tiny_flow/tokenizer_3``.

The text encoders' ``config.json`` beside them get the vocabulary sizes and special-token ids.

Usage::

    python automodel-diffusion/scripts/make_tiny_shapes.py      # the captions come from its generator
    python automodel-diffusion/scripts/train_tiny_tokenizer.py
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
from collections import Counter
from pathlib import Path

from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers, trainers
from tokenizers.models import BPE

HERE = Path(__file__).resolve().parent
ASSETS = HERE.parent / "src/automodel_diffusion/examples/assets"
TOKENIZER_DIRS = ("tiny_flow/tokenizer", "tiny_flow/tokenizer_2", "tiny_unet/tokenizer")
TEXT_ENCODER_DIRS = ("tiny_flow/text_encoder", "tiny_flow/text_encoder_2", "tiny_unet/text_encoder")
T5_TOKENIZER_DIR, T5_ENCODER_DIR = "tiny_flow/tokenizer_3", "tiny_flow/text_encoder_3"
BOS, EOS = "<|startoftext|>", "<|endoftext|>"
MAX_LENGTH = 16

sys.path.insert(0, str(HERE))
from make_tiny_shapes import all_captions  # noqa: E402


def train(vocab_size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    tokenizer = Tokenizer(BPE(continuing_subword_prefix="", end_of_word_suffix="</w>", unk_token=EOS))
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Lowercase()])
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|"""
                                   r"""[\p{N}]|[^\s\p{L}\p{N}]+"""), behavior="removed", invert=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False),
    ])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS], end_of_word_suffix="</w>",
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = all_captions() * 4
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    model = json.loads(tokenizer.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return model["vocab"], merges


def train_t5() -> list[tuple[str, float]]:
    """A Unigram vocabulary, ordered as T5 expects (<pad> 0, </s> 1, <unk> 2, then the pieces).

    The maximum-likelihood unigram model of the caption words: each word, with T5's ``\u2581`` word-start mark,
    is one piece scored by its log frequency (the tokenizers library's UnigramTrainer needs a larger corpus than
    a few hundred captions to keep whole words); single characters, scored far lower, spell anything else.
    """
    counts = Counter(word for caption in all_captions() for word in caption.split())
    total = sum(counts.values())
    pieces = [("\u2581" + word, math.log(count / total)) for word, count in counts.most_common()]
    characters = sorted({ch for word in counts for ch in word} | set("abcdefghijklmnopqrstuvwxyz0123456789"))
    pieces += [("\u2581", -20.0)] + [(ch, -25.0) for ch in characters]
    return [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), *pieces]


def save_to(tokenizer, assets: Path, relative_dirs: tuple[str, ...]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        for rel in relative_dirs:
            target = assets / rel
            if target.exists():
                shutil.rmtree(target)
            target.mkdir(parents=True)
            for file in sorted(Path(tmp).iterdir()):
                shutil.copyfile(file, target / file.name)


def update_config(path: Path, values: dict) -> None:
    if path.is_file():
        config = json.loads(path.read_text())
        config.update(values)
        path.write_text(json.dumps(config, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab-size", type=int, default=320)
    parser.add_argument("--assets", type=Path, default=ASSETS)
    args = parser.parse_args()

    from transformers import CLIPTokenizer

    vocab, merges = train(args.vocab_size)
    tokenizer = CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=MAX_LENGTH)
    words = sorted({w for c in all_captions() for w in c.split()})
    for word in words:
        ids = tokenizer(word, add_special_tokens=False).input_ids
        assert len(ids) == 1, f"'{word}' is {len(ids)} tokens; raise --vocab-size"
    save_to(tokenizer, args.assets, TOKENIZER_DIRS)
    ids = {"vocab_size": len(tokenizer), "bos_token_id": tokenizer.bos_token_id,
           "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id,
           "max_position_embeddings": MAX_LENGTH}
    for rel in TEXT_ENCODER_DIRS:
        update_config(args.assets / rel / "config.json", ids)
    print(f"CLIP tokenizer: {len(tokenizer)} tokens, {len(words)} caption words (one token each); {ids}")

    from transformers import T5Tokenizer

    t5 = T5Tokenizer(vocab=train_t5(), extra_ids=0, model_max_length=MAX_LENGTH)
    assert (t5.pad_token_id, t5.eos_token_id, t5.unk_token_id) == (0, 1, 2)
    for word in words:
        ids = t5(word, add_special_tokens=False).input_ids
        assert len(ids) == 1, f"T5 tokenizer: '{word}' is {len(ids)} pieces"
    longest = max(len(t5(c).input_ids) for c in all_captions())
    assert longest <= MAX_LENGTH, f"T5 tokenizer: a caption is {longest} tokens"
    save_to(t5, args.assets, (T5_TOKENIZER_DIR,))
    t5_ids = {"vocab_size": len(t5), "pad_token_id": 0, "eos_token_id": 1, "decoder_start_token_id": 0}
    update_config(args.assets / T5_ENCODER_DIR / "config.json", t5_ids)
    print(f"T5 tokenizer: {len(t5)} pieces; {t5_ids}")
    print("written to " + ", ".join(str(args.assets / rel) for rel in (*TOKENIZER_DIRS, T5_TOKENIZER_DIR)))


if __name__ == "__main__":
    main()
