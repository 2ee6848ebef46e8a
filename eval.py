"""Compare the handoff methods of a trained run: accuracy, payload bytes and latency, with plots.

    python eval.py --ckpt checkpoints/default                          # about 8 min on 2 CPU cores
    python eval.py --ckpt checkpoints/default --tasks babi:2           # plus a held-out task, ~+6 min
    python eval.py --ckpt checkpoints/tiny --limit 8 --latency-n 2     # seconds, tiny test LM
    python eval.py --ckpt checkpoints/default --limit 0                # every test question
    python eval.py --ckpt checkpoints/default --methods default,rclc-quick   # + 3 RCLC rows, ~+7 min a task
    python eval.py --ckpt checkpoints/default --methods default,rclc   # + the 12 RCLC rows, ~+28 min a task
    python eval.py --ckpt checkpoints/default --methods cold_read,rclc:qsnap:b8,rclc:chunkkv:r8:tuned

The run's training task (test split; config.json's task and task_settings) is always
evaluated; --tasks adds others, reported separately and marked held out. By default 200
questions per task (95% intervals of about +-6 percentage points at 25% accuracy; --limit 0 for
the whole 1,000-question bAbI test file) and 20 timed requests per method: with SmolLM2 on 2 CPU
cores, about 6 minutes per task plus 1.5 for the context-length sweep, so the training task and
one held-out task fit in 15. Writes results.json, results.md, predictions.jsonl and PNG plots
into --out (default results/RUN) and prints the tables.

RCLC rows (`ilcp.evaluation.rclc_methods`) are named rclc:SELECTOR:rN (relative budget, ceil(T/N)
of the sender's T rows) or rclc:SELECTOR:bN (at most N rows), SELECTOR one of cacheback, qsnap,
chunkkv. The receiver is ilcp.rclc.HFReceiver, as a user would call it: with
placement="in_prompt" the rows sit where the context text would (r1 gives the cold read's
prefix), with :prefix (placement="prefix", the RCLC spec's placement) before the question
prompt, and with :tuned after cold_read_tuned's K vectors. Groups: default (no_context,
prompt_tuned, cold_read, cold_read_tuned, ilcp: what runs when --methods is not given),
rclc-quick (cacheback r1, r4 and r4:tuned), rclc (cacheback r1; cacheback, qsnap and chunkkv at
r4, r16 and b16; cacheback r4:prefix and r4:tuned). An RCLC row costs about 1.5 cold_read rows
(the sender's prefill and selection run per question):
about 2.3 minutes per task at the default limit with SmolLM2 on one CPU thread.
"""

import sys

from ilcp.cli import build_eval_parser as build_parser
from ilcp.cli import eval_main as main

__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main())
