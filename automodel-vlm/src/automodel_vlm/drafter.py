"""Gemma 4 trained jointly with its drafter (upstream's ``Gemma4WithDrafter``): the base image-text-to-text model
and transformers' ``Gemma4AssistantForCausalLM``, the small model that drafts tokens for speculative decoding from
the base's last hidden state and its shared key/value states.

The training forward teacher-forces the drafting loop transformers runs at generation time
(``Gemma4AssistantCandidateGenerator``): there, the drafter's first round reads the embedding of the token the base
just emitted, ``x[t+1]``, beside the base's last hidden state at ``t``, sits at position ``t + 1``, attends to the
base's keys and values of positions ``0..t`` and drafts ``x[t+2]``; round ``k`` reads ``x[t+1+k]`` beside the
drafter's own projected state of round ``k - 1`` at the same position and drafts ``x[t+2+k]``. Here every position
``t`` of a row is such a query at once: the key/value states are the base's of the whole row, masked causally (full
attention: ``0..t``; sliding layers: ``t - sliding_window .. t``, the keys transformers' assistant sees at generation),
so no query sees the tokens it drafts.

The loss is the base's next-token loss + ``drafter_loss_weight`` x the sum over the rounds of each round's summed
cross entropy (:meth:`Gemma4WithDrafter.drafter_loss`), divided by the step's label tokens: upstream's
``L_base + lambda * sum_k L_k``; the run logs both parts (``loss_base``, ``loss_drafter``). The drafter's logits are
its dense output head over the whole vocabulary (a released drafter's ``use_ordered_embeddings`` scores only the top
clusters' tokens at generation time; its centroids get no gradient and are frozen, as upstream freezes them).

Upstream's masks differ: it passes the drafter the row's attention mask, which transformers' assistant turns into
bidirectional attention over every key of the row (each position sees the keys of the tokens it is asked to draft).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from automodel.errors import AutomodelError, ConfigIssue
from automodel.meta_build import building_whole
from automodel.model_kwargs import mtp_model_issues
from automodel.mtp.heads import shift_left
from automodel.training.checkpoint import load_safetensors_dir, load_weights_into
from automodel.training.loss import IGNORE_INDEX
from automodel.training.modules import unwrap

TARGET = "automodel_vlm.drafter.Gemma4WithDrafter.from_pretrained"
DRAFTER_DIR = "drafter"  # model/<this>: the drafter's own Hugging Face directory
# the keys this model takes itself; the others go to the base's AutoModelForImageTextToText.from_pretrained
SWITCHES = ("base_activation_checkpointing", "freeze_base_for_drafter", "share_embedding_with_base")
OWN_KEYS = ("drafter_path", "drafter_loss_weight", "drafter_num_steps", *SWITCHES)
# what the drafter's from_pretrained takes of the section's keys (the hub's; the rest are the base's)
DRAFTER_HUB_KEYS = ("token", "use_auth_token", "cache_dir", "local_files_only", "force_download", "proxies")
LINEAR_CE = "automodel.training.linear_ce.LinearCrossEntropy"


def _own_issues(kwargs: Mapping[str, Any]) -> dict[str, str]:
    issues = {}
    steps = kwargs.get("drafter_num_steps", 1)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        issues["drafter_num_steps"] = f"expected a whole number of drafting rounds, 1 or more, found {steps!r}"
    weight = kwargs.get("drafter_loss_weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight < 0:
        issues["drafter_loss_weight"] = f"expected a number >= 0 (the drafter loss's weight), found {weight!r}"
    for key in SWITCHES:
        if not isinstance(kwargs.get(key, False), bool):
            issues[key] = f"expected true or false, found {kwargs[key]!r}"
    return issues


def uses_drafter(cfg: Any) -> bool:
    """Whether the config's model section builds :class:`Gemma4WithDrafter` (by any alias)."""
    node = cfg.get("model")
    target = getattr(node, "target", None)
    return isinstance(target, str) and cfg.resolver.expand(target) == TARGET


def drafter_issues(cfg: Any) -> list[ConfigIssue]:
    """What the joint training cannot run with: the drafter reads the base's whole-sequence key/value states and
    last hidden state inside one forward, which pipeline stages, tensor-parallel shards and context-parallel
    sequence parts each split; LoRA adapters, packed rows (a drafted token would cross into the next sample), the
    loss computed inside the output head and a sharded-only model/ are not implemented for it."""
    why = "the drafter reads the base's key/value states and last hidden state of the whole sequence"
    issues = []
    settings = cfg.distributed
    for key in ("tp_size", "pp_size", "cp_size"):
        size = getattr(settings, key) if settings is not None else 1
        if size > 1:
            issues.append(ConfigIssue(f"distributed.{key}", f"{size}: not supported with Gemma4WithDrafter: {why}, "
                                      f"which {key.removesuffix('_size')} splits; set it to 1 (FSDP2 over "
                                      "data-parallel ranks shards it instead)"))
    if "peft" in cfg:
        issues.append(ConfigIssue("peft", "LoRA adapters are not implemented for Gemma4WithDrafter (upstream refuses "
                                          "them too); remove the section to train both models fully"))
    if "packed_sequence" in cfg:
        issues.append(ConfigIssue("packed_sequence", "packed rows are not supported with Gemma4WithDrafter (its "
                                                     "drafted tokens and attention would cross from one sample into "
                                                     "the next); remove the section"))
    loss = cfg.get("loss_fn")
    target = getattr(loss, "target", None)
    if isinstance(target, str) and cfg.resolver.expand(target) == LINEAR_CE:
        issues.append(ConfigIssue("loss_fn._target_", "FusedLinearCrossEntropy computes the loss inside the base's "
                                                      "output head, but the drafter has a head of its own; use "
                                                      "MaskedCrossEntropy"))
    if cfg.checkpoint is not None:
        issues += cfg.checkpoint.no_sharded_form_issues("Gemma4WithDrafter writes model/ (the base) and "
                                                        "model/drafter/ as two Hugging Face directories")
    return issues


