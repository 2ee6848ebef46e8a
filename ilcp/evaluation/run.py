"""`evaluate`: every method of the protocol on the run's task (and held-out tasks), with latency.

    from ilcp.eval_config import EvalConfig
    from ilcp.evaluation.run import evaluate
    results = evaluate("checkpoints/default", EvalConfig(tasks=["babi:2"], limit=200, out="results/default"))
    results = evaluate("checkpoints/default", tasks=["babi:2"], limit=200)   # the same fields as keywords

The settings are one `EvalConfig`; `evaluate` opens the run (`open_session`) and runs the parts
below as separate functions over it, in this order.

The run's training task and its settings come from its config.json (``task``, ``task_settings``:
the facts task is rebuilt with the run's number of facts, distractors and seed; bAbI tasks read
the ``en`` test file). For each task (the run's training task, test split, plus the ``tasks``
given) and each method (`evaluate_task`):
1. accuracy, batched: the method builds the receiver prefixes of every row, one greedy decoder
   answers them; exact match and contains on the normalised first line, token F1, 95% Wilson
   intervals of the two accuracies, wire bytes and tensor bytes per request and prefill positions
   (a method whose receiver starts from no embedding prefix, e.g. ``kv_relay:...``, decodes its
   rows itself: ``HandoffMethod.decodes_itself``);
2. latency, per request and unbatched, on the first ``latency_n`` rows (after one untimed
   warm-up request): sender time (`HandoffMethod.send`), receiver time to first token (its
   `receive` plus the prefill of `decode_one`), and the handoff time, their sum.
With ``engine="vllm"`` step 1 decodes the same prefixes through a vLLM engine too (`.decoders`):
each method's metrics gain the vLLM answers' accuracy and their agreement with the HF decoder's
(summed over every task and method by `engine_agreement`).
With ``throughput_batches`` the receiver's decode is benchmarked in questions per second at those
batch sizes (ilcp and cold_read; HF, and vLLM with that engine: `throughput_table`).
Then the receiver's time to first token against context length on the facts task (no_context,
cold_read, ilcp: `context_length_sweep`), and, for a run trained on the facts task, accuracy
against the number of facts in the context (ilcp, prompt_tuned, cold_read_tuned:
`facts_count_sweep`). The result dict is written as
results.json, results.md and PNG plots when ``out`` is given (`ilcp.evaluation.report`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .. import __version__
from ..decoding import decode_one, greedy_decode
from ..export import ExportError, check_fingerprint, read_config, read_export
from ..handoff import ILCPHandoff
from ..lm import LM, load_lm
from ..pooling import context_lengths
from ..precision import autocast, resolve
from ..provenance import provenance
from ..tasks import EvalRows, EvalTaskContext, Task, count_tokens, facts_for_length, make_facts, resolve_task
from ..tasks.facts import FACTS_TEST_SIZE
from ..io import atomic_write_json, atomic_write_text
from ..engines.vllm import VLLMDecoder, require_vllm
from ..eval_config import EvalConfig
from .decoders import THROUGHPUT_METHODS, compare, receiver_throughput, require_engine, start_vllm, vllm_unavailable
from ..names import DEFAULT_FACTS_COUNTS, DEFAULT_LATENCY_N, DEFAULT_LENGTHS, DEFAULT_LIMIT, DEFAULT_THROUGHPUT_N, split_task_names
from .rclc_methods import SenderStates, sender_states
from .registry import EvalContext, HandoffMethod, MethodUnavailable, expand_method_names, make_method
from .report import accepted_answers, accuracy_summary, latency_summary, write_report

__all__ = ["DEFAULT_FACTS_COUNTS", "DEFAULT_LATENCY_N", "DEFAULT_LENGTHS", "DEFAULT_LIMIT",
           "DEFAULT_THROUGHPUT_N", "EvalConfig", "EvalSession", "context_length_sweep",
           "engine_agreement", "evaluate", "evaluate_task", "facts_count_sweep", "open_session", "parse_task",
           "start_engine", "throughput_table", "time_request"]

LENGTH_METHODS = ("no_context", "cold_read", "ilcp")
FACTS_COUNT_METHODS = ("ilcp", "prompt_tuned", "cold_read_tuned")
CHUNK = 64  # rows whose prefixes are built and decoded together (bounds memory)

def parse_task(name: str) -> Task:
    """The `ilcp.tasks.Task` a name given to eval stands for, checked as far as it can be without
    the LM (a bAbI task's ``en`` test file, a file task's files); ValueError naming the problem."""
    task = resolve_task(name)  # its ValueError lists the forms
    task.check_evaluable()
    return task


FACTS_SETTINGS = {"n_facts": "facts_n_facts", "n_distractors": "facts_n_distractors", "seed": "seed"}


def run_facts_settings(config: dict, ckpt: Path) -> dict:
    """The facts task's settings the run trained with: config.json's ``task_settings``
    (``facts_n_facts``, ``facts_n_distractors``, ``seed``), as `make_facts` arguments.

    Raises:
        ExportError: config.json records no ``task_settings`` or lacks one of those keys (an
            export written before the export recorded them: export the run again).
    """
    recorded = config.get("task_settings")
    where = ckpt / "config.json"
    if not isinstance(recorded, dict):
        raise ExportError(f"{where} records no task_settings, which the facts task needs (facts_n_facts, "
                          "facts_n_distractors, seed): export the run again with this package")
    missing = [key for key in FACTS_SETTINGS.values() if key not in recorded]
    if missing:
        raise ExportError(f"{where}: task_settings lacks {', '.join(missing)}, which the facts task needs: "
                          "export the run again with this package")
    settings = {}
    for arg, key in FACTS_SETTINGS.items():
        value = recorded[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ExportError(f"{where}: task_settings.{key} must be an int >= 0, got {value!r}")
        settings[arg] = value
    if settings["n_facts"] < 1:
        raise ExportError(f"{where}: task_settings.facts_n_facts must be >= 1, got {settings['n_facts']}")
    value_split = recorded.get("facts_value_split")
    if value_split not in (None, "train"):
        raise ExportError(f"{where}: task_settings.facts_value_split must be null or 'train', got {value_split!r}")
    if value_split is not None:
        settings["value_split"] = value_split
    return settings


# --------------------------------------------------------------------------------------------
# one request, timed


@dataclass(frozen=True)
class TimedRequest:
    """Seconds of one handoff request: sender, receiver to first token, receiver to the full answer."""

    sender_s: float
    receiver_ttft_s: float
    receiver_total_s: float
    prefill_positions: int
    wire_bytes: int
    text: str

    @property
    def handoff_s(self) -> float:
        return self.sender_s + self.receiver_ttft_s


def time_request(method: HandoffMethod, row: dict, *, max_new_tokens: int = 8) -> TimedRequest:
    """Run one request unbatched: ``send`` (sender), then ``receive`` and `decode_one` (receiver;
    a method that decodes itself: its `decode_received`)."""
    lm = method.lm
    t0 = time.perf_counter()
    sent = method.send(row)
    t1 = time.perf_counter()
    prefix = method.receive(sent, row)
    t2 = time.perf_counter()
    if method.decodes_itself:
        result = method.decode_received(prefix, row, max_new_tokens=max_new_tokens, stop_at_newline=True)
    else:
        result = decode_one(lm.model, lm.tokenizer, prefix, max_new_tokens=max_new_tokens, stop_at_newline=True)
    return TimedRequest(sender_s=t1 - t0, receiver_ttft_s=(t2 - t1) + result.prefill_s,
                        receiver_total_s=(t2 - t1) + result.total_s, prefill_positions=result.prefill_positions,
                        wire_bytes=sent.wire_bytes, text=result.text)


def _latency(method: HandoffMethod, rows: Sequence[dict], max_new_tokens: int, progress: bool, desc: str) -> dict:
    if not rows:
        return {"n": 0, **{k: latency_summary([]) for k in ("sender_s", "receiver_ttft_s", "receiver_total_s", "handoff_s")}}
    time_request(method, rows[0], max_new_tokens=max_new_tokens)  # warm-up: allocations, kernels
    timed = [time_request(method, r, max_new_tokens=max_new_tokens)
             for r in tqdm(rows, desc=desc, disable=not progress, leave=False)]
    latency = {
        "n": len(timed),
        "sender_s": latency_summary([t.sender_s for t in timed]),
        "receiver_ttft_s": latency_summary([t.receiver_ttft_s for t in timed]),
        "receiver_total_s": latency_summary([t.receiver_total_s for t in timed]),
        "handoff_s": latency_summary([t.handoff_s for t in timed]),
    }
    reused = getattr(method, "reused_sender_seconds", None)
    if reused is not None:  # ilcp: the sender's time when its own forward already ran
        latency["sender_reusing_forward_s"] = latency_summary([reused(r) for r in rows])
    return latency


# --------------------------------------------------------------------------------------------
# accuracy, batched


class _Accuracy:
    """One method's accuracy on a task, fed chunk by chunk (`add`), so that several methods can
    take turns on the same chunk of questions (`_accuracy_shared`)."""

    def __init__(self, method: HandoffMethod, max_new_tokens: int, batch_size: int,
                 vllm: VLLMDecoder | None = None, open_text: bool = False):
        self.method, self.max_new_tokens, self.batch_size, self.vllm = method, max_new_tokens, batch_size, vllm
        self.open_text = open_text  # SQuAD's scoring (`accuracy_summary`)
        self.predictions: list[str] = []
        self.vllm_predictions: list[str] | None = [] if vllm is not None else None
        self.unavailable: str | None = None
        self.decode_s = self.vllm_s = 0.0
        self.wire, self.tensor, self.positions = [], [], []

    def add(self, chunk: Sequence[dict]) -> None:
        method, vllm, max_new_tokens = self.method, self.vllm, self.max_new_tokens
        if method.decodes_itself:  # its receiver starts from no (L, H) prefix (e.g. a KV cache)
            decoded = method.decode_rows(chunk, max_new_tokens=max_new_tokens, stop_at_newline=True)
            self.predictions += decoded.answers
            self.decode_s += decoded.decode_s
            self.wire += decoded.wire_bytes
            self.tensor += decoded.tensor_bytes
            self.positions += decoded.prefill_positions
            if vllm is not None and self.unavailable is None:
                self.unavailable = str(method.vllm_unavailable or "the method decodes itself")
            return
        built = method.build_prefixes(chunk)
        # Batches of similar lengths pad less; answers do not depend on the batching.
        order = sorted(range(len(chunk)), key=lambda i: built.prefixes[i].shape[0])
        ordered = [built.prefixes[i] for i in order]
        t0 = time.perf_counter()
        answers = greedy_decode(method.lm.model, method.lm.tokenizer, ordered, max_new_tokens=max_new_tokens,
                                batch_size=self.batch_size, stop_at_newline=True)
        self.decode_s += time.perf_counter() - t0
        self.predictions += _unsort(order, answers)
        if vllm is not None and self.unavailable is None:
            self.unavailable = vllm_unavailable(method, ordered, vllm, max_new_tokens)
        if vllm is not None and self.unavailable is None:
            t0 = time.perf_counter()
            try:
                answers = vllm.decode(ordered, max_new_tokens=max_new_tokens, stop_at_newline=True)
            except (ValueError, RuntimeError) as e:  # what the engine refuses, said in one line
                self.unavailable = " ".join(str(e).split()) or type(e).__name__
            else:
                self.vllm_s += time.perf_counter() - t0
                self.vllm_predictions += _unsort(order, answers)
        self.wire += built.wire_bytes
        self.tensor += built.tensor_bytes
        self.positions += [int(p.shape[0]) for p in built.prefixes]

    def result(self, rows: Sequence[dict]) -> tuple[dict, list[str], list[str] | None]:
        def mean(x):
            return sum(x) / len(x) if x else 0.0

        metrics = {
            **accuracy_summary(self.predictions, [accepted_answers(r) for r in rows], open_text=self.open_text),
            "wire_bytes": mean(self.wire),
            "tensor_bytes": mean(self.tensor),
            "prefill_positions": mean(self.positions),
            "decode_s": round(self.decode_s, 3),
        }
        vllm_predictions = self.vllm_predictions
        if self.vllm is not None:
            if self.unavailable is not None:
                metrics["vllm"] = {"unavailable": f"unavailable on vllm: {self.unavailable}"}
                vllm_predictions = None
            else:
                metrics["vllm"] = compare(rows, self.predictions, vllm_predictions, self.vllm_s,
                                          open_text=self.open_text)
        return metrics, self.predictions, vllm_predictions


def _unsort(order: Sequence[int], answers: Sequence[str]) -> list[str]:
    in_order = [""] * len(order)
    for i, answer in zip(order, answers):
        in_order[i] = answer
    return in_order


def _accuracy(method: HandoffMethod, rows: Sequence[dict], *, batch_size: int, max_new_tokens: int,
              progress: bool, desc: str, vllm: VLLMDecoder | None = None,
              open_text: bool = False) -> tuple[dict, list[str], list[str] | None]:
    """Metrics and predictions of the HF decoder; with ``vllm``, the same prefixes decoded through
    it too: ``metrics["vllm"]`` (`compare`, or ``{"unavailable": why}``) and its predictions.
    ``open_text``: scored as SQuAD (the task's answers are open text)."""
    acc = _Accuracy(method, max_new_tokens, batch_size, vllm, open_text)
    for start in tqdm(range(0, len(rows), CHUNK), desc=desc, disable=not progress, leave=False):
        acc.add(rows[start:start + CHUNK])
    return acc.result(rows)


def _accuracy_shared(methods: Sequence[HandoffMethod], rows: Sequence[dict], states: SenderStates, *,
                     batch_size: int, max_new_tokens: int, progress: bool, desc: str,
                     vllm: VLLMDecoder | None = None,
                     open_text: bool = False) -> list[tuple[dict, list[str], list[str] | None, float]]:
    """`_accuracy` of several methods that share sender states (RCLC and kv_relay rows), with the
    questions outside and the methods inside: each chunk holds as many contexts as ``states``
    keeps at once, so every context's sender state is built once for all the methods, however
    long the contexts (methods outside would rebuild them once a method's contexts overflow the
    bound). Returns, per method, `_accuracy`'s triple and the seconds spent on it."""
    lengths = context_lengths(methods[0].lm.tokenizer, [methods[0].sender_text(r["context"]) for r in rows])
    per_chunk = max(1, min(CHUNK, states.capacity, states.max_positions // max(max(lengths, default=1), 1)))
    accs = [_Accuracy(m, max_new_tokens, batch_size, vllm, open_text) for m in methods]
    seconds = [0.0] * len(methods)
    for start in tqdm(range(0, len(rows), per_chunk), desc=desc, disable=not progress, leave=False):
        chunk = rows[start:start + per_chunk]
        for i, acc in enumerate(accs):
            t0 = time.perf_counter()
            acc.add(chunk)
            seconds[i] += time.perf_counter() - t0
    return [(*acc.result(rows), s) for acc, s in zip(accs, seconds)]


# --------------------------------------------------------------------------------------------
# the evaluation


def _resolve_methods(names: Sequence[str]) -> list[HandoffMethod]:
    if isinstance(names, str):
        names = [n for n in names.split(",") if n.strip()]
    if not names:
        raise ValueError("no methods given")
    methods = [make_method(n) for n in expand_method_names(names)]
    return methods


def _training_tasks(train_task: str) -> list[Task]:
    """The tasks a run trained on, as eval reports them: its one task, or each task of a mix
    ("babi:1+2+3", "babi:all", "babilong:1+8:0.5k")."""
    return list(resolve_task(train_task).parts())


def _resolve_tasks(train_task: str, extra: Sequence[str], only_extra: bool = False) -> list[Task]:
    """The run's training tasks (unless ``only_extra``), then each of ``extra`` (a mix as its tasks)."""
    if isinstance(extra, str):
        extra = split_task_names(extra)
    specs = [] if only_extra else _training_tasks(train_task)
    for name in extra:
        specs += parse_task(name).parts()
    return list({s.name: s for s in specs}.values())


@dataclass
class EvalSession:
    """What the parts of one evaluation share: its settings, the run, the LM, the methods bound to
    them and the vLLM engine (`open_session` builds it; `evaluate` passes it to each part)."""

    config: EvalConfig
    ckpt: Path
    run_config: dict  # the run's config.json
    lm: LM
    precision: str  # resolved: "32-true" or "bf16-mixed"
    handoff: ILCPHandoff | None  # None: the run has no ilcp encoder
    asked: list[str]  # every method asked for, groups expanded
    methods: list[HandoffMethod]  # those bound to the run, in the order asked
    skipped: dict[str, str]  # method -> why it does not run
    tasks: list[Task]  # the run's training task(s) first
    trained_on: set[str]
    facts_settings: dict | None  # the run's facts task settings when a facts task is evaluated
    task_context: EvalTaskContext  # what a task needs to build its test rows
    vllm: VLLMDecoder | None = None
    engine_info: dict | None = None
    say: Callable[[str], None] = lambda message: None

    def methods_named(self, names: Sequence[str]) -> list[HandoffMethod]:
        """The bound methods among ``names``, in the order asked."""
        return [m for m in self.methods if m.name in names]


def open_session(ckpt: str | os.PathLike, config: EvalConfig, *, lm: LM | None = None,
                 vllm: VLLMDecoder | None = None, log: Callable[[str], None] | None = None) -> EvalSession:
    """Check the run and the names in ``config``, then load the LM (unless given), the run's modules
    and, with engine="vllm", the engine; bind every method the run has weights for.

    Everything that can be checked without the LM is checked before it loads. Raises as `evaluate`.
    """
    say = log or (lambda message: None)
    require_engine(config.engine)
    ckpt = Path(ckpt)
    run_config = read_config(ckpt)
    chosen = _resolve_methods(config.methods)
    task_specs = _resolve_tasks(run_config["task"], config.tasks, config.only_tasks)
    trained_on = {s.name for s in _training_tasks(run_config["task"])}
    facts_settings = (run_facts_settings(run_config, ckpt) if any(spec.needs_facts_settings for spec in task_specs)
                      else None)
    files = run_config.get("files", {})
    skipped: dict[str, str] = {}
    runnable = []
    for m in chosen:
        missing = [r for r in m.requires if r not in files]
        if missing:
            skipped[m.name] = f"the run has no {', '.join(missing)} weights (trained variants: {sorted(files)})"
            say(f"skipping {m.name}: {skipped[m.name]}")
        else:
            runnable.append(m)

    # The LM and the run's modules.
    if lm is None:
        dev = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        say(f"loading LM {run_config['lm']['spec']!r} ({run_config['lm'].get('dtype', 'float32')}, {dev})")
        lm = load_lm(run_config["lm"]["spec"], dtype=run_config["lm"].get("dtype", "float32"), device=dev)
    check_fingerprint(run_config, lm.fingerprint)
    run = read_export(ckpt)
    precision = resolve(config.precision or str(run_config["lm"].get("precision", "32-true")), lm.device)
    say(f"compute precision {precision}")
    handoff = (ILCPHandoff.from_export(run, lm, payload_dtype=config.payload_dtype, precision=precision)
               if run.encoder is not None else None)
    ctx = EvalContext(lm=lm, run=run, handoff=handoff, max_new_tokens=config.max_new_tokens)
    vllm, engine_info = start_engine(config, lm, vllm=vllm, log=say)
    bound = []
    for m in runnable:
        try:
            m.bind(ctx)
            bound.append(m)
        except MethodUnavailable as e:
            skipped[m.name] = str(e)
            say(f"skipping {m.name}: {e}")
    limit = lm.context_limit
    sender_limit = handoff.max_length if handoff is not None else limit
    task_context = EvalTaskContext(tokenizer=lm.tokenizer, max_tokens=limit if sender_limit >= limit else None,
                                   task_settings=dict(run_config.get("task_settings") or {}),
                                   facts_settings=facts_settings, train_task=run_config["task"])
    return EvalSession(config=config, ckpt=ckpt, run_config=run_config, lm=lm, precision=precision, handoff=handoff,
                       asked=[m.name for m in chosen], methods=bound, skipped=skipped, tasks=task_specs,
                       trained_on=trained_on, facts_settings=facts_settings, task_context=task_context, vllm=vllm,
                       engine_info=engine_info, say=say)


def start_engine(config: EvalConfig, lm: LM, *, vllm: VLLMDecoder | None = None,
                 log: Callable[[str], None] | None = None) -> tuple[VLLMDecoder | None, dict | None]:
    """With engine="vllm": the engine (``vllm`` when given, else one started on ``lm``, its files in
    OUT/vllm or a temporary folder) and what results.json records of it; (None, None) otherwise."""
    if config.engine != "vllm":
        return None, None
    t0 = time.perf_counter()
    if vllm is None:
        out = config.out
        folder = Path(out) / "vllm" if out is not None else Path(tempfile.mkdtemp(prefix="ilcp-vllm-"))
        vllm = start_vllm(lm, folder, kv_cache_bytes=config.vllm_kv_cache_bytes, log=log or (lambda message: None))
    elif not isinstance(vllm, VLLMDecoder) or vllm.lm is not lm:
        raise ValueError("vllm must be an ilcp.engines.vllm.VLLMDecoder on the LM the evaluation uses")
    info = {"vllm_version": getattr(require_vllm(), "__version__", None),
            "dtype": str(vllm.dtype).removeprefix("torch."),
            "max_model_len": vllm.max_model_len, "start_s": round(time.perf_counter() - t0, 1)}
    return vllm, info


def evaluate(
    ckpt: str | os.PathLike,
    config: EvalConfig | None = None,
    *,
    lm: LM | None = None,
    vllm: VLLMDecoder | None = None,
    log: Callable[[str], None] | None = None,
    **settings,
) -> dict:
    """Evaluate the methods of a trained run; returns the results dict (and writes it to ``config.out``).

    The parts run in this order, every forward inside the run's compute precision: accuracy and
    latency per task (`evaluate_task`), the vLLM engine's agreement with HF (`engine_agreement`),
    the receiver-throughput table (`throughput_table`), the context-length sweep
    (`context_length_sweep`) and the facts-count sweep (`facts_count_sweep`).

    Args:
        ckpt: the run directory (``checkpoints/RUN``).
        config: the settings (`ilcp.eval_config.EvalConfig`, whose fields say what each does);
            None builds one from ``settings``.
        lm: the run's LM already loaded (else loaded from config.json's spec, on ``config.device``).
        vllm: a `VLLMDecoder` on ``lm`` to use instead of starting an engine (engine="vllm").
        log: called with progress lines (eval.py logs them); None is silent.
        **settings: `EvalConfig` fields (``methods=["ilcp"], limit=8``), replacing those of
            ``config`` when one is given.

    With engine="vllm" every method's prefixes are decoded by the HF decoder and through one vLLM
    engine, and each method's metrics gain a ``"vllm"`` entry (exact match, contains, F1,
    agreement with HF; or ``"unavailable"`` and why); latency and the sweeps stay on the HF
    decoder. The default precision is the one the run trained at (config.json ``lm.precision``);
    the vLLM engine computes in its own dtype.

    Raises:
        ExportError: ``ckpt`` is not a finished run, ``lm`` is another LM than the run's, or a facts
            task is asked of a run whose config.json records no facts settings (``task_settings``).
        ValueError: an unknown method, task or engine, or a bad number.
        TypeError: a keyword that is not an `EvalConfig` field.
        ImportError: engine="vllm" without vLLM installed (the message names .venv-vllm).
        RuntimeError: the vLLM engine did not start.
    """
    t_start = time.perf_counter()
    if config is None:
        config = EvalConfig(**settings)
    elif settings:
        config = replace(config, **settings)
    elif not isinstance(config, EvalConfig):
        raise TypeError(f"config must be an EvalConfig, got {type(config).__name__}")
    session = open_session(ckpt, config, lm=lm, vllm=vllm, log=log)
    lm = session.lm
    results: dict = {
        "run": {"path": str(session.ckpt), "lm_spec": session.run_config["lm"]["spec"],
                "fingerprint": lm.fingerprint,
                "train_task": "+".join(s.name for s in _training_tasks(session.run_config["task"])),
                "latent_dim": session.run_config.get("latent_dim"),
                "num_memory_tokens": session.run_config.get("num_memory_tokens")},
        "settings": {"limit": config.limit, "latency_n": config.latency_n, "batch_size": config.batch_size,
                     "max_new_tokens": config.max_new_tokens, "intervals": "wilson", "seed": config.seed,
                     "methods": session.asked, "tasks": [s.name for s in session.tasks], "device": str(lm.device),
                     "engine": config.engine, "precision": session.precision,
                     "torch_threads": torch.get_num_threads()},
        "vllm": session.engine_info,
        "provenance": provenance(),
        "tasks": {},
        "skipped": session.skipped,
    }
    predictions: dict[str, tuple[list[dict], dict[str, list[str]], dict[str, list[str]]]] = {}
    # Every task's rows first: a bad file is refused before anything is evaluated or written.
    built = {spec.name: spec.eval_rows(config.limit, session.task_context) for spec in session.tasks}
    with autocast(session.precision, lm.device):  # every forward of every method at the run's precision
        for spec in session.tasks:
            results["tasks"][spec.name], predictions[spec.name] = evaluate_task(session, spec, built[spec.name])
        results["agreement"] = engine_agreement(session, results["tasks"])
        results["throughput"] = throughput_table(session)
        results["context_length"] = context_length_sweep(session)
        results["facts_count"] = facts_count_sweep(session)
    results["seconds"] = round(time.perf_counter() - t_start, 1)
    if config.out is not None:
        write_report(results, config.out)
        _write_predictions(Path(config.out), predictions)
    return results


def evaluate_task(session: EvalSession, spec: Task,
                  built: EvalRows | None = None) -> tuple[dict, tuple[list[dict], dict, dict]]:
    """Accuracy (batched, HF and with engine="vllm" vLLM too) and latency (unbatched, the first
    ``latency_n`` rows) of every bound method on one task's test split (``built``: its rows, when
    already built).

    Returns:
        (the task's entry of results["tasks"], (rows, HF predictions by method, vLLM predictions by
        method)) for predictions.jsonl.
    """
    cfg, say = session.config, session.say
    built = built or spec.eval_rows(cfg.limit, session.task_context)
    rows, available, source = built.rows, built.available, built.source
    seen = spec.name in session.trained_on
    say(f"task {spec.name} ({'seen in training' if seen else 'held out'}): {len(rows)} of {available} "
        f"questions, {len(session.methods)} methods")
    task_result = {"seen_in_training": seen, "source": source, "n": len(rows), "available": available,
                   "limit": cfg.limit, "methods": {}}
    lengths = context_lengths(session.lm.tokenizer, [r["context"] for r in rows]) if rows else [0]
    task_result["context_tokens"] = {"mean": round(sum(lengths) / len(lengths), 1), "max": max(lengths)}
    if session.handoff is not None:  # the ilcp sender reads at most the export's max_length tokens
        cut = sum(n > session.handoff.max_length for n in lengths)
        task_result["ilcp_max_length"], task_result["ilcp_truncated"] = session.handoff.max_length, cut
        if cut:
            say(f"  {cut} of {len(rows)} contexts are longer than the export's max_length of "
                f"{session.handoff.max_length} tokens: the ilcp sender reads their last tokens")
    by_method: dict[str, list[str]] = {}
    by_method_vllm: dict[str, list[str]] = {}
    parts = {m.name: (_part_path(cfg.out, spec.name, m.name) if cfg.out is not None else None,
                      _part_key(session, spec.name, m.name)) for m in session.methods}
    saved_parts = {name: _read_part(part, key) if cfg.resume and part is not None else None
                   for name, (part, key) in parts.items()}
    shared = [m for m in session.methods if m.shares_sender_states and saved_parts[m.name] is None]
    accuracy_done: dict[str, tuple] = {}
    if len(shared) > 1:  # every context's sender state built once for all of them
        say(f"  {len(shared)} methods share each context's sender state: their accuracy runs question chunk by "
            "question chunk, all of them on each chunk")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*longer than this export's max_length.*")
            done = _accuracy_shared(shared, rows, sender_states(shared[0].ctx), batch_size=cfg.batch_size,
                                    max_new_tokens=cfg.max_new_tokens, progress=cfg.progress,
                                    desc=f"{spec.name} {len(shared)} rclc/kv_relay rows accuracy", vllm=session.vllm,
                                    open_text=spec.open_answers)
        accuracy_done = {m.name: d for m, d in zip(shared, done)}
    for m in session.methods:
        part, key = parts[m.name]
        saved = saved_parts[m.name]
        if saved is not None:
            metrics, preds, vllm_preds = saved
            task_result["methods"][m.name], by_method[m.name] = metrics, preds
            if vllm_preds is not None:
                by_method_vllm[m.name] = vllm_preds
            say(f"  {m.name:>16}: exact match {_fmt(metrics['exact_match'], metrics['exact_match_ci'])} "
                f"(saved by an earlier evaluation, {part})")
            continue
        t0 = time.perf_counter()
        with warnings.catch_warnings():  # counted once above, not warned per context
            warnings.filterwarnings("ignore", message=".*longer than this export's max_length.*")
            if m.name in accuracy_done:
                metrics, preds, vllm_preds, accuracy_s = accuracy_done[m.name]
            else:
                metrics, preds, vllm_preds = _accuracy(m, rows, batch_size=cfg.batch_size,
                                                       max_new_tokens=cfg.max_new_tokens,
                                                       progress=cfg.progress, desc=f"{spec.name} {m.name} accuracy",
                                                       vllm=session.vllm, open_text=spec.open_answers)
                accuracy_s = time.perf_counter() - t0
            t1 = time.perf_counter()
            metrics["latency"] = _latency(m, rows[:cfg.latency_n], cfg.max_new_tokens, cfg.progress,
                                          f"{spec.name} {m.name} latency")
        metrics["seconds"] = {"accuracy": round(accuracy_s, 2), "latency": round(time.perf_counter() - t1, 2)}
        task_result["methods"][m.name] = metrics
        by_method[m.name] = preds
        if part is not None:  # one finished (task, method) survives a stopped evaluation
            atomic_write_json(part, {"key": key, "metrics": metrics, "predictions": preds,
                                     "vllm_predictions": vllm_preds})
        if vllm_preds is not None:
            by_method_vllm[m.name] = vllm_preds
        say(f"  {m.name:>16}: exact match {_fmt(metrics['exact_match'], metrics['exact_match_ci'])}, "
            f"contains {_fmt(metrics['contains'], metrics['contains_ci'])}, "
            f"{metrics['wire_bytes']:,.0f} B on the wire ({accuracy_s:.0f}s accuracy, "
            f"{metrics['seconds']['latency']:.0f}s latency)")
        if "vllm" in metrics:
            v = metrics["vllm"]
            say(f"  {'':>16}  " + (v["unavailable"] if "unavailable" in v else
                                   f"vLLM: exact match {_fmt(v['exact_match'], v['exact_match_ci'])}, agreement "
                                   f"with HF {_fmt(v['agreement'], None)} ({v['disagree']} of {v['n']} differ)"))
    return task_result, (rows, by_method, by_method_vllm)


def _part_path(out, task: str, method: str) -> Path:
    """Where one (task, method) result of an evaluation is saved: out/parts/TASK/METHOD.json."""
    def safe(name: str) -> str:
        return re.sub(r"[^A-Za-z0-9._+-]", "_", name)

    return Path(out) / "parts" / safe(task) / f"{safe(method)}.json"


def _part_key(session: EvalSession, task: str, method: str) -> dict:
    """Everything a saved (task, method) result depends on: the run's export (its config.json,
    weight digests included), the task, the method and the settings that change its numbers."""
    cfg = session.config
    return {"run": hashlib.sha256(json.dumps(session.run_config, sort_keys=True).encode()).hexdigest()[:16],
            "lm": session.lm.fingerprint, "task": task, "method": method, "limit": cfg.limit,
            "latency_n": cfg.latency_n, "batch_size": cfg.batch_size, "max_new_tokens": cfg.max_new_tokens,
            "payload_dtype": cfg.payload_dtype, "engine": cfg.engine, "precision": session.precision,
            "package": __version__}


def _read_part(path: Path, key: dict) -> tuple[dict, list[str], list[str] | None] | None:
    """A saved (task, method) result made with ``key``'s settings, else None."""
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(saved, dict) or saved.get("key") != key:
        return None
    return saved["metrics"], saved["predictions"], saved.get("vllm_predictions")


def engine_agreement(session: EvalSession, tasks: dict) -> dict | None:
    """With engine="vllm": the agreement of the vLLM and HF answers over every question of every
    method that ran on both (``tasks``: results["tasks"]); None otherwise."""
    if session.config.engine != "vllm":
        return None
    same = total = 0
    unavailable = {}
    for task, t in tasks.items():
        for name, m in t["methods"].items():
            v = m.get("vllm") or {}
            if "unavailable" in v:
                unavailable[f"{task} {name}"] = v["unavailable"]
            elif v:
                total += v["n"]
                same += v["n"] - v["disagree"]
    return {"questions": total, "agree": same, "agreement": same / total if total else None,
            "unavailable": unavailable}


def throughput_table(session: EvalSession) -> dict | None:
    """With ``throughput_batches``: the receiver's decode in questions per second of
    `THROUGHPUT_METHODS` at those batch sizes, on the first ``throughput_n`` questions of the first
    task, HF and (with the engine) vLLM; None without batches or without those methods."""
    cfg, say = session.config, session.say
    if not cfg.throughput_batches:
        return None
    spec = session.tasks[0]
    methods = session.methods_named(THROUGHPUT_METHODS)
    if not methods:
        return None
    rows = spec.eval_rows(cfg.throughput_n, session.task_context).rows
    say(f"receiver throughput on {spec.name}: {', '.join(m.name for m in methods)}, {len(rows)} "
        f"questions, batches {cfg.throughput_batches}" + (", HF and vLLM" if session.vllm is not None else ", HF"))
    return {"task": spec.name, **receiver_throughput(methods, rows, cfg.throughput_batches,
                                                     max_new_tokens=cfg.max_new_tokens, decoder=session.vllm,
                                                     log=say)}


def _fmt(point, ci) -> str:
    if point is None:
        return "-"
    return f"{100 * point:.1f}% [{100 * ci[0]:.1f}, {100 * ci[1]:.1f}]" if ci else f"{100 * point:.1f}%"


def context_length_sweep(session: EvalSession) -> dict | None:
    """Receiver time to first token of `LENGTH_METHODS` on facts contexts of about each of
    ``lengths`` tokens (``length_n`` requests each, contexts seeded by ``seed``); None without
    lengths or without those methods."""
    cfg, say = session.config, session.say
    methods = session.methods_named(LENGTH_METHODS)
    lengths, n, max_new_tokens = cfg.lengths, cfg.length_n, cfg.max_new_tokens
    if not methods or not lengths:
        return None
    say(f"context-length sweep: {', '.join(m.name for m in methods)} at {list(lengths)} tokens, {n} requests each")
    tokenizer = session.lm.tokenizer
    rows_out = []
    warmed = set()
    for target in lengths:
        settings = facts_for_length(target, tokenizer)
        rows = make_facts(n, split="test", seed=cfg.seed, **settings).to_list()
        tokens = sum(count_tokens(r["context"], tokenizer) for r in rows) / len(rows)
        for m in methods:
            if m.name not in warmed:
                time_request(m, rows[0], max_new_tokens=max_new_tokens)
                warmed.add(m.name)
            timed = [time_request(m, r, max_new_tokens=max_new_tokens)
                     for r in tqdm(rows, desc=f"length {target} {m.name}", disable=not cfg.progress, leave=False)]
            rows_out.append({
                "method": m.name, "target_tokens": target, "context_tokens": tokens, **settings,
                "prefill_positions": sum(t.prefill_positions for t in timed) / len(timed),
                "wire_bytes": sum(t.wire_bytes for t in timed) / len(timed),
                "sender_s": latency_summary([t.sender_s for t in timed]),
                "receiver_ttft_s": latency_summary([t.receiver_ttft_s for t in timed]),
                "handoff_s": latency_summary([t.handoff_s for t in timed]),
            })
        say(f"  ~{tokens:.0f} tokens: " + ", ".join(
            f"{r['method']} TTFT {1000 * r['receiver_ttft_s']['p50']:.0f} ms" for r in rows_out if r["target_tokens"] == target))
    return {"targets": list(lengths), "requests_per_point": n, "rows": rows_out,
            "ilcp_pooled_max_length": session.handoff.max_length if session.handoff is not None else None}


def facts_count_sweep(session: EvalSession) -> dict | None:
    """For a run trained on the facts task: accuracy of `FACTS_COUNT_METHODS` on facts contexts with
    each of ``facts_counts`` facts (the run's distractor count, ``facts_count_limit`` questions
    each); a run trained on training values only is asked held-out values, so the sweep measures
    reading. None for another run, without counts or without those methods."""
    cfg, say = session.config, session.say
    if session.run_config["task"] != "facts" or not cfg.facts_counts:
        return None
    methods = session.methods_named(FACTS_COUNT_METHODS)
    if not methods:
        return None
    counts, n, settings = cfg.facts_counts, cfg.facts_count_limit, session.facts_settings
    say(f"facts-count sweep: {', '.join(m.name for m in methods)} at {list(counts)} facts, {n} questions each")
    rows_out = []
    for count in counts:
        heldout = {"value_split": "heldout"} if settings.get("value_split") == "train" else {}
        rows = make_facts(n, n_facts=count, n_distractors=settings["n_distractors"], seed=settings["seed"],
                          split="test", **heldout).to_list()
        for m in methods:
            metrics, _, _ = _accuracy(m, rows, batch_size=cfg.batch_size, max_new_tokens=cfg.max_new_tokens,
                                      progress=cfg.progress, desc=f"{count} facts {m.name}")
            rows_out.append({"method": m.name, "n_facts": count, "n_distractors": settings["n_distractors"],
                             **{k: metrics[k] for k in ("n", "exact_match", "exact_match_ci", "contains", "contains_ci", "f1")}})
        say(f"  {count} facts: " + ", ".join(
            f"{r['method']} {100 * r['exact_match']:.0f}%" for r in rows_out if r["n_facts"] == count))
    return {"counts": list(counts), "questions_per_point": n, "rows": rows_out}


def _write_predictions(out: Path, predictions: dict) -> None:
    """predictions.jsonl: one line per task, method and question (for reading the answers)."""
    lines = []
    for task, (rows, by_method, by_method_vllm) in predictions.items():
        for method, preds in by_method.items():
            on_vllm = by_method_vllm.get(method)
            for i, (row, p) in enumerate(zip(rows, preds)):
                line = {"task": task, "method": method, "id": row["id"], "question": row["question"],
                        "answer": row["answer"], "prediction": p}
                if on_vllm is not None:
                    line["prediction_vllm"] = on_vllm[i]
                lines.append(json.dumps(line))
    atomic_write_text(out / "predictions.jsonl", "\n".join(lines) + ("\n" if lines else ""))
