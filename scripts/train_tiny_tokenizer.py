#!/usr/bin/env python
"""Train the tiny example tokenizer on the tiny SQuAD example data.

A byte-level BPE (GPT-2 style, so any text can be encoded without ``<unk>``)
with a small vocabulary, trained on the contexts, questions and prompt words of
``tiny_squad/{train,validation}.jsonl``.  ``--vocab-size`` is an upper bound:
on this small corpus BPE runs out of merges first (482 tokens for the shipped
data), so every word of the data set, with its leading space, is a single
token.  ``tiny_llama/config.json``'s ``vocab_size`` must equal ``len(tokenizer)``
(re-check it after regenerating).

Special tokens: ``<pad>`` (0), ``<s>`` (1, bos), ``</s>`` (2, eos), ``<unk>`` (3).
A TemplateProcessing post-processor prepends ``<s>`` when the tokenizer is
called with ``add_special_tokens=True`` (the default).  The tokenizer also
carries a plain-text ``chat_template``.

Saved as a ``transformers.PreTrainedTokenizerFast`` directory that loads
offline with ``AutoTokenizer.from_pretrained(path)``.

Usage::

    python scripts/make_tiny_squad.py
    python scripts/train_tiny_tokenizer.py
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ASSETS = (
    Path(__file__).resolve().parent.parent / "automodel-llm/src/automodel_llm/examples/assets"
)
DEFAULT_DATA = ASSETS / "tiny_squad"
DEFAULT_OUT = ASSETS / "tiny_tokenizer"

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK]

# Plain text lines "role: content"; every assistant turn ends with eos.  With
# add_generation_prompt a trailing "assistant:" opens the reply.  The newline
# is a jinja expression because transformers renders chat templates with
# trim_blocks=True, which would eat a literal newline after a block tag.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)

# Extra text so the words of the prompt format and of the chat template are
# whole tokens too.
EXTRA_TEXT = [
    "Context: Question: Answer:",
    "system: user: assistant:",
]


def iter_text(data_dir: Path):
    for split in ("train", "validation"):
        with (data_dir / f"{split}.jsonl").open(encoding="utf-8") as f:
            for line in f:
                row = json.loads(line)
                yield (
                    f"Context: {row['context']} Question: {row['question']} "
                    f"Answer: {row['answers']['text'][0]}"
                )
    yield from EXTRA_TEXT


def build(data_dir: Path, vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(iter_text(data_dir), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, bos_id)],
    )
    return tok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--vocab-size", type=int, default=640)
    args = parser.parse_args()

    from transformers import PreTrainedTokenizerFast

    tok = build(args.data, args.vocab_size)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        model_max_length=128,
        padding_side="right",
    )
    fast.chat_template = CHAT_TEMPLATE
    args.out.mkdir(parents=True, exist_ok=True)
    for stale in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                  "chat_template.jinja"):
        (args.out / stale).unlink(missing_ok=True)
    fast.save_pretrained(str(args.out))

    # Make the on-disk layout explicit and independent of the transformers
    # version: chat_template inside tokenizer_config.json (no separate
    # chat_template.jinja), add_bos_token/add_eos_token recorded, and a
    # special_tokens_map.json.
    (args.out / "chat_template.jinja").unlink(missing_ok=True)
    cfg_path = args.out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    cfg.update(
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS,
            "eos_token": EOS,
            "pad_token": PAD,
            "unk_token": UNK,
            "add_bos_token": True,
            "add_eos_token": False,
            "model_max_length": 128,
            "padding_side": "right",
            "chat_template": CHAT_TEMPLATE,
        }
    )
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    (args.out / "special_tokens_map.json").write_text(
        json.dumps(
            {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK}, indent=2
        )
        + "\n",
        encoding="utf-8",
    )
    print(
        f"saved tokenizer (vocab {tok.get_vocab_size()}, bos={tok.token_to_id(BOS)}, "
        f"eos={tok.token_to_id(EOS)}, pad={tok.token_to_id(PAD)}, unk={tok.token_to_id(UNK)}) "
        f"to {args.out}"
    )


if __name__ == "__main__":
    main()
