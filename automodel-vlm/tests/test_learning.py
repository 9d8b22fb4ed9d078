"""The example's answers come from the image: after a short run the model names the shape's colour far more often
than any image-blind guess could (one colour in six)."""

from __future__ import annotations

from vlm_testing import train_inprocess, write_config

# The whole training set (320 rows) at the example's batch size 16: 150 steps, ~7.5 epochs.
RUN = {"step_scheduler": {"max_steps": 150, "val_check_interval": 150, "checkpoint_interval": 1000,
                          "log_interval": 50},
       "dataset": {"limit_dataset_samples": None}, "validation_dataset": {"limit_dataset_samples": None},
       "dataloader": {"batch_size": 16}, "lr_scheduler": {"warmup_steps": 10},
       "checkpoint": {"enabled": False}, "eval_generation": {"enabled": False}}


def test_colour_answers_are_read_off_the_image(tmp_path):
    recipe = train_inprocess(write_config(tmp_path / "cfg.yaml", tmp_path / "ckpt", **RUN))
    dataset = recipe._validation_set()
    _, results = recipe.exact_match(dataset, None, max_new_tokens=2)
    colour = [(expected, got) for prefix, expected, got in results if "colour" in str(prefix[-1]["content"])]
    assert len(colour) == 32
    accuracy = sum(expected == got for expected, got in colour) / len(colour)
    assert accuracy >= 0.5, f"colour accuracy {accuracy:.2f} (an image-blind guess gets ~0.17): {colour[:8]}"
    answers = {got for _, got in colour}
    assert len(answers) >= 4, f"the model says the same few colours whatever the image: {answers}"
