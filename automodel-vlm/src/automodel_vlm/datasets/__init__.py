"""Image-text conversation data and its collation."""

from automodel_vlm.datasets.collate import VLMCollator
from automodel_vlm.datasets.conversation import ImageTextChatDataset

__all__ = ["ImageTextChatDataset", "VLMCollator"]
