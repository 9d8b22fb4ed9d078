"""The MTP heads' part of a next-token recipe (:mod:`automodel.mtp`): validation of the keys asking for them, the
run's note of what they are, and the recipe's loss: the next-token loss plus, while training, the heads'. The LLM
and VLM fine-tuning recipes mix it in before ``NextTokenLogits``."""

from __future__ import annotations

from typing import Any

import torch

from automodel.errors import ConfigIssue
from automodel.mtp.checks import mtp_asked, mtp_issues, mtp_off_notes, no_heads_note
from automodel.mtp.heads import MTPHeads, find_heads
from automodel.training.modules import unwrap
from automodel.training.parallel.pipeline_stages import last_stage, stages_of
from automodel.training.parallelism import model_hf_config


class MTPLoss:
    """A next-token recipe's loss with the heads' added (``loss_fn``, ``loss_head``, ``head_positions``,
    ``next_token_logits``, ``model`` and ``log`` are the recipe's); ``adds_mtp_loss`` False: a subclass whose own
    ``compute_loss`` does not add it, so the keys are refused."""

    adds_mtp_loss = True
    mtp_heads: MTPHeads | None = None

    @classmethod
    def mtp_config_issues(cls, cfg: Any) -> list[ConfigIssue]:
        """Why the heads the model section asks for cannot train in this run (empty: they can, or none is asked)."""
        return mtp_issues(cfg, model_hf_config(cfg), supported=cls.adds_mtp_loss) if mtp_asked(cfg) else []

    def setup(self) -> None:
        """The recipe's setup, then the built model's heads (if any) kept and said in the run's log."""
        for note in mtp_off_notes(self.cfg):
            self.log(note)
        super().setup()
        self.mtp_heads = find_heads(unwrap(self.model))
        if self.mtp_heads is None:
            built = getattr(getattr(unwrap(self.model), "config", None), "model_type", None)
            if note := no_heads_note(self.cfg, built or getattr(model_hf_config(self.cfg), "model_type", None)):
                self.log(note)
        carry = next((stage.carry for stage in stages_of(unwrap(self.model)) if getattr(stage, "carry", None)), None)
        if carry is not None:  # pipeline parallelism: the rank of the last stage holds the heads
            self.log(f"MTP under pipeline parallelism: the first stage sends each of the {carry.depths} depths' "
                     "embedding of the tokens ahead beside the hidden states; the last stage runs the heads")
        if self.mtp_heads is not None:
            mtp = self.mtp_heads.settings
            self.log(f"MTP: {mtp.depths} heads ({mtp.physical_depths} with weights of their own, "
                     f"{self.mtp_heads.origin}); the training loss is the next-token loss + {mtp.scaling_factor:g} x "
                     f"the mean over the {mtp.depths} depths of each one's loss, all per label token (upstream's); "
                     "validation reports the next-token loss only")

    def compute_loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The next-token loss plus, while training, the heads' summed loss of the forward that just ran
        (:meth:`automodel.mtp.heads.MTPHeads.loss`)."""
        loss = self.loss_fn(*self.next_token_logits(model, batch, self.head_positions))
        if self.mtp_heads is None or not model.training:
            return loss
        head = unwrap(model).get_output_embeddings()
        return loss + self.mtp_heads.loss(batch["labels"], head, self.loss_fn, self.loss_head,
                                          batch.get("position_ids"), self.label_offset)

    def pipeline_loss(self, output: torch.Tensor | tuple[torch.Tensor, ...], targets: torch.Tensor) -> torch.Tensor:
        """The next-token loss of the last stage's output plus, while training, the heads' of the depths' hidden
        states the stage returned after it, with the rows' positions (:mod:`automodel.mtp.pipeline`)."""
        if not isinstance(output, tuple):
            return super().pipeline_loss(output, targets)
        main, *depths, positions = output
        head = last_stage(unwrap(self.model)).output_head
        return super().pipeline_loss(main, targets) + self.mtp_heads.outputs_loss(
            depths, targets, head, self.loss_fn, self.loss_head, positions, self.label_offset)
