"""benchmarks/vllm_dtype_speed.py: a folder that is not a run, a missing vLLM and bad counts are each a
one-line usage error before any engine or model is started. (Its measurements need
vLLM and run from .venv-vllm: docs/results/vllm-dtype.)"""

import importlib.util

import pytest
from _benchmarks import load_benchmark

speed = load_benchmark("vllm_dtype_speed")


_SPEC = importlib.util.find_spec("vllm")
HAVE_VLLM = _SPEC is not None and _SPEC.origin is not None  # not tests/vllm seen as a namespace package


@pytest.mark.skipif(HAVE_VLLM, reason="this environment has vLLM")
def test_without_vllm_it_says_how_to_install_it(tiny_run, capsys):
    with pytest.raises(SystemExit) as e:
        speed.main(["--ckpt", str(tiny_run.run_dir)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "vLLM is not installed" in err and "scripts/install.sh" in err


def test_counts_below_one_are_usage_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        speed.main(["--ckpt", str(tmp_path), "--requests", "0"])
    assert e.value.code == 2
    assert "must be >= 1" in capsys.readouterr().err


def test_a_folder_that_is_not_a_run_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        speed.main(["--ckpt", str(tmp_path / "no-run")])
    assert e.value.code == 2
    assert "is not a directory" in capsys.readouterr().err
