"""The ``_target_`` names the core registers: its own config-facing modules, and the library callables its sections
build.

Dotted strings only (nothing is imported to register them). A class registered here also admits its public
``from_*`` classmethods (``transformers.AutoTokenizer`` admits ``transformers.AutoTokenizer.from_pretrained``).
The core registers the parts of its package that configs build, never the whole ``automodel`` package: the CLI
and the test helpers in it write files and start processes.
"""

from __future__ import annotations

from automodel.config.registry import HF_CONFIG_RULE

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
    "automodel.optim",  # lr_scheduler: the warmup schedules and build_scheduler (the default); optimizer: Muon
    "automodel.training.loss",  # loss_fn: MaskedCrossEntropy (the default)
    "automodel.training.linear_ce.LinearCrossEntropy",  # loss_fn: the loss inside the output head
    "automodel.training.distillation.loss.KDLoss",  # kd_loss_fn (the default) of the distillation recipes
    "automodel.training.rng",  # StatefulRNG (upstream configs name it)
    "automodel.hf.PeftConfig",  # peft (the default)
    "automodel.model_backend.BackendConfig",  # model.backend (upstream's kernel selection)
    "automodel.testing.toy",  # the toy recipe, model and data set (engine tests, plugin authors' tests)
    *(f"torch.optim.{name}" for name in _OPTIMIZERS),  # optimizer (the builder adds params)
    *(f"torch.optim.lr_scheduler.{name}" for name in _SCHEDULERS),  # lr_scheduler (the builder adds optimizer)
    *(f"torch.nn.{name}" for name in _LOSSES),  # loss_fn
    "torchdata.stateful_dataloader.StatefulDataLoader",  # dataloader (the default)
    "torch.utils.data.DataLoader",  # dataloader (upstream configs name it)
    "torch.utils.data.default_collate",  # dataloader.collate_fn
    "transformers.AutoTokenizer",  # tokenizer (from_pretrained is the default)
    HF_CONFIG_RULE,  # model.config: transformers' configuration classes, constructors and from_pretrained
)
