"""Image-text conversation data and its collation."""

from automodel_vlm.datasets.collate import VLMCollator
from automodel_vlm.datasets.conversation import ImageTextChatDataset
from automodel_vlm.datasets.mock import MockVLMDataset
from automodel_vlm.datasets.question_answer import (
    make_cord_v2_dataset,
    make_medpix_dataset,
    make_rdr_dataset,
    make_shopify_product_catalogue_dataset,
)
from automodel_vlm.datasets.text_chat import make_tulu3_dataset, make_tulu3_magicoder_text_mix_dataset

__all__ = ["ImageTextChatDataset", "MockVLMDataset", "VLMCollator", "make_cord_v2_dataset", "make_medpix_dataset",
           "make_rdr_dataset", "make_shopify_product_catalogue_dataset", "make_tulu3_dataset",
           "make_tulu3_magicoder_text_mix_dataset"]
