"""Command lines: ``ilcp-train`` / ``python -m ilcp train`` and ``ilcp-eval`` / ``python -m ilcp
eval`` (``train.py`` and ``eval.py`` at the repository root call the same functions), and
``python -m ilcp serve RUN``.

Progress goes through `logging` (logger ``ilcp``, one ``[ilcp]`` line per event); Lightning's
start-up banners and tips are silenced here, in the command lines, never at import time.

Arguments and the config are checked before torch, Lightning, transformers or datasets are
imported (the functions import them after the checks), so ``--help`` and a mistyped key answer
at once.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import textwrap
import warnings
from pathlib import Path

import yaml

from .config import is_chunk_recipe, load_config, settings_help
from .eval_config import EvalConfig
from .names import (DEFAULT_FACTS_COUNTS, DEFAULT_LATENCY_N, DEFAULT_LENGTHS, DEFAULT_LIMIT, DEFAULT_METHODS,
                    DEFAULT_THROUGHPUT_N, ENGINES, EVAL_SPLITS, METHOD_FAMILIES, METHOD_GROUPS, METHODS, PAYLOAD_DTYPES, PRECISIONS,
                    SELECTORS, method_names, split_task_names, unknown_method)

TRAIN_HELP = """Train the ILCP compressor and projector (and the two tuned baselines) for one LM.

    ilcp-train                                        # embedded SmolLM2, bAbI task 1
    ilcp-train --config configs/tiny.yaml             # tiny random LM, seconds
    ilcp-train handoff.max_steps=50 run_name=short    # key=value overrides
    ilcp-train --resume                               # continue an interrupted run
    ilcp-train --config configs/pretrain-gpu.yaml     # the chunk memory's pretraining on text (flat keys)

Defaults, then the YAML file, then the overrides; the run is written to checkpoints/RUN_NAME."""
_EVAL_HELP = """Compare the handoff methods of a trained run: accuracy, payload bytes and latency, with plots.

    ilcp-eval --ckpt checkpoints/default                          # minutes on 2 CPU cores
    ilcp-eval --ckpt checkpoints/default --tasks babi:2           # plus a held-out task, ~+6 min
    ilcp-eval --ckpt checkpoints/tiny --limit 8 --latency-n 2     # seconds, tiny test LM
    ilcp-eval --ckpt checkpoints/default --limit 0                # every test question
    ilcp-eval --ckpt checkpoints/default --methods default,rclc-quick   # + 3 RCLC rows, ~+7 min a task
    ilcp-eval --ckpt checkpoints/default --methods default,rclc   # + the 12 RCLC rows, ~+28 min a task
    ilcp-eval --ckpt checkpoints/default --methods cold_read,rclc:qsnap:b8,rclc:chunkkv:r8:tuned
    ilcp-eval --ckpt checkpoints/default --only-tasks --tasks babilong:1:2k --methods rclc-budgets   # long contexts only
    .venv-vllm/bin/python eval.py --ckpt checkpoints/default --engine vllm --throughput-batches 1,8,32

The run's training task (config.json's task and task_settings) is always evaluated, on its test
split (--split validation: the rows each task held out of training, to choose between runs);
--tasks adds others, reported separately and marked held out. By default 200 questions per task
(95% intervals of about +-6 percentage points at 25% accuracy; --limit 0 for the whole
1,000-question bAbI test file) and 20 timed requests per method: with SmolLM2 on 2 CPU
cores with bfloat16 (AVX512-BF16), about 1.5 minutes per bAbI task plus half a minute for the
context-length sweep (docs/results/main-held: 113 s in all). Writes results.json, results.md,
predictions.jsonl and PNG plots into --out (default results/RUN) and prints the tables.

Methods: {methods}.

