"""automodel-vlm: vision-language model recipes. Importing this package imports no torch."""

from automodel_vlm.models import AutoModelForImageTextToText

__all__ = ["AutoModelForImageTextToText"]
