"""The code snippets of README.md and docs/serving.md, extracted and run, so they cannot drift from
the pages.

A snippet is the ```python block after ``<!-- snippet: NAME -->``; what it prints is the ```text
block after ``<!-- output: NAME -->``.

- ``ilcp`` (README.md) runs on the general handoff shipped in ``pretrained/`` with the embedded
  SmolLM2, no training, and must print the README's lines exactly. The receiver opens the wire
  once and asks the received memory each question.
- ``rclc`` (README.md) needs no trained run: it runs on the embedded SmolLM2 and must print the
  README's lines exactly.
- ``vllm`` (docs/serving.md) needs the vLLM environment: here it must compile and name what
  `ilcp.engines.vllm` exports (tests/vllm runs the same calls on an engine).
- ``served`` (docs/serving.md) needs a vLLM server: here it must compile and name what
  `ilcp.engines.served` exports (tests/vllm/test_served.py runs the same calls against a server).
"""

import ast
import contextlib
import io
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
SERVING = ROOT / "docs" / "serving.md"
SHIPPED = "pretrained/smollm2-general-chunk8-sender-latent"  # the general handoff the first snippet loads


def _block(kind: str, name: str, fence: str, page: Path = README) -> str:
    text = page.read_text(encoding="utf-8")
    match = re.search(rf"<!-- {kind}: {name} -->\n```{fence}\n(.*?)```", text, re.S)
    if match is None:
        raise AssertionError(f"{page.relative_to(ROOT)} has no {kind} block {name!r}")
    return match.group(1)


def _run(code: str, monkeypatch, tmp_path) -> str:
    monkeypatch.chdir(tmp_path)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md snippet", "exec"), {"__name__": "readme_snippet"})
    return out.getvalue()


@pytest.mark.slow
def test_the_ilcp_snippet_prints_what_the_readme_shows(smollm2, monkeypatch, tmp_path):
    code = _block("snippet", "ilcp", "python")
    assert f'"{SHIPPED}"' in code
    assert "from ilcp import ILCPHandoff" in code and ".open(wire)" in code and ".ask(" in code
    printed = _run(code.replace(f'"{SHIPPED}"', repr(str(ROOT / SHIPPED))), monkeypatch, tmp_path)
    assert printed == _block("output", "ilcp", "text")


@pytest.mark.slow
def test_the_rclc_snippet_prints_what_the_readme_shows(smollm2, monkeypatch, tmp_path):
    printed = _run(_block("snippet", "rclc", "python"), monkeypatch, tmp_path)
    assert printed == _block("output", "rclc", "text")


def test_the_vllm_snippet_compiles_and_names_what_the_engine_module_exports():
    import ilcp.engines.vllm as engine

    tree = ast.parse(_block("snippet", "vllm", "python", SERVING))
    imported = [(node.module, alias.name) for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                for alias in node.names]
    assert ("ilcp.engines.vllm", "VLLMReceiver") in imported
    for module, name in imported:
        assert hasattr(__import__(module, fromlist=[name]), name), f"{module}.{name}"
    assert engine.VLLMReceiver and engine.create_engine and engine.model_directory


def test_the_served_snippet_compiles_and_names_what_the_served_module_exports():
    tree = ast.parse(_block("snippet", "served", "python", SERVING))
    imported = [(node.module, alias.name) for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                for alias in node.names]
    assert ("ilcp.engines.served", "ServedReceiver") in imported
    for module, name in imported:
        assert hasattr(__import__(module, fromlist=[name]), name), f"{module}.{name}"
