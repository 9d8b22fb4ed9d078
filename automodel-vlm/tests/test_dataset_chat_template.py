"""Upstream's ``dataset.chat_template`` (a base model that ships no chat template): the template, inline or in a
file, becomes the processor's and its tokenizer's before the data sets are built, and the rows are rendered with
it; a value that is no template, or data sets that disagree, are refused at validation."""

from __future__ import annotations

import pytest
from vlm_testing import tiny_processor, train_inprocess

from automodel.errors import ConfigError

MARK = "Rendered by the data set's template. "


@pytest.fixture
def template_file(tmp_path):
    path = tmp_path / "chat_template.jinja"
    path.write_text(MARK + tiny_processor().chat_template)
    return path


def test_the_data_sets_template_is_the_processors_and_renders_the_rows(make_config, template_file):
    recipe = train_inprocess(make_config(dataset={"chat_template": str(template_file)}), setup_only=True)
    assert recipe.processor.chat_template == template_file.read_text()
    assert recipe.processor.tokenizer.chat_template == template_file.read_text()
    batch = next(iter(recipe.dataloader))
    assert MARK.strip() in recipe.processor.tokenizer.decode(batch["input_ids"][0])


def test_the_run_trains_with_it(make_config, template_file):
    recipe = train_inprocess(make_config(dataset={"chat_template": str(template_file)},
                                         step_scheduler={"max_steps": 2}))
    assert recipe.step_scheduler.step == 2


@pytest.mark.parametrize("sections,key,needle", [
    ({"dataset": {"chat_template": "missing.jinja"}}, "dataset.chat_template", "neither a Jinja template"),
    ({"dataset": {"chat_template": "{{ 'a' }}"}, "validation_dataset": {"chat_template": "{{ 'b' }}"}},
     "dataset.chat_template, validation_dataset.chat_template", "the data sets give different chat templates"),
])
def test_what_is_no_template_or_disagrees_is_refused(make_config, sections, key, needle):
    with pytest.raises(ConfigError) as info:
        train_inprocess(make_config(**sections), setup_only=True)
    found = {issue.key: issue.message for issue in info.value.issues}
    assert needle in found.get(key, ""), found
