"""Upstream's multi-token-prediction heads (``num_nextn_predict_layers``) for the transformers models that lack them:
:mod:`.heads` (the depth loop and the loss), :mod:`.attach` (onto a built model), one module per family."""
