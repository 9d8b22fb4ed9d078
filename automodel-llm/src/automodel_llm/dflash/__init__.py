"""DFlash draft training (``automodel finetune dflash``; upstream's ``TrainDFlashRecipe``)."""
