"""Two agents in two processes hand a context over with ILCP: a sealed wire crosses a pipe, and the
receiving agent opens it once and asks it several questions.

    python examples/ilcp_two_agents.py                        # the shipped encoder of the embedded SmolLM2
    python examples/ilcp_two_agents.py checkpoints/default    # a run of your own (python train.py)

Nothing is trained and nothing is left behind. The parent makes a shared key (out of band, as a
deployment would hand it to both agents) and starts the two agents; each loads the export and its
own copy of the LM the export names:

1. Agent A reads the notes and sends them: one sender forward, a few latents, sealed under the key
   (HMAC-SHA256, a fresh nonce, the time); the wire's bytes cross an OS pipe to agent B.
2. Agent B opens the wire once (`ILCPHandoff.open`: the seal checked and its nonce spent, the
   latents checked and projected to memory vectors), then asks the received memory one question,
   then a batch; every question after the first prefills only its own positions. It also says
   back what the memory holds (`reconstruct`).
3. The same bytes arriving again are refused as a replay: a wire is opened once, and its memory is
   what B keeps asking.

The shipped encoder (pretrained/smollm2-memory) was pretrained to say back and continue text,
never on a question: its answers show the flow, not ILCP's accuracy (see the README's results).
"""

from __future__ import annotations

import argparse
import multiprocessing
import secrets
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHIPPED = REPO / "pretrained" / "smollm2-memory"
NOTES = ("Mary moved to the bathroom. John went to the hallway. Daniel travelled to the office. "
         "Mary picked up the milk. John went back to the kitchen.")
FIRST = "Where is Mary?"
MORE = ["Where is John?", "Who has the milk?", "Where is Daniel?"]


def agent_a(checkpoint: str, key: bytes, wire_out) -> None:
    """The sender: loads the export and its LM, sends the notes, puts the sealed bytes on the pipe."""
    from ilcp import ILCPHandoff

    start = time.perf_counter()
    sender = ILCPHandoff.from_pretrained(checkpoint, auth_key=key)
    payload = sender.send(NOTES)
    wire = sender.to_wire(payload)
    print(f"A: sent {len(NOTES)} characters as {tuple(payload.latent.shape)} latents: {len(wire)} sealed bytes "
          f"({time.perf_counter() - start:.1f} s with loading)", flush=True)
    wire_out.send_bytes(wire)
    wire_out.close()


def agent_b(checkpoint: str, key: bytes, wire_in, report_out, max_new_tokens: int) -> None:
    """The receiver: opens the wire once, asks it several questions, refuses the same bytes again."""
    from ilcp import ILCPHandoff, PayloadError

    receiver = ILCPHandoff.from_pretrained(checkpoint, auth_key=key)  # loaded while A works
    wire = wire_in.recv_bytes()
    start = time.perf_counter()
    memory = receiver.open(wire)
    print(f"B: opened {len(wire)} bytes once into {memory.positions} memory vectors "
          f"({(time.perf_counter() - start) * 1000:.0f} ms)", flush=True)
    answers = {FIRST: memory.ask(FIRST, max_new_tokens=max_new_tokens)}
    answers.update(zip(MORE, memory.ask(MORE, max_new_tokens=max_new_tokens)))
    for question, answer in answers.items():
        print(f"B: {question} -> {answer!r}", flush=True)
    said_back = memory.reconstruct(max_new_tokens=2 * max_new_tokens)
    print(f"B: the memory says the notes were: {said_back!r}", flush=True)
    try:
        receiver.open(wire)
        replay = "accepted"
    except PayloadError as e:
        replay = f"refused ({e})"
    print(f"B: the same bytes again: {replay}", flush=True)
    report_out.send({"answers": answers, "reconstruction": said_back, "replay": replay,
                     "wire_bytes": len(wire), "positions": memory.positions})
    report_out.close()


def run(checkpoint: str, max_new_tokens: int = 8, timeout: float = 600.0) -> dict:
    """Start both agents, pass A's sealed wire to B, and return B's report."""
    context = multiprocessing.get_context("spawn")  # each agent a fresh interpreter with its own LM
    key = secrets.token_bytes(32)
    wire_in, wire_out = context.Pipe(duplex=False)
    report_in, report_out = context.Pipe(duplex=False)
    agents = [context.Process(target=agent_a, args=(checkpoint, key, wire_out), name="agent-A"),
              context.Process(target=agent_b, args=(checkpoint, key, wire_in, report_out, max_new_tokens),
                              name="agent-B")]
    for agent in agents:
        agent.start()
    wire_out.close()  # the parent keeps no end of the wire: only A writes and B reads it
    report_out.close()
    try:
        if not report_in.poll(timeout):
            raise RuntimeError(f"agent B sent no report within {timeout:.0f} s")
        report = report_in.recv()
    except EOFError:
        raise RuntimeError("agent B stopped before it reported: see its error above") from None
    finally:
        for agent in agents:
            agent.join(timeout=60)
            if agent.is_alive():
                agent.terminate()
    failed = [f"{a.name} exited with {a.exitcode}" for a in agents if a.exitcode != 0]
    if failed:
        raise RuntimeError("; ".join(failed))
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", nargs="?", default=str(SHIPPED),
                   help="an ILCP export (default: the shipped encoder of the embedded SmolLM2)")
    p.add_argument("--max-new-tokens", type=int, default=8, help="tokens per answer")
    args = p.parse_args(argv)
    if not (Path(args.checkpoint) / "config.json").is_file():
        p.error(f"{args.checkpoint!r} holds no config.json: pass an ILCP export (a run of python train.py)")
    start = time.perf_counter()
    try:
        report = run(args.checkpoint, max_new_tokens=args.max_new_tokens)
    except RuntimeError as e:
        print(f"ilcp_two_agents.py: error: {e}", file=sys.stderr)
        return 1
    print(f"done in {time.perf_counter() - start:.1f} s: {len(report['answers'])} questions after one open of "
          f"{report['wire_bytes']} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
