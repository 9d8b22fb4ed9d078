"""Upstream's ``recipe_args:`` section of its speculative-decoding draft recipes (``TrainEagle1Recipe``,
``TrainEagle2Recipe``, ``TrainEagle3Recipe``): the keys they share, each standing for the key of the same meaning here
or refused with the reason; each recipe adds its draft's own keys (:func:`draft_recipe_args`). Import-light: no
torch."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from automodel.config import ArgumentsFor

GPU_ONLY = "needs a CUDA GPU, which this machine lacks"
NOT_BUILT = "{what}, which is not built here: remove it"
_TARGET_SERVERS = ("serves the target from {name} on GPUs for the draft's training, which this build does not: "
                   "remove it (the target runs in the training processes, upstream's colocated backend)")

SHARED_KEYS = {
    "target_model_name_or_path": "model.pretrained_model_name_or_path", "trust_remote_code": "model.trust_remote_code",
    "target_attn_implementation": "model.attn_implementation",
    "train_data_path": "dataset.path_or_dataset_id", "train_split": "dataset.split",
    "val_data_path": "validation_dataset.path_or_dataset_id", "val_split": "validation_dataset.split",
    "seq_length": ("dataset.seq_length", "validation_dataset.seq_length"),
    "mask_reasoning_content": ("dataset.mask_reasoning_content", "validation_dataset.mask_reasoning_content"),
    "micro_batch_size": "step_scheduler.local_batch_size",
    "grad_accumulation_steps": "step_scheduler.grad_accumulation_steps",
    "num_epochs": "step_scheduler.num_epochs", "log_every_steps": "step_scheduler.log_interval",
    "ckpt_every_steps": "step_scheduler.checkpoint_interval",
    "save_checkpoint_every_epoch": "step_scheduler.save_checkpoint_every_epoch",
    "max_grad_norm": "clip_grad_norm.max_norm", "num_workers": "dataloader.num_workers",
    "shuffle_seed": "rng.seed", "packed_sequence_size": "packed_sequence.packed_sequence_size",
}
SHARED_IMPLIES = {
    "output_dir": (("checkpoint.checkpoint_dir", lambda out: f"{out}/checkpoints"),),
    # upstream's EAGLE data cuts a longer conversation to seq_length
    "seq_length": (("dataset.truncation", True), ("validation_dataset.truncation", True)),
}
SHARED_REFUSED = {
    "cached_target_path": NOT_BUILT.format(what="a target's supervision precomputed to disk (upstream's offline "
                                                "path, precompute_eagle3)"),
    "target_model_backend": _TARGET_SERVERS.format(name="another backend (sglang, vllm, remote)"),
    "sglang_args": _TARGET_SERVERS.format(name="SGLang"), "vllm_args": _TARGET_SERVERS.format(name="vLLM"),
    **dict.fromkeys(("remote_url", "remote_urls", "remote_timeout", "remote_max_retries", "target_prefetch_depth"),
                    _TARGET_SERVERS.format(name="remote servers")),
    **dict.fromkeys(("target_experts", "target_dispatcher", "target_attn_backend",
                     "target_enable_fsdp_optimizations"),
                    f"upstream's MoE / Transformer Engine kernels for the target {GPU_ONLY}: remove it"),
    "compile": NOT_BUILT.format(what="torch.compile of the draft"),
    "train_shuffle": ("false reads the data in order; the data order here is the seeded shuffle of every recipe: "
                      "remove it"),
    "wandb": "Weights & Biases settings: give them in the top-level wandb: section (logging)",
}


def draft_recipe_args(recipe: str, section: str, own: Iterable[str], refused: Mapping[str, str],
                      keys: Mapping[str, str] | None = None) -> ArgumentsFor:
    """The ``recipe_args:`` of upstream's ``recipe``: the shared keys, ``own`` keys standing for the same keys of
    the draft's ``section`` here, ``keys`` standing for the dotted keys they map to, and ``refused`` ones besides the
    shared refusals."""
    return ArgumentsFor(None, keys={**SHARED_KEYS, **{key: f"{section}.{key}" for key in own}, **(keys or {})},
                        implies=SHARED_IMPLIES, refused={**SHARED_REFUSED, **refused},
                        help=f"upstream's {recipe} arguments, each standing for the key of the same meaning here")
