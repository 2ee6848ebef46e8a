"""Without vLLM the modules import, building an engine says how to install vLLM, every engine is
built by `ilcp.engines.build.create_engine`, and engines and servers check prefixes alike."""

import os
import subprocess
import sys
import types

import pytest
import torch

from ilcp.engines import vllm as engines
from ilcp.engines.build import check_prefix


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


@pytest.fixture
def fake_vllm(monkeypatch):
    """A stand-in ``vllm`` module whose ``LLM`` records the arguments it is built with."""
    built = []

    class LLM:
        def __init__(self, **kwargs):
            built.append(kwargs)

    module = types.ModuleType("vllm")
    module.LLM = LLM
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    return built


def test_every_engine_is_built_by_the_one_factory(fake_vllm):
    from ilcp.rclc import vllm_engine

    engines.create_engine("/models/a", max_model_len=512, seed=3)
    vllm_engine.start_engine("/models/b")
    assert fake_vllm[0] == {"model": "/models/a", "dtype": "float32", "enforce_eager": True,
                            "kv_cache_memory_bytes": 1 << 30, "max_model_len": 512, "enable_prompt_embeds": True,
                            "seed": 3}
    # rclc's engine: the model's own context, vLLM's dtype, a small KV cache, no prefix caching
    assert fake_vllm[1] == {"model": "/models/b", "dtype": "auto", "enforce_eager": True,
                            "kv_cache_memory_bytes": 64 << 20, "enable_prompt_embeds": True,
                            "enable_prefix_caching": False, "tensor_parallel_size": 1}


def test_importing_the_factory_imports_no_vllm():
    probe = "import sys, ilcp.engines.build, ilcp.engines.vllm, ilcp.rclc.vllm; print('vllm' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "False"


def test_one_prefix_check_for_engines_and_servers():
    ok = torch.zeros(3, 8)
    check_prefix(ok, 8, 5, 8)
    check_prefix(ok, 8, 500, None)  # a server that reports no max_model_len
    with pytest.raises(ValueError, match=r"prefix 2 must be a \(L, 8\) tensor with L >= 1, got \(3, 4\)"):
        check_prefix(torch.zeros(3, 4), 8, 5, 8, 2)
    with pytest.raises(ValueError, match=r"must be a \(L, 8\) tensor with L >= 1, got \(0, 8\)"):
        check_prefix(torch.zeros(0, 8), 8, 5, 8)
    with pytest.raises(ValueError, match="got list"):
        check_prefix([[0.0] * 8], 8, 5, 8)
    with pytest.raises(ValueError, match="has dtype torch.int64; expected embedding vectors"):
        check_prefix(torch.zeros(3, 8, dtype=torch.long), 8, 5, 8)
    with pytest.raises(ValueError, match="prefix 0 has 3 positions; with max_new_tokens=6 it passes the engine's "
                                         "max_model_len of 8"):
        check_prefix(ok, 8, 6, 8)
    with pytest.raises(ValueError, match="passes the server's max_model_len of 8"):
        check_prefix(ok, 8, 6, 8, holder="server")


@pytest.mark.parametrize(("precision", "dtype"), [("bf16-mixed", "bfloat16"), ("32-true", None)])
def test_eval_starts_its_engine_in_bfloat16_at_bf16_mixed(fake_vllm, monkeypatch, tmp_path, precision, dtype):
    from ilcp.eval_config import EvalConfig
    from ilcp.evaluation import session as eval_session

    asked = []

    def start_vllm(lm, folder, **kwargs):
        asked.append(kwargs["dtype"])
        return types.SimpleNamespace(dtype=getattr(torch, kwargs["dtype"] or "float32"), max_model_len=64)

    monkeypatch.setattr(eval_session, "start_vllm", start_vllm)
    config = EvalConfig(engine="vllm", out=str(tmp_path))
    _, info = eval_session.start_engine(config, object(), precision=precision)
    assert asked == [dtype]  # None: the LM's own dtype
    assert info["dtype"] == (dtype or "float32")
