"""Two bound agents hand each other their state with RCLC, on the embedded SmolLM2-135M-Instruct.

    python examples/rclc_two_agents.py [selection.html]      # about a minute on a CPU

It leaves nothing behind but the selection view, and that only at the path given.

Agent X has read some notes; agent Y has only its instructions. Both run their own native
``model.generate`` loop:

1. X sends a selection of its state to Y with a question, recording the selection: the HTML view
   (kept spans in green) is written to the path given, if any, before Y pops the delivery. Y
   answers and records the continuation.
2. Y sends its continuation (the received rows plus its answer) back to X with a follow-up; X
   answers.
3. A tool result is appended to Y, which continues locally.
4. Y's state is saved to a snapshot and restored into a freshly bound agent.

Received rows go where the context text of a plain text handoff would sit (in_prompt placement):
SmolLM2-135M does not read rows placed before a fresh chat prompt. Each answer is printed beside
the one the notes hold: this small zero-shot receiver is often wrong (README, "Results").
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from pathlib import Path

import torch

from ilcp import rclc
from ilcp.lm import load_lm

NOTES = (
    "Project notes. Cedar is a small boat owned by Alice. Birch is a satellite that was launched "
    "in 1994. Alice keeps Cedar in the harbour of Oslo. The Birch mission ended in 2003."
)
SLOT = "Context:\n{context}\nQuestion: {request}"
QUESTION = "Who owns Cedar?"
FOLLOW_UP = "When was Birch launched?"
EXPECTED = {QUESTION: "Alice", FOLLOW_UP: "1994", "Where is Cedar kept?": "Oslo"}
TOOL_RESULT = "\n<|im_start|>user\nTool result: harbour_lookup(Cedar) = Oslo. Where is Cedar kept?<|im_end|>\n<|im_start|>assistant\n"


def page(body: str) -> str:
    """A standalone HTML page around a selection view."""
    return (
        '<!doctype html>\n<html><head><meta charset="utf-8"><title>RCLC selection</title></head>'
        f"<body>{body}</body></html>\n"
    )


def answer_text(tokenizer, output) -> str:
    return tokenizer.decode(output.sequences[0], skip_special_tokens=True).strip()


def judged(question: str, answer: str) -> str:
    """``question -> 'answer'`` and whether it holds the answer the notes give."""
    expected = EXPECTED[question]
    verdict = "right" if expected.lower() in answer.lower() else f"wrong, the notes say {expected}"
    return f"{question} -> {answer!r} ({verdict})"


async def exchange(model, tokenizer, html_path: Path | None, snapshot_path: Path, *, max_new_tokens: int = 24,
                   log=print) -> dict:
    """Run steps 1-4 on ``model``; returns the answers, state sizes and the HTML path (None when
    ``html_path`` is None: the view is built but not written)."""
    history_x = [
        {"role": "system", "content": "You are a helpful assistant. Answer briefly."},
        {"role": "user", "content": NOTES},
        {"role": "assistant", "content": "I have read the notes."},
    ]
    history_y = [{"role": "system", "content": "You are a helpful assistant. Answer briefly."}]
    settings = {"max_new_tokens": max_new_tokens, "placement": "in_prompt", "slot_template": SLOT}
    agent_x = rclc.bind(model, tokenizer, messages=history_x, **settings)
    agent_y = rclc.bind(model, tokenizer, messages=history_y, **settings)
    results = {}

    # 1. X -> Y with a question; the selection view is written before pop() consumes the delivery.
    await rclc.transfer(agent_x, agent_y, QUESTION, ratio=2, record_selection=True)
    report = agent_y.inspect(selection=True)
    results["kept"] = report["deliveries"][0]["selection"][0]["indices"]
    view = page(agent_y.selection_html(request_index=0))
    if html_path is not None:
        html_path.parent.mkdir(parents=True, exist_ok=True)
        html_path.write_text(view, encoding="utf-8")
    results["html"] = None if html_path is None else str(html_path)
    where = f"selection view: {html_path}" if html_path is not None else "pass a path to keep the selection view"
    log(f"Y received {report['deliveries'][0]['positions']} of X's {agent_x.sender_state().positions} "
        f"positions ({report['deliveries'][0]['tensor_bytes']} tensor bytes); {where}")
    inputs = agent_y.pop()
    output = model.generate(**inputs, do_sample=False, return_dict_in_generate=True)
    agent_y.update(inputs=inputs, generation=output)
    results["y_answer"] = answer_text(tokenizer, output)
    log(f"Y: {judged(QUESTION, results['y_answer'])}")

    # 2. Y -> X: the continuation goes back with a follow-up.
    await rclc.transfer(agent_y, agent_x, FOLLOW_UP, ratio=2)
    inputs = agent_x.pop()
    output = model.generate(**inputs, do_sample=False, return_dict_in_generate=True)
    agent_x.update(inputs=inputs, generation=output)
    results["x_answer"] = answer_text(tokenizer, output)
    log(f"X: {judged(FOLLOW_UP, results['x_answer'])}")

    # 3. A tool result appended to Y, then a local continuation.
    await agent_y.append(TOOL_RESULT)
    inputs = await agent_y.inputs()
    output = model.generate(**inputs, do_sample=False, return_dict_in_generate=True)
    agent_y.update(inputs=inputs, generation=output)
    results["y_after_tool"] = answer_text(tokenizer, output)
    log(f"Y after the tool result: {judged('Where is Cedar kept?', results['y_after_tool'])}")

    # 4. Snapshot and restore.
    await agent_y.save(snapshot_path)
    restored = rclc.bind(model, tokenizer, messages=history_y, **settings)
    await restored.load(snapshot_path)
    saved, loaded = agent_y.sender_state(), restored.sender_state()
    if not torch.equal(saved.input_embeds, loaded.input_embeds):
        raise RuntimeError("the restored state differs from the saved one")
    results["snapshot_positions"] = loaded.positions
    results["inherited_positions"] = loaded.inherited_positions
    log(f"snapshot: {loaded.positions} positions, {loaded.inherited_positions} inherited, restored exactly")

    return results


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    html_path = Path(argv[0]) if argv else None
    start = time.perf_counter()
    lm = load_lm()
    print(f"loaded {lm.spec} in {time.perf_counter() - start:.1f} s")
    with tempfile.TemporaryDirectory(prefix="rclc-two-agents-") as workdir:  # the snapshot, removed at the end
        asyncio.run(exchange(lm.model, lm.tokenizer, html_path, Path(workdir) / "agent_y.safetensors"))
    print(f"done in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
