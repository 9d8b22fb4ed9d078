"""The ``_target_`` names the core registers: its own package, and the library callables its sections build.

Dotted strings only (nothing is imported to register them). A class registered here also admits its public
``from_*`` classmethods (``transformers.AutoTokenizer`` admits ``transformers.AutoTokenizer.from_pretrained``).
"""

from __future__ import annotations

_OPTIMIZERS = ("ASGD", "Adadelta", "Adafactor", "Adagrad", "Adam", "AdamW", "Adamax", "LBFGS", "Muon", "NAdam",
               "RAdam", "RMSprop", "Rprop", "SGD", "SparseAdam")
_SCHEDULERS = ("LambdaLR", "MultiplicativeLR", "StepLR", "MultiStepLR", "ConstantLR", "LinearLR", "ExponentialLR",
               "SequentialLR", "CosineAnnealingLR", "ChainedScheduler", "ReduceLROnPlateau", "CyclicLR",
               "CosineAnnealingWarmRestarts", "OneCycleLR", "PolynomialLR")
_LOSSES = ("BCELoss", "BCEWithLogitsLoss", "CTCLoss", "CosineEmbeddingLoss", "CrossEntropyLoss", "GaussianNLLLoss",
           "HingeEmbeddingLoss", "HuberLoss", "KLDivLoss", "L1Loss", "MSELoss", "MarginRankingLoss",
           "MultiLabelMarginLoss", "MultiLabelSoftMarginLoss", "MultiMarginLoss", "NLLLoss", "PoissonNLLLoss",
           "SmoothL1Loss", "SoftMarginLoss", "TripletMarginLoss", "TripletMarginWithDistanceLoss")

CORE_TARGETS: tuple[str, ...] = (
    "automodel",  # the core's own package, by prefix
    *(f"torch.optim.{name}" for name in _OPTIMIZERS),  # optimizer (the builder adds params)
    *(f"torch.optim.lr_scheduler.{name}" for name in _SCHEDULERS),  # lr_scheduler (the builder adds optimizer)
    *(f"torch.nn.{name}" for name in _LOSSES),  # loss_fn
    "torchdata.stateful_dataloader.StatefulDataLoader",  # dataloader (the default)
    "torch.utils.data.DataLoader",  # dataloader (upstream configs name it)
    "torch.utils.data.default_collate",  # dataloader.collate_fn
    "transformers.AutoTokenizer",  # tokenizer (from_pretrained is the default)
)
