"""Encoder-decoder (T5, BART) fine-tuning in the next-token recipe: which configs it is, what they cannot use.

The recipe's loss runs unchanged on an encoder-decoder's batches (:mod:`automodel.training.next_token` pairs
``logits[i]`` with ``labels[i]`` when the built model's config says ``is_encoder_decoder``), the data set supplies
the decoder's inputs (:class:`automodel_llm.datasets.Seq2SeqDataset`). What assumes one causal token stream is
refused here, at validation, with the reason.
"""

from __future__ import annotations

from typing import Any

from automodel.config import Config
from automodel.errors import AutomodelError, ConfigIssue
from automodel.training.parallelism import model_hf_config

SEQ2SEQ_MODEL = "automodel_llm.AutoModelForSeq2SeqLM"
SEQ2SEQ_DATASET = "automodel_llm.datasets.Seq2SeqDataset"
_USE_SEQ2SEQ_DATASET = ("use make_seq2seq_dataset (nemo_automodel.components.datasets.llm.seq2seq."
                        "make_seq2seq_dataset), whose samples carry the decoder's inputs")


def is_encoder_decoder(cfg: Config) -> bool:
    """Whether the model section builds an encoder-decoder: upstream's NeMoAutoModelForSeq2SeqLM (ours), or a
    config that says so (``is_encoder_decoder``) where it can be read without building the model."""
    target = getattr(cfg.model, "target", None)
    if isinstance(target, str) and cfg.resolver.expand(target).startswith(SEQ2SEQ_MODEL + "."):
        return True
    return bool(getattr(model_hf_config(cfg), "is_encoder_decoder", False))


def seq2seq_issues(cfg: Config, datasets: list[tuple[str, Any, Any]], unsupported: str | None) -> list[ConfigIssue]:
    """What an encoder-decoder run cannot use (``datasets``: the data set sections, see
    :func:`automodel_llm.tokenizer.dataset_sections`; ``unsupported``: the recipe's reason it trains none), and a
    :class:`Seq2SeqDataset` feeding a causal LM."""
    seq2seq_data = [key for key, node, _ in datasets if cfg.resolver.expand(node.target) == SEQ2SEQ_DATASET]
    if not is_encoder_decoder(cfg):
        return [ConfigIssue(f"{key}._target_", "make_seq2seq_dataset's samples (a source for the encoder, a target "
                            "for the decoder) are for an encoder-decoder model, but model builds a causal LM; use "
                            "model._target_: NeMoAutoModelForSeq2SeqLM.from_pretrained (T5, BART, ...) or a causal "
                            "data set (make_squad_dataset, ...)") for key in seq2seq_data]
    if unsupported is not None:
        return [ConfigIssue("model._target_", unsupported)]
    issues = [ConfigIssue(f"{key}._target_", f"its samples are one causal token stream, but model builds an "
                          f"encoder-decoder, which reads a source and a target; {_USE_SEQ2SEQ_DATASET}")
              for key, node, _ in datasets if key not in seq2seq_data]
    settings = cfg.distributed
    for name, why in (("tp_size", "tensor parallelism shards by a causal LM's plan"),
                      ("pp_size", "pipeline stages split one stack of decoder layers"),
                      ("cp_size", "context parallelism splits one causal token stream")):
        size = getattr(settings, name, 1) if settings is not None else 1
        if size > 1:
            issues.append(ConfigIssue(f"distributed.{name}", f"{size}: {why}, which an encoder-decoder model does "
                                      f"not have; set {name}: 1 (FSDP2 / DDP over data-parallel ranks work)"))
    packing = cfg.get("packed_sequence")
    if packing is not None and (packing.enabled or (packing.packed_sequence_size or 0) > 0):
        issues.append(ConfigIssue("packed_sequence.packed_sequence_size", "packing joins samples into one causal "
                                  "row, but an encoder-decoder's sample is a source and a target apart; turn "
                                  "packing off (packed_sequence_size: 0, enabled: false)"))
    generation = cfg.get("eval_generation")
    if "eval_generation" in cfg and generation is not None and generation.enabled:
        issues.append(ConfigIssue("eval_generation.enabled", "the exact-match generation continues a causal "
                                  "prompt; it does not run an encoder-decoder's generate; set "
                                  "eval_generation.enabled: false (validation reports the loss)"))
    return issues


def check_decoder_start(model: Any, datasets: list[Any]) -> None:
    """A :class:`Seq2SeqDataset` must start the decoder from the model's own ``decoder_start_token_id`` (T5: the
    pad id, BART: its EOS): teacher forcing with another start token trains a decoder that generation never runs."""
    wanted = getattr(getattr(model, "config", None), "decoder_start_token_id", None)
    for dataset in datasets:
        start = getattr(dataset, "decoder_start_token_id", None)
        if wanted is not None and start is not None and start != wanted:
            raise AutomodelError(f"dataset.decoder_start_token_id: the decoder inputs start from {start}, but the "
                                 f"model's decoder_start_token_id is {wanted}; set decoder_start_token_id: {wanted}")
