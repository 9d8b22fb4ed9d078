#!/usr/bin/env python
"""Train the tiny example WordPiece tokenizer (BERT style, lower-cased) on the tiny retrieval data.

Trained with the ``tokenizers`` library on every query and document of ``tiny_retrieval/``; saved as a
``transformers`` BERT tokenizer directory (``tokenizer.json``, ``tokenizer_config.json``, ``vocab.txt``,
``special_tokens_map.json``) that loads offline with ``AutoTokenizer.from_pretrained(path)``. Pairs encode as
``[CLS] query [SEP] document [SEP]`` with token type ids 0/1 (what the cross-encoder reads).

The tiny BERT's ``config.json`` (``tiny_bert/``) gets the tokenizer's vocabulary size and special ids.
Retraining encodes the data the same way (every word one token), but the trainer breaks frequency ties in hash
order, so the vocabulary's sub-word pieces and ids vary between runs (a checkpoint needs the tokenizer it was
trained with).

Usage::

    python automodel-retrieval/scripts/make_tiny_retrieval.py
    python automodel-retrieval/scripts/train_tiny_tokenizer.py
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

ASSETS = Path(__file__).resolve().parent.parent / "src/automodel_retrieval/examples/assets"
SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def iter_text(data_dir: Path):
    for name in ("train.jsonl", "validation.jsonl"):
        for line in (data_dir / name).read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            yield row["query"]
            yield row["positive"]
            yield from row.get("negatives", [])
    for line in (data_dir / "corpus.jsonl").read_text(encoding="utf-8").splitlines():
        yield json.loads(line)["text"]


def build(data_dir: Path, vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]", max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True, strip_accents=True, clean_text=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, min_frequency=1, special_tokens=SPECIAL_TOKENS,
                                        show_progress=False)
    tok.train_from_iterator(iter_text(data_dir), trainer=trainer)
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)])
    return tok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=ASSETS / "tiny_retrieval")
    parser.add_argument("--out", type=Path, default=ASSETS / "tiny_tokenizer")
    parser.add_argument("--model-config", type=Path, default=ASSETS / "tiny_bert" / "config.json")
    parser.add_argument("--vocab-size", type=int, default=1024)
    args = parser.parse_args()

    from transformers import BertTokenizerFast

    tok = build(args.data, args.vocab_size)
    fast = BertTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", sep_token="[SEP]", pad_token="[PAD]",
                             cls_token="[CLS]", mask_token="[MASK]", do_lower_case=True, model_max_length=128,
                             padding_side="right")
    args.out.mkdir(parents=True, exist_ok=True)
    for stale in args.out.iterdir():
        stale.unlink()
    fast.save_pretrained(str(args.out))
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    (args.out / "vocab.txt").write_text("".join(f"{t}\n" for t, _ in vocab), encoding="utf-8")
    (args.out / "special_tokens_map.json").write_text(json.dumps(
        {"unk_token": "[UNK]", "sep_token": "[SEP]", "pad_token": "[PAD]", "cls_token": "[CLS]",
         "mask_token": "[MASK]"}, indent=2) + "\n", encoding="utf-8")
    if args.model_config.is_file():
        config = json.loads(args.model_config.read_text(encoding="utf-8"))
        config.update(vocab_size=tok.get_vocab_size(), pad_token_id=tok.token_to_id("[PAD]"))
        args.model_config.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    print(f"saved tokenizer (vocab {tok.get_vocab_size()}) to {args.out}")


if __name__ == "__main__":
    main()
