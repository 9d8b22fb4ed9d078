"""Unit semantics of the LLM recipe: its collate function and token counts."""

from __future__ import annotations


def test_pad_collate_and_label_counts():
    from automodel_llm.datasets.collate import pad_collate
    from automodel_llm.recipe import FinetuneRecipeForNextTokenPrediction

    batch = pad_collate([{"input_ids": [1, 5, 6, 7], "labels": [-100, -100, 6, 7]},
                         {"input_ids": [1, 8], "labels": [-100, 8]}], pad_token_id=0)
    assert batch["input_ids"].tolist() == [[1, 5, 6, 7], [1, 8, 0, 0]]
    assert batch["labels"].tolist() == [[-100, -100, 6, 7], [-100, 8, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    recipe = FinetuneRecipeForNextTokenPrediction.__new__(FinetuneRecipeForNextTokenPrediction)
    assert recipe.count_label_tokens(batch) == 3  # shifted labels: positions 1.. that are not -100
    assert recipe.count_input_tokens(batch) == 6
