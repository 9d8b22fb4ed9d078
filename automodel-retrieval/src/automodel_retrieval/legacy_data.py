"""Upstream's legacy data form: the data set inside its loader (``dataloader.dataset``, ``validation_dataloader.
dataset``), which upstream's recipes still read where the top-level ``dataset`` / ``validation_dataset`` is absent.

The retrieval recipes build such a node as the section it stands for (``data_sections``), with the same keys and so
the same data set, and build the loader from the rest of its section (``without_dataset``): the loader receives the
built data set, never the node. Giving the data set both ways is refused.
"""

from __future__ import annotations

from automodel.config import Config, ConfigNode
from automodel.errors import ConfigIssue

# the loader section -> the data set section its `dataset` key stands for
LEGACY = {"dataloader": "dataset", "validation_dataloader": "validation_dataset"}


def _nested(cfg: Config, loader_key: str) -> object:
    loader = cfg.get(loader_key)
    return loader.get("dataset") if isinstance(loader, ConfigNode) else None


def legacy_datasets(cfg: Config) -> dict[str, ConfigNode]:
    """The data set sections given inside a loader, by the section each stands for (a node keeps its own key,
    ``dataloader.dataset``, which errors name)."""
    found = {name: _nested(cfg, loader_key) for loader_key, name in LEGACY.items()}
    return {name: node for name, node in found.items() if isinstance(node, ConfigNode)}


def legacy_issues(cfg: Config) -> list[ConfigIssue]:
    """A nested data set without ``_target_``, one given both ways, and no training data set at all."""
    issues = []
    for loader_key, name in LEGACY.items():
        node, key = _nested(cfg, loader_key), f"{loader_key}.dataset"
        if node is None:
            continue
        if not isinstance(node, ConfigNode) or node.target is None:
            issues.append(ConfigIssue(key, f"expected a data set section with _target_ (upstream's legacy form: "
                                           f"{{_target_: make_retrieval_dataset, ...}}), found {node!r}; or give "
                                           f"it as {name}:"))
        if name in cfg:
            issues.append(ConfigIssue(key, f"the data set is given twice, here (upstream's legacy form) and as "
                                           f"{name}: (upstream would read {name} and ignore this one); give one of "
                                           "them"))
    if "dataset" not in cfg and _nested(cfg, "dataloader") is None:
        issues.append(ConfigIssue("dataset", "required section is missing: the training rows (dataset: {_target_: "
                                             "...RetrievalDatasetConfig | automodel_retrieval.RetrievalDataset, "
                                             "...}, or upstream's legacy dataloader.dataset)"))
    return issues


def without_dataset(node: ConfigNode | None) -> ConfigNode | None:
    """A loader section less its nested data set (built as a data set section; the loader receives it built)."""
    if node is None or "dataset" not in node:
        return node
    return ConfigNode({k: v for k, v in node.to_dict().items() if k != "dataset"}, node.key, node.resolver)
