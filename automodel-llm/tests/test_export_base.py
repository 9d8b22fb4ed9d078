"""`automodel export` merges a LoRA adapter into the base recorded with the run, not the base today's environment
would name: config.yaml keeps `${BASE}`, the adapter's adapter_config.json records what it resolved to."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from llm_testing import save_pretrained_base

from automodel.testing import run_cli, train_inprocess


def test_export_merges_into_the_recorded_base_whatever_base_says_now(make_config, tiny_llama_config, tmp_path,
                                                                     monkeypatch):
    from transformers import AutoModelForCausalLM

    trained_on = save_pretrained_base(tmp_path / "base_a", tiny_llama_config, seed=1)
    other = save_pretrained_base(tmp_path / "base_b", tiny_llama_config, seed=2)
    config = make_config(tokenizer=None, peft={"dim": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
                         model={"_target_": "automodel_llm.AutoModelForCausalLM.from_pretrained", "config": None,
                                "pretrained_model_name_or_path": "${BASE}"},
                         step_scheduler={"max_steps": 3})
    monkeypatch.setenv("BASE", str(trained_on))
    recipe = train_inprocess(config)
    adapter = tmp_path / "ckpt" / "epoch_0_step_3" / "model"
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == \
        str(trained_on.resolve())
    assert "${BASE}" in (tmp_path / "ckpt" / "epoch_0_step_3" / "config.yaml").read_text()
    inputs = torch.randint(4, 400, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = recipe.model.eval()(input_ids=inputs).logits

    for name, base in (("moved", other), ("unset", None)):
        if base is None:
            monkeypatch.delenv("BASE")
        else:
            monkeypatch.setenv("BASE", str(base))
        result = run_cli("export", tmp_path / "ckpt", tmp_path / name, cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-2000:]
        merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / name)).eval()
        with torch.no_grad():
            assert torch.allclose(merged(input_ids=inputs).logits, expected, atol=1e-4), name

    shutil.rmtree(trained_on)  # the recorded base is gone: refused by name, nothing written
    result = run_cli("export", tmp_path / "ckpt", tmp_path / "gone", cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"the base model recorded with the run, '{trained_on.resolve()}'" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "gone").exists()


@pytest.mark.parametrize("recorded", [None, ""])
def test_without_a_record_a_placeholder_base_is_refused(recorded, tmp_path):
    from automodel.errors import UsageError
    from automodel_llm.export import with_recorded_base

    (tmp_path / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": recorded}))
    data = {"model": {"pretrained_model_name_or_path": "${BASE}"}}
    with pytest.raises(UsageError, match="records no base model and the run's model.pretrained_model_name_or_path"):
        with_recorded_base(data, tmp_path)
    plain = {"model": {"config": "/models/tiny/config.json"}}
    assert with_recorded_base(plain, tmp_path) == plain
