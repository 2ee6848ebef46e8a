"""Train and evaluate ILCP at several payload sizes; one plot of accuracy against wire bytes.

    python -m ilcp_experiments sweep --sweep configs/sweep/tiny.yaml --out /tmp/sw --checkpoints /tmp/sw-runs
    python -m ilcp_experiments sweep --sweep configs/sweep/facts.yaml             # results/sweep-facts
    python -m ilcp_experiments sweep --sweep configs/sweep/babi1.yaml             # results/sweep-babi1
    python -m ilcp_experiments sweep --sweep configs/sweep/facts.yaml --resume    # after an interruption
    python -m ilcp_experiments sweep --sweep configs/sweep/facts.yaml --limit 50  # quicker, wider intervals

`python -m ilcp_experiments sweep` is its command line (`run.main`); `load_sweep` (`schema`) reads a
sweep file and `run_sweep` (`run`) runs it, for use from Python; `render` writes sweep.md and the plot.

Expected time on this project's 2-core CPU (SmolLM2-135M). These are estimates from the README's
figures (about 1.3 s per stage-2 step of batch 8; the facts run's 15 min 54 s for three variants;
200 ilcp questions decoded in about 36 s), not measurements of these sweeps:
- configs/sweep/tiny.yaml: about 10 s (tiny random LM; the test runs it);
- configs/sweep/facts.yaml: about 1 h 15 min: five ilcp trainings of 120 steps (about 5 min each,
  11 min with the 200-step reconstruction stage), the reference run (prompt_tuned and
  cold_read_tuned, about 10 min), the token states once (1.5 min), then about 2 min of evaluation
  per point and 10 min for the reference rows;
- configs/sweep/babi1.yaml: about 50 minutes (four ilcp trainings of about 6.5 min, the reference
  run about 12 min, evaluation about 11 min).
A second invocation reuses every finished run (only the evaluations run again: about a third of
the time); with --resume it also keeps the evaluations already written and only redraws the plot.

What it does:
1. reads the sweep file (format below) and resolves every run's training config: the base config,
   then the sweep's overrides, then the point's, then --set; ``run_name`` and ``out_dir`` (the
   --checkpoints folder) are set by the sweep. Points train ``handoff.variants=[ilcp]`` only; one
   reference run trains the tuned baselines the reference methods need (prompt_tuned,
   cold_read_tuned) once. Every config is validated before anything trains.
2. trains each run with `ilcp.training.train`, unless its folder already holds a finished run
   whose train_config.yaml resolves to the same config (then it is reused). A folder holding a
   different run is refused unless --overwrite; an unfinished run of the same config is continued
   with --resume, or started again with --overwrite.
3. evaluates each point with `ilcp.evaluation.run.evaluate` (method ilcp, at the point's wire
   dtype) and the reference run with the reference methods, on the training task's test split and
   the listed tasks, plus, for a facts-trained run, evaluate()'s accuracy against the number of
   facts (``facts_counts``). Each evaluation writes its usual report under OUT/evals/NAME/.
4. writes OUT/accuracy_vs_wire_bytes.png (exact match with 95% intervals against wire bytes per
   request, log x, one panel per task and per number of facts), OUT/sweep.json and OUT/sweep.md.

Accuracy against the number of facts comes from evaluate()'s facts-count sweep of each run
trained on the sweep's facts setting (4 facts), not from separate runs trained per number of
facts: one training per point instead of one per point and count. The 1- and 8-fact panels are
therefore runs trained on 4-fact contexts read at other lengths, for ilcp and the tuned
baselines alike; that sweep carries ilcp, prompt_tuned and cold_read_tuned only. Its rows report
no bytes, so the sweep computes them on the same questions: the packed payload of each context for
ilcp (`ILCPHandoff.send_each` at the point's dtype), the context's utf-8 bytes for the text
handoff, 0 for prompt_tuned.

The sweep file (YAML; relative paths are read from the current directory, then from the sweep
file's folder and each folder above it):

    name: facts                       # default folders: results/sweep-NAME, checkpoints/sweep-NAME
    description: ...                  # optional text, copied into sweep.md
    base: configs/facts.yaml          # the training config every run starts from
    overrides: [data.facts_value_split=train]   # every run; "key=value" strings, a mapping
                                      # {key: value} or one space-separated string
    checkpoints: checkpoints/sweep-facts        # optional; --checkpoints wins
    out: results/sweep-facts                    # optional; --out wins
    eval:
      tasks: [facts-heldout]          # besides the run's training task, which is always evaluated
      limit: 200                      # questions per task (0 or null: the whole test split)
      facts_counts: [1, 8]            # facts-trained runs: accuracy at these numbers of facts
      facts_count_limit: 100          # questions per number of facts
      latency_n: 0                    # requests timed per method and task (0: none)
      batch_size: 8
      max_new_tokens: 8
      seed: 0                         # eval seed (facts contexts of the length sweep)
    reference:                        # optional: rows other than ilcp, each at its own wire bytes
      methods: [cold_read, cold_read_tuned, prompt_tuned, rclc:cacheback:r4]
      run: reference                  # its run name (default "reference")
      overrides: []                   # training overrides of the reference run only
    selection:                        # optional: RCLC (or KV relay) rows through their budgets, read on
      methods: [rclc-budgets, rclc-budgets-tuned]   # the reference run and drawn as one curve per
      tasks: [babi:2]                 # selector; tasks: a subset of eval.tasks (default: all of them;
      limit: 100                      # the training task is always read); limit: default eval.limit
    points:
      - name: single-32               # run name too, unless run: is given
        description: ...              # optional
        overrides: [compressor.latent_dim=32]
      - name: chunk12-64-int8
        run: chunk12-64               # evaluate the run of another point (same overrides)
        overrides: [compressor.latent_dim=64, compressor.memory.chunk_tokens=12]
        payload_dtype: int8           # float32 (default), float16, bfloat16 or int8

The reference run trains the variants its methods need (prompt_tuned for prompt_tuned,
cold_read_tuned for cold_read_tuned and rclc:...:tuned); when none needs trained weights, the
reference methods are evaluated on the first point's run instead. The selection rows are read
on the same run (which then also trains what they need: cold_read_tuned for ``:tuned``); the
sweep.md gets one table per task of exact match by selector and budget with r4/r1 and r16/r1, and
the plot one line per selector and option.

--limit N sets eval.limit, eval.facts_count_limit and selection.limit to N. --set key=value (repeatable)
adds a training override to every run (for example lm.cache_dir=... or trainer.accelerator=gpu);
it is part of the resolved config, so it decides reuse too.
"""

from .run import main, run_sweep
from .schema import Sweep, SweepError, load_sweep

__all__ = ["Sweep", "SweepError", "load_sweep", "main", "run_sweep"]
