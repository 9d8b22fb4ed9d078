"""The distillation term of knowledge distillation: forward KL(teacher || student) over the label tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


class KDLoss(torch.nn.Module):
    """Forward KL(teacher || student) at ``temperature``, scaled by T², summed over label tokens.

    ``fp32_upcast`` (upstream's key): the logits are cast to float32 before the temperature divides them (true, the
    default), or divided in their own dtype, bf16 say (false); the softmax computes in float32 either way.
    ``chunk_size`` (upstream's key): above 0, the label tokens' float32 distributions are computed ``chunk_size``
    tokens at a time, so the forward holds one chunk's ``chunk_size x vocabulary`` of them at once instead of all
    of them (the same sum; 0, the default: all at once)."""

    def __init__(self, temperature: float = 1.0, ignore_index: int = IGNORE_INDEX, fp32_upcast: bool = True,
                 chunk_size: int = 0):
        super().__init__()
        if temperature <= 0:
            raise ValueError(f"kd_loss_fn.temperature must be > 0, found {temperature}")
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 0:
            raise ValueError(f"kd_loss_fn.chunk_size must be an integer >= 0 (0: no chunks), found {chunk_size!r}")
        self.temperature, self.ignore_index, self.fp32_upcast = temperature, ignore_index, fp32_upcast
        self.chunk_size = chunk_size

    def forward(self, student_logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor
                ) -> torch.Tensor:
        keep = labels.reshape(-1) != self.ignore_index
        student, teacher = self._kept(student_logits, keep), self._kept(teacher_logits, keep)
        size = self.chunk_size if 0 < self.chunk_size < len(student) else max(len(student), 1)
        total = sum(self._divergence(student[start:start + size], teacher[start:start + size])
                    for start in range(0, max(len(student), 1), size))
        return total * (self.temperature ** 2)

    def _kept(self, logits: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return logits.reshape(-1, logits.shape[-1])[keep]

    def _divergence(self, student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
        student = F.log_softmax(self._scaled(student), dim=-1, dtype=torch.float32)
        teacher = F.log_softmax(self._scaled(teacher), dim=-1, dtype=torch.float32)
        return F.kl_div(student, teacher, log_target=True, reduction="sum")

    def _scaled(self, logits: torch.Tensor) -> torch.Tensor:
        return (logits.float() if self.fp32_upcast else logits) / self.temperature
