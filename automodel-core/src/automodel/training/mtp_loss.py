"""The MTP heads' part of a recipe (:mod:`automodel.mtp`): validation of the keys asking for them, the run's note
of what they are, and their loss added to the next-token loss. The LLM and VLM fine-tuning recipes mix it in."""

from __future__ import annotations

from typing import Any

import torch

from automodel.errors import ConfigIssue
from automodel.mtp.checks import mtp_asked, mtp_issues
from automodel.mtp.heads import MTPHeads, find_heads
from automodel.training.modules import unwrap
from automodel.training.parallelism import model_hf_config


class MTPLoss:
    """Adds the heads' loss to a next-token recipe's (``loss_fn``, ``loss_head``, ``model`` and ``log`` are the
    recipe's); ``adds_mtp_loss`` False: a subclass whose loss does not, so the keys are refused."""

    adds_mtp_loss = True
    mtp_heads: MTPHeads | None = None

    @classmethod
    def mtp_config_issues(cls, cfg: Any) -> list[ConfigIssue]:
        """Why the heads the model section asks for cannot train in this run (empty: they can, or none is asked)."""
        return mtp_issues(cfg, model_hf_config(cfg), supported=cls.adds_mtp_loss) if mtp_asked(cfg) else []

    def find_mtp_heads(self) -> None:
        """Keep the built model's heads (if any) and say in the run's log what they train."""
        self.mtp_heads = find_heads(unwrap(self.model))
        if self.mtp_heads is not None:
            mtp = self.mtp_heads.settings
            self.log(f"MTP: {mtp.depths} heads ({mtp.physical_depths} with weights of their own, "
                     f"{self.mtp_heads.origin}); the training loss is the next-token loss + {mtp.scaling_factor:g} x "
                     f"the mean over the {mtp.depths} depths of each one's loss, all per label token (upstream's); "
                     "validation reports the next-token loss only")

    def with_mtp_loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor], loss: torch.Tensor
                      ) -> torch.Tensor:
        """``loss`` plus, while training, the heads' summed loss of the forward that just ran
        (:meth:`automodel.mtp.heads.MTPHeads.loss`)."""
        if self.mtp_heads is None or not model.training:
            return loss
        head = unwrap(model).get_output_embeddings()
        return loss + self.mtp_heads.loss(batch["labels"], head, self.loss_fn, self.loss_head,
                                          batch.get("position_ids"))
