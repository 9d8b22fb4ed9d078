"""Third-party output a user cannot act on, kept out of a run's log; ``AUTOMODEL_DEBUG=1`` shows all of it.

Each entry is the logger that emits a line and a text the line contains: precise filters, so that everything else
those libraries log still comes through. Installing them imports nothing (a logger can be configured before its
library is imported), so the CLI does it first thing.
"""

from __future__ import annotations

import logging
import os
import warnings

# (logger, text of the line): why it is noise
LOG_NOISE = (
    # torchao's optional C extensions (_C_mxfp8, _C_cutlass_90a, ...) built for CUDA: absent or unloadable here,
    # and nothing automodel uses needs them
    ("torchao", "Failed to load "),
    # torchao's int-matmul kernels want triton (a GPU compiler); the CPU path needs none
    ("torchao.kernel.intmm", "Detected no triton"),
    # diffusers probing torchao's tensor subclasses for torch.load's safe globals; automodel never torch.loads
    ("diffusers.quantizers.torchao.torchao_quantizer", "Unable to import `torchao` Tensor objects"),
    # torch 2.13 deprecating register_constant() on Enums, which torchao calls on import
    ("torch.utils._pytree", "is an Enum subclass and is now natively supported"),
    # transformers' image processors falling back to their PIL backend without torchvision (same results)
    ("transformers.utils.import_utils", "requires torchvision (not installed); falling back to"),
)
# warning messages (regular expressions matched at the start)
WARNING_NOISE = (
    "'set_vital' is deprecated",  # torchdata calls a deprecated torch API on every dataloader iterator
    "`is_gradient_checkpointing` is deprecated",  # peft reads the old name when it wraps a model
)


def debug_enabled() -> bool:
    """``AUTOMODEL_DEBUG=1``: tracebacks, internal tuning lines and the third-party output filtered here."""
    return os.environ.get("AUTOMODEL_DEBUG") == "1"


class _DropLines(logging.Filter):
    def __init__(self, texts: list[str]):
        super().__init__()
        self.texts = texts

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(text in message for text in self.texts)


def filter_third_party_noise() -> None:
    """Install the filters (once; not at all under ``AUTOMODEL_DEBUG=1``)."""
    if debug_enabled():
        return
    by_logger: dict[str, list[str]] = {}
    for name, text in LOG_NOISE:
        by_logger.setdefault(name, []).append(text)
    for name, texts in by_logger.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropLines) for f in logger.filters):
            logger.addFilter(_DropLines(texts))
    for message in WARNING_NOISE:
        warnings.filterwarnings("ignore", message=message)
