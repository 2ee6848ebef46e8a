"""vLLM tests: one in-process engine of each kind per model for the whole session.

In-process engines share vLLM's process-wide parallel state: shutting one down breaks the others,
so the engines live until the session's process ends.

These tests run in the environment that has vLLM (.venv-vllm, made by scripts/install.sh); the
main environment runs them as one test (test_vllm_environment.py) in a subprocess. vLLM's caches,
sockets and temporary files go into the session's temporary folder.

The tiny LM here is the tiny Qwen3 of `ilcp.lm.build_tiny_qwen3` with one change: attention heads
of width 32 (2 heads, 1 KV head) instead of 16, since vLLM's CPU attention has no kernel for
heads narrower than 32. Same tokenizer, hidden size 64, 2 layers.
"""

import importlib.util
import os
import tempfile
from pathlib import Path

import pytest

_SPEC = importlib.util.find_spec("vllm")
HAVE_VLLM = _SPEC is not None and _SPEC.origin is not None  # not this folder seen as a namespace package
ENGINE_TESTS = ["test_parity.py", "test_engine_errors.py", "test_eval_vllm.py", "test_rclc_vllm.py", "test_prefix_vllm.py",
                "test_prefix_cache_bench.py",
                "test_served.py"]

if HAVE_VLLM:
    collect_ignore = ["test_vllm_environment.py"]
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ["VLLM_NO_USAGE_STATS"] = "1"
    os.environ["DO_NOT_TRACK"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
else:
    collect_ignore = ENGINE_TESTS

TINY_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"
TINY_KV_BYTES = 64 << 20
SMOLLM2_KV_BYTES = 256 << 20


@pytest.fixture(scope="session")
def vllm_folder(tmp_path_factory):
    """The session's folder for vLLM: VLLM_CACHE_ROOT, VLLM_CONFIG_ROOT and TMPDIR point into it."""
    folder = tmp_path_factory.mktemp("vllm")
    saved_env = {k: os.environ.get(k) for k in ("VLLM_CACHE_ROOT", "VLLM_CONFIG_ROOT", "TMPDIR")}
    saved_tempdir = tempfile.tempdir
    (folder / "tmp").mkdir()
    os.environ["VLLM_CACHE_ROOT"] = str(folder / "cache")
    os.environ["VLLM_CONFIG_ROOT"] = str(folder / "config")
    os.environ["TMPDIR"] = str(folder / "tmp")
    tempfile.tempdir = str(folder / "tmp")
    yield folder
    tempfile.tempdir = saved_tempdir
    for key, value in saved_env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def build_tiny_lm(directory: Path, seed: int = 0):
    """The tiny Qwen3 with 32-wide heads, saved to `directory` and loaded back as an LM bundle."""
    from ilcp.lm import build_tiny_qwen3, load_lm

    model, tokenizer = build_tiny_qwen3(seed, num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return load_lm(str(directory))


@pytest.fixture(scope="session")
def tiny_lm_builder():
    """`build_tiny_lm(directory, seed=0)`."""
    return build_tiny_lm


@pytest.fixture(scope="session")
def tiny_lm_dir(vllm_folder):
    return vllm_folder / "tiny-lm"


@pytest.fixture(scope="session")
def tiny_vllm_lm(tiny_lm_dir):
    return build_tiny_lm(tiny_lm_dir)


@pytest.fixture(scope="session")
def tiny_vllm_run(vllm_folder, tiny_vllm_lm, tiny_lm_dir):
    """The tiny config trained once on the 32-wide-head tiny LM (attention pooling, last layer)."""
    from ilcp.config import load_config
    from ilcp.training import train

    out = vllm_folder / "tiny-run"
    cfg = load_config(TINY_CONFIG, [f"out_dir={out}", f"lm.cache_dir={out / 'cache'}", f"lm.spec={tiny_lm_dir}"])
    return train(cfg, lm=tiny_vllm_lm).run_dir


@pytest.fixture(scope="session")
def tiny_handoff(tiny_vllm_run, tiny_vllm_lm):
    from ilcp.handoff import ILCPHandoff

    return ILCPHandoff.from_pretrained(tiny_vllm_run, lm=tiny_vllm_lm)


@pytest.fixture(scope="session")
def tiny_engine(vllm_folder, tiny_lm_dir, tiny_vllm_lm):
    from ilcp.engines.vllm import create_engine

    llm = create_engine(tiny_lm_dir, kv_cache_memory_bytes=TINY_KV_BYTES, max_model_len=1024)
    return llm


@pytest.fixture(scope="session")
def tiny_pool_engine(vllm_folder, tiny_lm_dir, tiny_vllm_lm):
    from ilcp.engines.vllm import create_engine

    llm = create_engine(tiny_lm_dir, pooling=True, kv_cache_memory_bytes=TINY_KV_BYTES, max_model_len=1024)
    return llm


@pytest.fixture(scope="session")
def smollm2_lm():
    from ilcp.lm import DEFAULT_LM, load_lm

    return load_lm(DEFAULT_LM)


@pytest.fixture(scope="session")
def smollm2_handoff(vllm_folder, smollm2_lm):
    """An `ILCPHandoff` for SmolLM2 from a freshly initialised encoder (seeded), exported and read back."""
    import torch

    from ilcp.encoder.compressor import BetaVAE
    from ilcp.encoder.model import ILCPEncoder
    from ilcp.export import EXPORT_FORMAT, EXPORT_VERSION
    from ilcp.export_writing import save_encoder
    from ilcp.handoff import ILCPHandoff
    from ilcp.encoder.projector import GatedLatentToMemoryProjector

    hidden = smollm2_lm.hidden_size
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(0)
        encoder = ILCPEncoder(BetaVAE(hidden, 16, 64), GatedLatentToMemoryProjector(16, 4, hidden, 64))
    finally:
        torch.random.set_rng_state(state)
    config = {
        "format": EXPORT_FORMAT,
        "format_version": EXPORT_VERSION,
        "lm": {"spec": smollm2_lm.spec, "fingerprint": smollm2_lm.fingerprint, "dtype": "float32",
               "hidden_size": hidden},
        "num_memory_tokens": 4,
        "pooling": {"kind": "mean", "layers": [-1], "max_length": 512},
    }
    path = save_encoder(encoder, config, vllm_folder / "smollm2-export")
    return ILCPHandoff.from_pretrained(path, lm=smollm2_lm)


@pytest.fixture(scope="session")
def smollm2_engine(vllm_folder, smollm2_lm):
    from ilcp.engines.vllm import create_engine, model_directory

    llm = create_engine(model_directory(smollm2_lm), kv_cache_memory_bytes=SMOLLM2_KV_BYTES, max_model_len=2048)
    return llm


@pytest.fixture(scope="session")
def smollm2_pool_engine(vllm_folder, smollm2_lm):
    from ilcp.engines.vllm import create_engine, model_directory

    llm = create_engine(model_directory(smollm2_lm), pooling=True, kv_cache_memory_bytes=SMOLLM2_KV_BYTES,
                        max_model_len=2048)
    return llm


@pytest.fixture(scope="session")
def tiny_engine_without_prompt_embeds(vllm_folder, tiny_lm_dir, tiny_vllm_lm):
    from ilcp.engines.vllm import create_engine

    return create_engine(tiny_lm_dir, kv_cache_memory_bytes=TINY_KV_BYTES, max_model_len=256,
                         enable_prompt_embeds=False)
