"""EAGLE-1 / EAGLE-2 draft training (``automodel finetune eagle``)."""
