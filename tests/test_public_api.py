"""`import ilcp` names what agent code needs (`from ilcp import ILCPHandoff, load_lm, rclc`),
loads each on first use, and stays light: importing it loads neither torch, Lightning nor vLLM,
and the handoff's names load no Lightning or vLLM either."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import ilcp

REPO = Path(__file__).resolve().parent.parent
PUBLIC = ["ILCPHandoff", "LM", "PayloadError", "ReceivedMemory", "__version__", "load_lm", "rclc", "receiver_framing"]


def loaded_after(code: str) -> dict:
    """Which heavy packages a fresh interpreter holds after running ``code``."""
    probe = (f"import sys\n{code}\nimport json\n"
             "print(json.dumps({name: name in sys.modules for name in "
             "('torch', 'transformers', 'lightning', 'pytorch_lightning', 'vllm')}))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_public_names_are_pinned():
    assert ilcp.__all__ == PUBLIC
    assert sorted(set(dir(ilcp)) & set(PUBLIC)) == PUBLIC


def test_each_public_name_is_the_object_of_its_module():
    from ilcp import ILCPHandoff, LM, PayloadError, ReceivedMemory, load_lm, rclc
    from ilcp.handoff import ILCPHandoff as handoff_class
    from ilcp.lm import LM as lm_class, load_lm as loader
    from ilcp.receiver.memory import ReceivedMemory as memory_class
    from ilcp.wire.payload import PayloadError as payload_error

    assert (ILCPHandoff, LM, PayloadError, ReceivedMemory, load_lm) == (handoff_class, lm_class, payload_error,
                                                                         memory_class, loader)
    assert rclc.__name__ == "ilcp.rclc" and callable(rclc.bind)
    assert ILCPHandoff.open.__name__ == "open_memory"


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="module 'ilcp' has no attribute 'Handoff'"):
        ilcp.Handoff  # noqa: B018
    with pytest.raises(ImportError):
        exec("from ilcp import Handoff")


def test_import_ilcp_loads_no_torch_lightning_or_vllm():
    assert not any(loaded_after("import ilcp; ilcp.__version__").values())


def test_the_agent_names_load_no_lightning_or_vllm():
    loaded = loaded_after("from ilcp import ILCPHandoff, ReceivedMemory, load_lm, rclc")
    assert loaded["torch"]  # the names did load
    assert not loaded["lightning"] and not loaded["pytorch_lightning"] and not loaded["vllm"], loaded
