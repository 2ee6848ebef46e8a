"""Run a command as a log sees it: every output line time-stamped, the process tree's memory sampled.

A long job whose output goes to a file (nohup, CI, a cluster scheduler) should never leave the log
silent for long, and a job that reads its sender states through a memory map should keep its own
(anonymous) memory flat. This runs a command with its stdout and stderr joined into one pipe (not
a terminal, so progress comes as plain lines), writes each line to ``--log`` with the seconds since
the start, samples ``RssAnon`` of the command and all its children every ``--interval`` seconds,
and prints the peak anonymous memory, the longest silence and the lines around it.

    python benchmarks/run_watch.py --log /tmp/story.log --json /tmp/story.json -- \
        python train.py --config configs/babilong-story.yaml

Its exit status is the command's. Linux only (/proc).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path


def tree_anonymous_bytes(root: int) -> int:
    """Resident anonymous memory (``RssAnon``) of process ``root`` and all its descendants, in bytes."""
    children: dict[int, list[int]] = {}
    anon: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:  # the process ended while we looked
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        pid, ppid = int(entry.name), int(fields.get("PPid", "0").strip())
        children.setdefault(ppid, []).append(pid)
        anon[pid] = int(fields.get("RssAnon", "0 kB").split()[0]) * 1024
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += anon.get(pid, 0)
        todo.extend(children.get(pid, []))
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--log", required=True, help="the time-stamped output goes here")
    parser.add_argument("--json", help="also write the figures (peak, silences, memory samples) here")
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between memory samples")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")

    start = time.monotonic()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    samples: list[tuple[float, int]] = []
    done = threading.Event()

    def sample():
        while not done.wait(args.interval):
            samples.append((round(time.monotonic() - start, 2), tree_anonymous_bytes(proc.pid)))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stamps: list[tuple[float, str]] = []
    with open(args.log, "w") as log:
        # Progress bars redraw with carriage returns; a log sees each redraw as a line of its own.
        buffer = b""
        while chunk := proc.stdout.read1(65536):
            buffer += chunk
            *lines, buffer = buffer.replace(b"\r", b"\n").split(b"\n")
            now = round(time.monotonic() - start, 2)
            for raw in lines:
                text = raw.decode(errors="replace").rstrip()
                if text:
                    stamps.append((now, text))
                    log.write(f"{now:9.2f}  {text}\n")
            log.flush()
        if buffer.strip():
            stamps.append((round(time.monotonic() - start, 2), buffer.decode(errors="replace").rstrip()))
            log.write(f"{stamps[-1][0]:9.2f}  {stamps[-1][1]}\n")
    code = proc.wait()
    done.set()
    sampler.join()
    end = round(time.monotonic() - start, 2)

    times = [0.0] + [t for t, _ in stamps] + [end]
    gaps = sorted(((times[i + 1] - times[i], i) for i in range(len(times) - 1)), reverse=True)
    longest, at = gaps[0] if gaps else (end, 0)
    peak_t, peak = max(samples, key=lambda s: s[1]) if samples else (0.0, 0)
    mb = 1024 ** 2
    print(f"exit status {code}; {end:.0f} s; {len(stamps)} lines")
    print(f"peak anonymous memory {peak / mb:,.0f} MB at {peak_t:.0f} s")
    before = stamps[at - 1] if at >= 1 else (0.0, "(start)")
    after = stamps[at] if at < len(stamps) else (end, "(end)")
    print(f"longest silence {longest:.1f} s, between\n  {before[0]:9.2f}  {before[1][:160]}\n  {after[0]:9.2f}  {after[1][:160]}")
    print("silences over 30 s: " + str(sum(1 for g, _ in gaps if g > 30)) + ", over 45 s: " + str(sum(1 for g, _ in gaps if g > 45)))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "command": command, "exit_status": code, "seconds": end, "lines": len(stamps),
            "peak_anonymous_bytes": peak, "peak_at_s": peak_t, "longest_silence_s": round(longest, 2),
            "silence_between": [before, after], "memory_samples": samples[:: max(1, len(samples) // 2000)],
        }, indent=1) + "\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