def _copy_embedding(base: nn.Module, drafter: nn.Module) -> None:
    """The base's token embedding copied into the drafter's (upstream's one-time alignment; they train apart)."""
    if base.weight.shape != drafter.weight.shape:
        raise AutomodelError(f"model.share_embedding_with_base: the base's token embedding is "
                             f"{tuple(base.weight.shape)} but the drafter's is {tuple(drafter.weight.shape)} (its "
                             "hidden size is its own); set it to false")
    with torch.no_grad():
        drafter.weight.copy_(base.weight)


class Gemma4WithDrafter(nn.Module):
    """The base (``base``: a transformers Gemma 4 image-text-to-text model) and its drafter (``drafter``:
    ``Gemma4AssistantForCausalLM``), trained together: the forward returns the base's output and, in training,
    keeps each drafting round's hidden states for :meth:`drafter_loss`."""

    def __init__(self, base: nn.Module, drafter: nn.Module, drafter_loss_weight: float = 1.0,
                 drafter_num_steps: int = 1):
        super().__init__()
        issues = _own_issues({"drafter_loss_weight": drafter_loss_weight, "drafter_num_steps": drafter_num_steps})
        if issues:
            raise AutomodelError("; ".join(f"model.{key}: {message}" for key, message in issues.items()))
        backbone = base.config.get_text_config().hidden_size
        if drafter.config.backbone_hidden_size != backbone:
            raise AutomodelError(f"model.drafter_path: the drafter was made for a base of hidden size "
                                 f"{drafter.config.backbone_hidden_size}, but this base's is {backbone}; use the "
                                 "drafter released with this Gemma 4 model")
        self.base, self.drafter = base, drafter
        self.drafter_loss_weight, self.drafter_num_steps = float(drafter_loss_weight), drafter_num_steps
        if drafter.masked_embedding is not None:  # its top-k picks clusters: no gradient reaches the centroids
            drafter.masked_embedding.requires_grad_(False)
        if drafter_num_steps == 1:  # the projected state feeds only a next round
            drafter.post_projection.requires_grad_(False)
        self._rounds: list[torch.Tensor] | None = None

    @staticmethod
    def automodel_config_issues(kwargs: Mapping[str, Any]) -> dict[str, str]:
        """Validation's check of the section: the base's keys as ``AutoModelForImageTextToText`` checks them, and
        this model's own."""
        return {**mtp_model_issues({k: v for k, v in kwargs.items() if k not in OWN_KEYS}), **_own_issues(kwargs)}

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str, *, drafter_path: str,
                        drafter_loss_weight: float = 1.0, drafter_num_steps: int = 1,
                        base_activation_checkpointing: bool = False, freeze_base_for_drafter: bool = False,
                        share_embedding_with_base: bool = False, **kwargs: Any) -> Gemma4WithDrafter:
        """The base from ``pretrained_model_name_or_path`` (``kwargs``: as for
        ``AutoModelForImageTextToText.from_pretrained``), the drafter from ``drafter_path`` (a released
        ``*-assistant`` checkpoint) in the same dtype. Upstream's switches: ``base_activation_checkpointing``, the
        base recomputes its layers' activations in the backward (transformers' activation checkpointing);
        ``freeze_base_for_drafter``, only the drafter trains; ``share_embedding_with_base``, the drafter's token
        embedding (its output head's weight too, tied to it) starts as a copy of the base's."""
        from transformers import Gemma4AssistantForCausalLM

        from automodel_vlm.models import AutoModelForImageTextToText

        with building_whole():  # both models whole on every rank (FSDP2 shards the pair after)
            base = AutoModelForImageTextToText.from_pretrained(pretrained_model_name_or_path, **kwargs)
        if getattr(base.config, "model_type", None) != "gemma4":
            raise AutomodelError(f"model.pretrained_model_name_or_path: '{pretrained_model_name_or_path}' is a "
                                 f"{base.config.model_type} model; Gemma4WithDrafter trains a Gemma 4 model")
        hub = {key: kwargs[key] for key in DRAFTER_HUB_KEYS if key in kwargs}
        try:
            drafter = Gemma4AssistantForCausalLM.from_pretrained(drafter_path, dtype=base.dtype, **hub)
        except (OSError, ValueError) as err:
            raise AutomodelError(f"model.drafter_path: cannot load '{drafter_path}' as a Gemma 4 assistant "
                                 f"(drafter): {err}") from None
        if base_activation_checkpointing:
            base.activation_checkpointing_enable()
        if share_embedding_with_base:
            _copy_embedding(base.get_input_embeddings(), drafter.get_input_embeddings())
        if freeze_base_for_drafter:
            base.requires_grad_(False)
        return cls(base, drafter, drafter_loss_weight, drafter_num_steps)

    @property
    def config(self) -> Any:
        return self.base.config

    def get_input_embeddings(self) -> nn.Module:
        return self.base.get_input_embeddings()

    def get_output_embeddings(self) -> nn.Module:
        return self.base.get_output_embeddings()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, **kwargs: Any) -> Any:
        """The base's forward (its output is returned); in training the drafter's rounds run after it."""
        if not self.training:
            return self.base(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
        output = self.base(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                           output_hidden_states=True, return_shared_kv_states=True, **kwargs)
        self._rounds = self.draft(input_ids, attention_mask, position_ids, output.hidden_states[-1],
                                  dict(output.shared_kv_states))
        output.hidden_states = output.shared_kv_states = None  # the drafter's: not the caller's to keep
        return output

    def draft(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None,
              hidden: torch.Tensor, shared_kv: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        """Each round's drafter hidden states (before its output head), teacher-forced (see the module docstring)."""
        from transformers.masking_utils import create_causal_mask

        drafter, embed = self.drafter, self.base.get_input_embeddings()
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        config = drafter.config.get_text_config()
        window = config.sliding_window
        mask_args = {"config": config, "inputs_embeds": hidden, "attention_mask": attention_mask, "cache": None,
                     "allow_is_causal_skip": False}
        # at generation the assistant's sliding layers see the base's last sliding_window + 1 keys
        masks = {"full_attention": create_causal_mask(**mask_args),
                 "sliding_attention": create_causal_mask(**mask_args,
                                                         and_mask_function=lambda b, h, q, kv: kv >= q - window)}
        state, rounds = hidden, []
        for k in range(self.drafter_num_steps):
            tokens = embed(shift_left(input_ids, k + 1, 0))
            inputs = drafter.pre_projection(torch.cat([tokens, state.to(tokens.dtype)], dim=-1))
            # logits_to_keep not an int: every position runs (transformers' slicing for generation is not wanted)
            out = drafter.model(inputs_embeds=inputs, attention_mask=masks, position_ids=position_ids + 1,
                                shared_kv_states=shared_kv, use_cache=False,
                                logits_to_keep=slice(None)).last_hidden_state
            rounds.append(out)
            state = drafter.post_projection(out) if k + 1 < self.drafter_num_steps else None
        return rounds

    def drafter_loss(self, labels: torch.Tensor, loss_fn: nn.Module) -> torch.Tensor:
        """The sum over the rounds of round ``k``'s summed ``loss_fn`` (reduction sum) of position ``t`` against
        ``labels[t + k + 2]``, from the last training forward (unweighted: the recipe applies
        ``drafter_loss_weight``); only the positions with a label go through the drafter's output head."""
        rounds, self._rounds = self._rounds, None
        if rounds is None:
            raise RuntimeError("the drafter did not run in this forward (the model was not in training mode)")
        total = rounds[0].new_zeros((), dtype=torch.float32)
        for k, hidden in enumerate(rounds):
            targets = shift_left(labels, k + 2, IGNORE_INDEX).reshape(-1)
            index = (targets != IGNORE_INDEX).nonzero().squeeze(1)
            rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, index)
            total = total + loss_fn(self.drafter.lm_head(rows), targets.index_select(0, index)).float()
        return total

    def save_pretrained(self, directory: Path, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """The base as a Hugging Face directory in ``directory``, the drafter in ``directory/drafter``
        (``state_dict``: the composite's whole weights, gathered from FSDP2 shards; None: this process holds them)."""
        state = self.state_dict() if state_dict is None else state_dict
        for name, part, where in (("base", self.base, directory), ("drafter", self.drafter, directory / DRAFTER_DIR)):
            own = {key.removeprefix(f"{name}."): tensor for key, tensor in state.items() if key.startswith(f"{name}.")}
            part.save_pretrained(str(where), state_dict=own)

    def load_weights(self, directory: Path) -> None:
        """Read what :meth:`save_pretrained` wrote (a resume)."""
        for part, where in ((self.base, directory), (self.drafter, directory / DRAFTER_DIR)):
            load_weights_into(part, load_safetensors_dir(where), where)


def find_composite(model: nn.Module) -> Gemma4WithDrafter | None:
    """The joint model inside DDP / compile wrappers, or None."""
    inner = unwrap(model)
    return inner if isinstance(inner, Gemma4WithDrafter) else None