RCLC rows (`ilcp.evaluation.rclc_methods`) are named rclc:SELECTOR:rN (relative budget, ceil(T/N)
of the sender's T rows) or rclc:SELECTOR:bN (at most N rows), SELECTOR one of {selectors}. The
receiver is ilcp.rclc.HFReceiver, as a user would call it: with placement="in_prompt" the rows
sit where the context text would (r1 gives the cold read's prefix), with :prefix
(placement="prefix", the RCLC spec's placement) before the question prompt, and with :tuned
after cold_read_tuned's K vectors. Groups: {groups}.
An RCLC row costs about 1.5 cold_read rows
(the sender's prefill and selection run per question):
about 2.3 minutes per task at the default limit with SmolLM2 on one CPU thread.

--engine vllm (run with .venv-vllm/bin/python, the environment scripts/install.sh builds with
vLLM) decodes every method's receiver prefixes through one in-process vLLM engine as well as the
HF decoder (prompt embeddings, greedy, the same stop rule and token budget) and reports both
engines' exact match on the same questions and their agreement; its caches and temporary files
go to OUT/vllm. Latency and the sweeps stay on the HF decoder. --throughput-batches 1,8,32 adds
the receiver's decode throughput (questions/s) of ilcp and cold_read at those batch sizes, HF
and (with --engine vllm) vLLM, on the first --throughput-n questions."""



def _entries(table: dict, suffix: str = "") -> list[str]:
    return [f"{name}{suffix} ({entry.help})" for name, entry in table.items()]


def eval_help() -> str:
    """``ilcp-eval``'s description, its lists of methods, families, groups and selectors read from
    the registries of `ilcp.names` when the parser is built (the paragraphs that hold them refilled)."""
    groups = _entries(METHOD_GROUPS)
    lists = {"methods": "; ".join(_entries(METHODS) + _entries(METHOD_FAMILIES, ":...")),
             "selectors": "; ".join(_entries(SELECTORS)),
             "groups": f"{'; '.join(groups[:-1])} and {groups[-1]}" if len(groups) > 1 else groups[0]}
    parts = _EVAL_HELP.split("\n\n")
    return "\n\n".join(textwrap.fill(" ".join(part.format(**lists).split()), width=96, break_on_hyphens=False)
                       if "{" in part else part for part in parts)


class _CurrentStderr(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a line is logged (tests and notebooks swap it)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


def setup_logging() -> None:
    """``[ilcp]`` lines on stderr for the package's logger; Lightning's banners and tips only
    when they are warnings."""
    logger = logging.getLogger("ilcp")
    if not logger.handlers:
        handler = _CurrentStderr()
        handler.setFormatter(logging.Formatter("[ilcp] %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero",
                 "lightning.pytorch.accelerators.cuda"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # Lightning's own use of a torch API it deprecated: nothing a user of this package can change.
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose refusal is its one ``PROG: error: ...`` line, without the usage
    block above it (``--help`` prints that)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def train_main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="ilcp-train", description=TRAIN_HELP, epilog=settings_help(),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML config (see configs/)")
    parser.add_argument("--resume", action="store_true", help="continue the run from its last checkpoints")
    parser.add_argument("--overwrite", action="store_true", help="delete an existing run of the same name first")
    parser.add_argument("--discard-last", action="store_true", help="with --resume: start the unfinished stages "
                        "again instead of from their last.ckpt (for a checkpoint a kill left unreadable)")
    parser.add_argument("overrides", nargs="*", help="section.key=value, e.g. handoff.max_steps=50")
    args = parser.parse_intermixed_args(argv)
    if args.discard_last and not args.resume:
        parser.error("--discard-last goes with --resume: it starts a resumed run's unfinished stages again")
    if args.config and Path(args.config).is_dir():
        parser.error(f"--config {args.config!r} is a directory: pass a YAML file such as configs/tiny.yaml")
    if is_chunk_recipe(args.config):  # configs/pretrain-gpu.yaml: a chunk pretraining on text alone, its own loop
        from .training.chunk_recipe import train_recipe
        return train_recipe(args.config, args.overrides, resume=args.resume, overwrite=args.overwrite)
    try:
        cfg = load_config(args.config, args.overrides)
    except yaml.YAMLError as e:
        parser.error(f"{_yaml_source(args.config, args.overrides)} is not valid YAML: {_yaml_problem(e)}")
    except ValueError as e:
        parser.error(str(e))
    from .tasks import resolve_task

    try:  # a missing task file is named before the LM loads
        resolve_task(cfg.data.task).check_trainable()
    except ValueError as e:
        parser.error(f"data.task: {e}")
    from .lm import LMLoadError
    from .training import train
    from .training.state_cache import CacheChanged

    setup_logging()
    created = _first_missing(cfg.run_dir)
    try:
        train(cfg, resume=args.resume, overwrite=args.overwrite, discard_last=args.discard_last)
    except (FileExistsError, FileNotFoundError, ValueError, LMLoadError, CacheChanged) as e:
        # an existing run, changed settings on resume, an empty split, a missing task file, an unknown LM,
        # a cache file rewritten under the run
        if created is not None:
            _remove_failed_start(cfg.run_dir, created)
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _yaml_problem(error: yaml.YAMLError) -> str:
    """PyYAML's message of several lines as one: the problem and where it is."""
    problem = getattr(error, "problem", None) or " ".join(str(error).split())
    mark = getattr(error, "problem_mark", None)
    return f"{problem} (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else problem


def _yaml_source(config: str | None, overrides: list[str]) -> str:
    """Which input of `load_config` holds the YAML that does not parse: the file or an override."""
    if config:
        try:
            yaml.safe_load(Path(config).read_text())
        except yaml.YAMLError:
            return f"config file {config!r}"
    for item in overrides:
        try:
            yaml.safe_load(item.partition("=")[2])
        except yaml.YAMLError:
            return f"override {item!r}"
    return "the configuration"


def _first_missing(path: Path) -> Path | None:
    """The outermost folder on the way to `path` that does not exist yet; None when `path` exists."""
    missing = None
    for folder in (path, *path.parents):
        if folder.exists():
            break
        missing = folder
    return missing


def _remove_failed_start(run_dir: Path, created: Path) -> None:
    """`train` writes the resolved config before it loads the LM and the data: when this command
    created the run folder (and `created`, the first of its parents that was missing) and the start
    failed there, they go again, so nothing is left."""
    if not (run_dir.is_dir() and [p.name for p in run_dir.iterdir()] == ["train_config.yaml"]):
        return
    shutil.rmtree(run_dir)
    for folder in run_dir.parents:
        if not folder.is_relative_to(created) or any(folder.iterdir()):
            break
        folder.rmdir()


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _names(text: str) -> list[str]:
    """A comma-separated list of names (tasks, methods) that is not only commas and spaces."""
    names = _csv(text)
    if text.strip() and not names:
        raise argparse.ArgumentTypeError(f"expected comma-separated names, got {text!r}")
    return names


def _task_names(text: str) -> list[str]:
    """Comma-separated task names; a file task's per-split list keeps its commas."""
    names = split_task_names(text)
    if text.strip() and not names:
        raise argparse.ArgumentTypeError(f"expected comma-separated names, got {text!r}")
    return names


def _ints(text: str) -> list[int]:
    try:
        return [int(part) for part in _csv(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def build_eval_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="ilcp-eval", description=eval_help(),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", required=True, help="the run directory written by train.py (checkpoints/RUN)")
    parser.add_argument("--tasks", type=_task_names, default=[],
                        help="extra tasks, comma-separated: babi:N, babi:all (each shipped task, reported one by one), "
                             "facts, facts-heldout (facts whose values training never used), babilong:N:LENGTH (bAbI "
                             "task N in LENGTH tokens of prose: 0, 0.5k, 1k, 2k, 4k or a number), squad, or a file of "
                             "yours: jsonl:PATH, csv:PATH, parquet:PATH, disk:PATH, jsonl:train=A,test=B (read with the "
                             "run's data.columns); the training task is always included")
    parser.add_argument("--methods", type=_names, default=list(DEFAULT_METHODS),
                        help=f"methods and groups, comma-separated (default: {','.join(DEFAULT_METHODS)}; known: "
                             f"{', '.join(method_names())}, where rclc:... is rclc:SELECTOR:rN or :bN "
                             f"[:prefix|:tuned]; groups: {', '.join(METHOD_GROUPS)})")
    parser.add_argument("--split", default="test", choices=EVAL_SPLITS,
                        help="whose questions every task asks: test (default), or validation, to choose between "
                             "runs or settings without reading the test split")
    parser.add_argument("--limit", type=int, default=DEFAULT_LIMIT,
                        help=f"questions per task, the first of the split (default {DEFAULT_LIMIT}; 0 = all)")
    parser.add_argument("--latency-n", type=int, default=DEFAULT_LATENCY_N,
                        help=f"requests timed one at a time per method and task (default {DEFAULT_LATENCY_N}; 0 = none)")
    parser.add_argument("--batch-size", type=int, default=8, help="greedy-decoding batch size for accuracy (default 8)")
    parser.add_argument("--max-new-tokens", type=int, default=8, help="answer token budget (default 8)")
    parser.add_argument("--lengths", type=_ints, default=list(DEFAULT_LENGTHS),
                        help="context lengths in tokens of the time-to-first-token sweep (default "
                             f"{','.join(map(str, DEFAULT_LENGTHS))}; empty string = no sweep)")
    parser.add_argument("--length-n", type=int, default=3, help="requests per length and method (default 3)")
    parser.add_argument("--facts-count-limit", type=int, default=50,
                        help="questions per number of facts in the facts-count sweep of a facts-trained run (default 50)")
    parser.add_argument("--payload-dtype", default="float32", choices=PAYLOAD_DTYPES,
                        help="dtype of the ilcp latent on the wire (default float32; int8: per-row absmax with a "
                             "float32 scale)")
    parser.add_argument("--only-tasks", action="store_true",
                        help="evaluate only the --tasks given, not the run's training task")
    parser.add_argument("--resume", action="store_true",
                        help="reuse the (task, method) results an earlier evaluation with the same settings saved "
                             "under --out (parts/), computing only the missing ones: a long evaluation goes in pieces")
    parser.add_argument("--precision", default=None, choices=PRECISIONS,
                        help="compute precision of the LM's forwards: 32-true, bf16-mixed (bfloat16 autocast) or auto "
                             "(bf16-mixed where the CPU or GPU computes bfloat16 natively); default: the run's own")
    parser.add_argument("--facts-counts", type=_ints, default=list(DEFAULT_FACTS_COUNTS),
                        help="numbers of facts of the facts-count sweep of a facts-trained run (default "
                             f"{','.join(map(str, DEFAULT_FACTS_COUNTS))}; empty string = no sweep)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the facts contexts in the context-length sweep (default 0)")
    parser.add_argument("--engine", default="hf", choices=ENGINES,
                        help="the receiver's decoder: hf (default) or vllm (also decodes with HF and compares; "
                             "needs .venv-vllm/bin/python)")
    parser.add_argument("--throughput-batches", type=_ints, default=[],
                        help="batch sizes of the receiver-throughput benchmark, e.g. 1,8,32 (default: none)")
    parser.add_argument("--throughput-n", type=int, default=DEFAULT_THROUGHPUT_N,
                        help=f"questions decoded per throughput cell (default {DEFAULT_THROUGHPUT_N})")
    parser.add_argument("--vllm-kv-cache-mb", type=int, default=1024,
                        help="the vLLM engine's KV cache in MiB (default 1024)")
    parser.add_argument("--device", default=None, help="where the LM runs (default: cuda if available, else cpu)")
    parser.add_argument("--out", default=None,
                        help="output directory (default results/<run name>; not inside the run folder)")
    parser.add_argument("--export-key-file", default=None, metavar="PATH",
                        help=f"a file holding the key the export was signed with (ilcp.export.sign_export), its bytes "
                             f"as they are (at least 16): config.json's signature must verify under it, as "
                             f"from_pretrained(export_key=) checks it (default: ${EXPORT_KEY_ENV} when set; without "
                             f"a key the export is read unverified, and a note says so)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser


def eval_config(args: argparse.Namespace, out: Path) -> EvalConfig:
    """The `EvalConfig` of ``ilcp-eval``'s parsed arguments (ValueError for a bad value)."""
    if args.vllm_kv_cache_mb < 1:
        raise ValueError(f"--vllm-kv-cache-mb must be >= 1, got {args.vllm_kv_cache_mb}")
    export_key = read_export_key(args.export_key_file)
    return EvalConfig(
        tasks=args.tasks, methods=args.methods, split=args.split, limit=args.limit, latency_n=args.latency_n,
        batch_size=args.batch_size, max_new_tokens=args.max_new_tokens, lengths=args.lengths,
        length_n=args.length_n, facts_counts=args.facts_counts, facts_count_limit=args.facts_count_limit,
        seed=args.seed, out=out, device=args.device, progress=not args.no_progress,
        payload_dtype=args.payload_dtype, engine=args.engine, throughput_batches=args.throughput_batches,
        throughput_n=args.throughput_n, vllm_kv_cache_bytes=args.vllm_kv_cache_mb << 20, precision=args.precision,
        resume=args.resume, only_tasks=args.only_tasks, export_key=export_key,
    )


EXPORT_KEY_ENV = "ILCP_EXPORT_KEY_FILE"


def read_export_key(path: str | None) -> bytes | None:
    """The key of ``--export-key-file PATH``, else of the file ``$ILCP_EXPORT_KEY_FILE`` names,
    else None: the file's bytes as they are. ValueError, one line naming the file and where it
    was named, for a file that is missing, not a regular file or shorter than 16 bytes."""
    import os

    where = "--export-key-file"
    if path is None:
        path, where = os.environ.get(EXPORT_KEY_ENV) or None, EXPORT_KEY_ENV
    if path is None:
        return None
    file = Path(path)
    if not file.exists():
        raise ValueError(f"{where} {path!r} does not exist: pass the file holding the key the export was signed with")
    if not file.is_file():
        raise ValueError(f"{where} {path!r} is not a regular file: pass the file holding the key the export was "
                         f"signed with")
    key = file.read_bytes()
    if len(key) < 16:
        raise ValueError(f"{where} {path!r} holds {len(key)} bytes; an export key is at least 16 bytes (its bytes "
                         f"are the key, as written by Path(file).write_bytes(key))")
    return key


def eval_main(argv: list[str] | None = None) -> int:
    parser = build_eval_parser()
    args = parser.parse_args(argv)
    for name in args.methods:
        problem = unknown_method(name)
        if problem:
            parser.error(problem)
    ckpt = Path(args.ckpt)
    if not ckpt.is_dir():
        parser.error(f"--ckpt {args.ckpt!r} is not a directory: pass a run folder written by train.py")
    out = Path(args.out) if args.out else Path("results") / ckpt.resolve().name
    if out.exists() and not out.is_dir():
        parser.error(f"--out {str(out)!r} is a file: pass a folder for the results")
    if (ckpt / "config.json").exists() and out.resolve().is_relative_to(ckpt.resolve()):  # an export's folder
        parser.error(f"--out {str(out)!r} is inside the run folder {str(ckpt)!r}: the results would be written into "
                     f"the export; pass a folder outside it (default results/<run name>)")
    try:
        cfg = eval_config(args, out)
    except ValueError as e:  # a bad number, before anything heavy is imported
        parser.error(str(e))
    from .evaluation.decoders import require_engine
    from .evaluation.report import markdown_report
    from .evaluation.run import evaluate
    from .lm import LMLoadError

    try:
        require_engine(args.engine)
    except ImportError as e:  # one line, not vLLM's traceback: which interpreter to use
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    if args.device is not None:
        import torch

        try:
            device = torch.device(args.device)
        except (RuntimeError, ValueError):
            parser.error(f"--device {args.device!r} is not a device (cpu, cuda, cuda:1, ...)")
        if device.type == "cuda" and not torch.cuda.is_available():
            parser.error(f"--device {args.device!r}: no CUDA GPU is available here (torch.cuda.is_available() is "
                         "False); use --device cpu")
        if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
            parser.error(f"--device {args.device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    setup_logging()
    log = logging.getLogger("ilcp.eval").info
    if cfg.export_key is None:
        log(f"note: {ckpt} is evaluated unverified: no --export-key-file or ${EXPORT_KEY_ENV}, so its signature is "
            f"not checked (its digests catch accidents, not edits)")
    log(f"{ckpt}: limit {args.limit or 'none (whole split)'} questions per task, {args.latency_n} timed "
        f"requests per method; results in {out}")
    try:
        results = evaluate(ckpt, cfg, log=log)
    except ValueError as e:  # bad task, method or number; not a finished run; another LM (ExportError)
        parser.error(str(e))
    except LMLoadError as e:  # the LM config.json names cannot be loaded here
        parser.error(str(e))
    except RuntimeError as e:
        if args.engine != "vllm" or "vLLM could not start" not in str(e):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    print()
    print(markdown_report(results))
    log(f"wrote {', '.join(['results.json', 'results.md', 'predictions.jsonl'] + results['plots'])} to {out}")
    return 0


SERVE_HELP = """Serve a run's LM with vLLM for receivers that decode over HTTP (ilcp.engines.served).

    .venv-vllm/bin/python -m ilcp serve checkpoints/default --port 8000
    .venv-vllm/bin/python -m ilcp serve checkpoints/default --port 8000 -- --enforce-eager --max-num-seqs 8
    python -m ilcp serve checkpoints/default --print        # the command only

Loads the run's LM once to check its fingerprint, prints the vLLM server command (prompt
embeddings on, the run's dtype: bfloat16 for a run trained at bf16-mixed, --dtype to choose, the served model named ilcp-<fingerprint>-<table digest>) and
runs it in place of this process. Arguments after -- go to vLLM. On a CPU build add
--enforce-eager and set VLLM_CPU_KVCACHE_SPACE (GiB of KV cache)."""


def serve_main(argv: list[str] | None = None) -> int:
    """``python -m ilcp serve RUN [--port N] [-- vLLM arguments]`` (`ilcp.engines.serve.serve_command`)."""
    import os

    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(prog="python -m ilcp serve", description=SERVE_HELP,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", help="the run directory (its export: config.json + model.safetensors)")
    parser.add_argument("--model-dir", default=None, help="the LM's model directory; default the run's LM spec")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                        help="the server's dtype (default: bfloat16 for a run trained at bf16-mixed, else the LM's)")
    parser.add_argument("--print", dest="print_only", action="store_true", help="print the command, do not run it")
    args = parser.parse_args(argv)
    if not 0 < args.port < 65536:
        parser.error(f"--port must be in 1..65535, got {args.port}")
    if not Path(args.run, "config.json").is_file():
        parser.error(f"{args.run!r} is not a run directory (no config.json in it)")
    import importlib.util
    import shlex

    from .encoder.spec import ExportError
    from .engines.serve import serve_command

    try:
        command = serve_command(args.run, model_dir=args.model_dir, host=args.host, port=args.port, extra=extra,
                                dtype=args.dtype)
    except (ExportError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(shlex.join(command), flush=True)
    if args.print_only:
        return 0
    if importlib.util.find_spec("vllm") is None:
        print(f"error: vLLM is not installed in this environment ({sys.executable}): run the command with "
              ".venv-vllm/bin/python (bash scripts/install.sh builds it), or on a GPU after pip install -r "
              "requirements/vllm.txt", file=sys.stderr)
        return 2
    os.execv(command[0], command)
    return 0  # not reached


def main(argv: list[str] | None = None) -> int:
    """``python -m ilcp train ...``, ``eval ...`` or ``serve RUN``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"train": train_main, "eval": eval_main, "serve": serve_main}
    usage = "usage: python -m ilcp {train,eval,serve} [arguments]  (python -m ilcp train --help)"
    if argv and argv[0] in ("-h", "--help"):
        print(usage)
        return 0
    if not argv or argv[0] not in commands:
        what = f"unknown command {argv[0]!r}" if argv else "no command"
        print(f"error: {what}; {usage}", file=sys.stderr)
        return 2
    return commands[argv[0]](argv[1:])
