"""The sections of the training configuration, one dataclass each: `LMConfig` (``lm``),
`DataConfig` (``data``), `CompressorConfig` (``compressor``), `HandoffConfig` (``handoff``),
`ReconstructConfig` (``reconstruct``) and `TrainerConfig` (``trainer``), with the names their
fields take (training variants, distillation teachers, accelerators).

Every field carries its help text (``field(metadata={"help": ...})``), and `__post_init__` checks
its section; `ilcp.config.TrainConfig` holds them all and checks their combinations.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

from .encoder.kinds import AttentionMemory, MemoryKind
from .settings import MAX_LR, MAX_WEIGHT, check_declared, setting
from .names import (DEFAULT_LM, DEFAULT_SELECTOR, MEMORY_KINDS, MEMORY_PLACEMENTS, PRECISIONS, SELECTORS, SNAP_METRICS,
                    VOCABULARY_SNAPS)

VARIANTS = ("ilcp", "prompt_tuned", "cold_read_tuned", "selection_tuned")
DEFAULT_VARIANTS = ("ilcp", "prompt_tuned", "cold_read_tuned")  # selection_tuned is trained when asked for


_f = setting  # every field is a declared setting: type, default, help, bounds (`ilcp.settings`)


@dataclass
class LMConfig:
    spec: str = _f(DEFAULT_LM, "LM to load: 'smollm2-135m-instruct', 'tiny-qwen3', a local HF directory or a hub id")
    dtype: str = _f("float32", "parameter dtype of the frozen LM: float32, bfloat16 or float16")
    cache_dir: str | None = _f(None, "where converted models and pooled states are cached (default $ILCP_CACHE or ~/.cache/ilcp)")

    def __post_init__(self):
        check_declared(self, "lm.{}".format)  # types, ranges and choices as declared
        if self.dtype not in {"float32", "bfloat16", "float16"}:
            raise ValueError(f"lm.dtype must be float32, bfloat16 or float16, got {self.dtype!r}")


@dataclass
class DataConfig:
    task: str = _f("babi:1", "training task: 'babi:N', a balanced mix 'babi:1+2' or 'babi:all', 'facts', "
                             "'babilong:N:LENGTH' (bAbI task N spread through background prose to LENGTH tokens of the "
                             "LM: 0, 0.5k, 1k, 2k, 4k or a number), 'squad' (the shipped SQuAD subset), or a file of "
                             "your own: 'jsonl:PATH', 'csv:PATH', 'parquet:PATH', 'disk:PATH' (datasets' save_to_disk), "
                             "'jsonl:train=A,test=B' (columns context, question, answer, optional id), or a mix of any of "
                             "these 'mix:squad|babi:all' (the same number of rows from each single task)")
    babi_variant: str = _f("en-10k", "bAbI folder for the training task: 'en' (1k) or 'en-10k'")
    train_size: int = _f(1500, "training rows used (the first N after the story-level split)", minimum=1)
    val_size: int = _f(256, "validation rows for the teacher-forced loss", minimum=1)
    val_decode_size: int = _f(256, "validation rows decoded greedily for exact match (a fixed subset)", minimum=1)
    facts_n_facts: int = _f(4, "facts task: facts stated in each context", minimum=1)
    facts_n_distractors: int = _f(0, "facts task: distractor sentences in each context", minimum=0)
    facts_value_split: str | None = _f(None, "facts task: 'train' draws every value from the training side of the "
                                             "value partition, so eval's facts-heldout split asks only unseen values "
                                             "(null: the original generator)")
    max_length: int = _f(0, "context tokens the sender reads (0 = the LM's own limit, its max_position_embeddings; "
                            "a longer context keeps its last tokens, the export records the limit and eval reports "
                            "the contexts cut)", minimum=0)
    pool_layers: list = _f([-1], "hidden-state layers mean-pooled and concatenated (-1 = last)")
    pool_batch_size: int = _f(16, "contexts per forward of sender-state extraction", minimum=1)
    pool_batch_tokens: int = _f(16384, "at most this many padded positions per extraction forward (long contexts "
                                       "go a few, or one, at a time)", minimum=1)
    cache_dtype: str = _f("auto", "dtype the sender states are cached in: auto (bfloat16 when the run computes in "
                                  "bfloat16, else float32), float32 or bfloat16; part of the cache key")
    seed: int = _f(0, "seed of the validation split and of procedural tasks")
    columns: dict = _f({}, "file tasks: the file's column for each standard name, e.g. {context: passage, answer: "
                           "gold} (data.columns.context=passage); unmapped names are read as they are")
    validation_fraction: float = _f(0.1, "file tasks without their own splits: the share of distinct contexts "
                                         "carved out for validation", minimum=0, below=1)
    test_fraction: float = _f(0.1, "file tasks without their own splits: the share of distinct contexts carved "
                                   "out for test (eval's split)", minimum=0, below=1)
    allow_split_overlap: bool = _f(False, "file tasks with their own splits: accept test or validation rows whose "
                                          "contexts are in train (or the same file for two splits); eval's report "
                                          "then says so")
    heldout_tasks: list = _f([], "single tasks of data.task (a mix) kept out of every training stage (pretraining "
                                 "texts included); the export records them and eval reports them as held out, e.g. "
                                 "[babi:2, babi:3, babi:19]")

    def __post_init__(self):
        check_declared(self, "data.{}".format)  # types, ranges and choices as declared
        from .names import unknown_task  # the standard library only

        problem = unknown_task(self.task)
        if problem is not None:
            raise ValueError(f"data.task: {problem}")
        if self.task.startswith("babilong"):
            from .names import parse_babilong_name  # the standard library only

            try:
                parse_babilong_name(self.task)
            except ValueError as e:
                raise ValueError(f"data.task: {e}") from None
        if self.task.strip() == "facts-heldout":
            raise ValueError("data.task: 'facts-heldout' is an evaluation split (values never seen in training); "
                             "train on 'facts' with data.facts_value_split=train")
        if not isinstance(self.heldout_tasks, list) or not all(isinstance(t, str) for t in self.heldout_tasks):
            raise ValueError(f"data.heldout_tasks must be a list of task names, got {self.heldout_tasks!r}")
        for name in self.heldout_tasks:
            if unknown_task(name) is not None:
                raise ValueError(f"data.heldout_tasks: {unknown_task(name)}")
        if not isinstance(self.columns, dict) or not all(
                isinstance(k, str) and isinstance(v, str) and v.strip() for k, v in self.columns.items()):
            raise ValueError(f"data.columns must map names to column names, got {self.columns!r}")
        unknown = sorted(set(self.columns) - {"context", "question", "answer", "id"})
        if unknown:
            raise ValueError(f"data.columns: unknown key(s) {', '.join(unknown)}; map context, question, answer or id")
        if self.validation_fraction + self.test_fraction >= 1:
            raise ValueError("data.validation_fraction + data.test_fraction must be below 1")
        if self.babi_variant not in {"en", "en-10k"}:
            raise ValueError(f"data.babi_variant must be 'en' or 'en-10k', got {self.babi_variant!r}")
        if self.cache_dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"data.cache_dtype must be auto, float32 or bfloat16, got {self.cache_dtype!r}")
        if self.facts_value_split not in (None, "train"):
            raise ValueError(f"data.facts_value_split must be null or 'train', got {self.facts_value_split!r}")
        if not self.pool_layers or not all(isinstance(i, int) for i in self.pool_layers):
            raise ValueError(f"data.pool_layers must be a non-empty list of ints, got {self.pool_layers!r}")


@dataclass
class CompressorConfig:
    latent_dim: int = _f(32, "latent width: the payload is latent_dim floats (32 x float32 = 128 bytes)", minimum=1)
    hidden_dim: int = _f(512, "width of the VAE body and decoder", minimum=1)
    beta: float = _f(0.1, "weight of the KL term", minimum=0, maximum=MAX_WEIGHT)
    kl_warmup_steps: int = _f(200, "steps over which the KL weight ramps from 0 to beta (0 = none)", minimum=0)
    epochs: int = _f(30, "stage-1 epochs over the training pooled states", minimum=1)
    batch_size: int = _f(128, "stage-1 batch size", minimum=1)
    lr: float = _f(1e-3, "stage-1 AdamW learning rate", above=0, maximum=MAX_LR)
    memory: MemoryKind = _f(AttentionMemory(pool_queries=4), "the memory kind (" + ", ".join(MEMORY_KINDS) + "), "
                            "then that kind's own settings, compressor.memory.SETTING (`ilcp.encoder.kinds`)")
    answer_head_weight: float = _f(1.0, "stage 1 adds this weight x the cross-entropy of a small answer head reading "
                                  "[z ; question]: answers shape the latent without the LM (0 = the spec)",
                                   minimum=0, maximum=MAX_WEIGHT)
    story_attention_weight: float = _f(0.0, "BABILong training only: stage 1 adds this weight x the cross-entropy of each "
                                       "attention query against the uniform distribution over the story's tokens "
                                       "(known from the construction), teaching the pooler to find the story in the "
                                       "prose; the sender is never told where it is (0 = off)",
                                       minimum=0, maximum=MAX_WEIGHT)
    pooler_lr: float = _f(0.0, "stage-1 learning rate of the attention pooler (0 = compressor.lr)",
                          minimum=0, maximum=MAX_LR)
    init_from: str = _f("", "start the encoder (projector included) from a pretrained encoder or a run's export "
                            "folder instead of stage 1; its LM fingerprint and digests are checked, and its "
                            "settings must be this run's")

    def __post_init__(self):
        check_declared(self, "compressor.{}".format)  # types, ranges and choices as declared
        if not isinstance(self.memory, MemoryKind):
            raise ValueError(f"compressor.memory must be the settings of a memory kind, got {self.memory!r}")
        if self.answer_head_weight > 0 and not self.memory.one_latent_per_context:
            raise ValueError(f"compressor.answer_head_weight > 0 reads one latent per context; memory kind "
                             f"{self.memory.kind!r} with these settings sends several: set "
                             "compressor.answer_head_weight=0")
        if self.story_attention_weight > 0 and not self.memory.attention_queries:
            raise ValueError("compressor.story_attention_weight > 0 teaches learned queries over the whole context: "
                             "it needs compressor.memory.kind=attention without chunks")


# the readers of the text a distillation teacher can be (the plain LM, or behind this run's tuned vectors)
DISTILL_TEACHERS = ("cold_read", "cold_read_tuned")


@dataclass
class HandoffConfig:
    variants: list = _f(list(DEFAULT_VARIANTS), "what stage 2 trains: any of ilcp, prompt_tuned, cold_read_tuned, "
                                                "selection_tuned (K vectors before an RCLC selection of the context)")
    num_memory_tokens: int = _f(8, "K, soft-prompt vectors in front of the receiver's prompt", minimum=1)
    projector_hidden: int = _f(512, "width of the projector's trunk", minimum=1)
    finetune_encoder: bool = _f(True, "let the answer loss reach the VAE encoder (False = the spec's frozen encoder)")
    distill_weight: float = _f(0.0, "ilcp: weight of a distillation term, KL(teacher || receiver) over the answer "
                                    "tokens, the teacher being the frozen LM reading the context text (0 = none)",
                               minimum=0, maximum=MAX_WEIGHT)
    distill_temperature: float = _f(1.0, "temperature of both distributions in the distillation term",
                                    above=0, maximum=MAX_WEIGHT)
    distill_teacher: str = _f("cold_read", "the distillation teacher: 'cold_read' (the frozen LM reading the text) or "
                                           "'cold_read_tuned' (reading it behind this run's cold_read_tuned vectors, "
                                           "trained first)")
    joint_kl_weight: float = _f(0.0, "with finetune_encoder, weight of the KL term added to the answer loss",
                                minimum=0, maximum=MAX_WEIGHT)
    max_steps: int = _f(120, "optimizer steps per variant (the same budget for all variants); 0 with variants [ilcp] "
                             "and reconstruct.steps > 0: no answer stage, the encoder is exported as pretrained")
    cold_read_tuned_steps: int = _f(0, "steps of cold_read_tuned alone, the text baseline and format_from's source "
                                       "(0 = handoff.max_steps, the budget of every variant)", minimum=0)
    batch_size: int = _f(8, "stage-2 batch size", minimum=1)
    lr: float = _f(3e-3, "stage-2 AdamW learning rate of the projector / soft prompt", above=0, maximum=MAX_LR)
    encoder_lr: float = _f(3e-4, "stage-2 learning rate of the encoder when finetune_encoder is on",
                           above=0, maximum=MAX_LR)
    weight_decay: float = _f(0.0, "stage-2 AdamW weight decay", minimum=0, maximum=MAX_WEIGHT)
    warmup_steps: int = _f(10, "linear learning-rate warm-up steps", minimum=0)
    val_every_steps: int = _f(60, "validate (loss + greedy exact match) every N steps and at the end", minimum=1)
    max_new_tokens: int = _f(6, "greedy tokens decoded for validation exact match", minimum=1)
    validate_start: bool = _f(False, "validate before the first step too, and keep the starting weights when no "
                                     "step beats them (for a source that may start well: format_from with "
                                     "vocabulary_snap)")
    format_vectors: int = _f(0, "ilcp with memory_placement=in_prompt: learned vectors before the whole prompt, "
                                "as cold_read_tuned's (0 = none)", minimum=0)
    memory_placement: str = _f("prefix", "ilcp: where the receiver reads the memory vectors: 'prefix' (before the "
                                         "question prompt, the spec) or 'in_prompt' (where the context text stands "
                                         "in the cold-read prompt; for a token codec)")
    vocabulary_snap: str = _f("none", "ilcp: 'soft' reads each memory vector as a softmax mixture of the LM's token "
                                      "embeddings (cosine at snap_temperature), 'hard' as the closest one "
                                      "(straight-through gradient); 'none' reads the projected vectors")
    snap_temperature: float = _f(0.02, "ilcp: the temperature of vocabulary_snap's softmax",
                                 above=0, maximum=MAX_WEIGHT)
    snap_metric: str = _f("cosine", "ilcp: how vocabulary_snap scores a row: 'cosine' or 'dot' (the inner product, "
                                    "for a codec trained with reconstruct.token_logits=dot; set snap_temperature=1)")
    format_from: str = _f("", "ilcp with memory_placement=in_prompt: cold_read_tuned's trained vectors (frozen) "
                              "before the whole prompt: 'cold_read_tuned' trains them first in the same run; a "
                              "path reads them from another run's export, for the same LM ('' = none)")
    selection_selector: str = _f(DEFAULT_SELECTOR, "selection_tuned: the RCLC selector whose rows replace the context "
                                                   f"text ({', '.join(SELECTORS)})")
    selection_ratio: int = _f(4, "selection_tuned: the relative budget r<N> of that selection (ceil(T / N) rows)",
                              minimum=1)

    def __post_init__(self):
        check_declared(self, "handoff.{}".format)  # types, ranges and choices as declared
        if self.selection_selector not in SELECTORS:
            raise ValueError(f"handoff.selection_selector must be one of {list(SELECTORS)}, "
                             f"got {self.selection_selector!r}")
        unknown = [v for v in self.variants if v not in VARIANTS]
        if unknown or not self.variants:
            raise ValueError(f"handoff.variants must be a non-empty subset of {list(VARIANTS)}, got {self.variants!r}")
        if self.max_steps < 0 or (self.max_steps == 0 and self.variants != ["ilcp"]):
            raise ValueError(f"handoff.max_steps must be >= 1 (0 only with handoff.variants=[ilcp]: a pretraining run "
                             f"that exports its encoder as the reconstruction stage left it), got {self.max_steps} "
                             f"with variants {self.variants}")
        if self.cold_read_tuned_steps and "cold_read_tuned" not in self.variants:
            raise ValueError("handoff.cold_read_tuned_steps sets the budget of cold_read_tuned: add it to "
                             "handoff.variants, or leave the setting at 0")
        if self.format_vectors < 0 or (self.format_vectors and self.memory_placement == "prefix"):
            raise ValueError("handoff.format_vectors must be >= 0, and needs handoff.memory_placement=in_prompt "
                             "(with prefix memory the memory vectors are already in front)")
        if self.memory_placement not in MEMORY_PLACEMENTS:
            raise ValueError(f"handoff.memory_placement must be one of {list(MEMORY_PLACEMENTS)}, "
                             f"got {self.memory_placement!r}")
        if self.vocabulary_snap not in VOCABULARY_SNAPS or not self.snap_temperature > 0:
            raise ValueError(f"handoff.vocabulary_snap must be one of {list(VOCABULARY_SNAPS)} and "
                             f"handoff.snap_temperature > 0, got {self.vocabulary_snap!r}, {self.snap_temperature!r}")
        if self.snap_metric not in SNAP_METRICS:
            raise ValueError(f"handoff.snap_metric must be one of {list(SNAP_METRICS)}, got {self.snap_metric!r}")
        if not isinstance(self.format_from, str):
            raise ValueError(f"handoff.format_from must be '', 'cold_read_tuned' or a run directory, "
                             f"got {self.format_from!r}")
        if self.format_from and (self.memory_placement == "prefix" or self.format_vectors or "ilcp" not in self.variants):
            raise ValueError("handoff.format_from needs handoff.memory_placement=in_prompt, handoff.format_vectors=0 "
                             "and ilcp among handoff.variants")
        if self.format_from == "cold_read_tuned" and "cold_read_tuned" not in self.variants:
            raise ValueError("handoff.format_from=cold_read_tuned trains cold_read_tuned first: add it to "
                             "handoff.variants, or name another run's directory")
        if self.distill_teacher not in DISTILL_TEACHERS:
            raise ValueError(f"handoff.distill_teacher must be one of {list(DISTILL_TEACHERS)}, got "
                             f"{self.distill_teacher!r}")
        if self.distill_teacher == "cold_read_tuned" and "cold_read_tuned" not in self.variants:
            raise ValueError("handoff.distill_teacher=cold_read_tuned trains cold_read_tuned first: add it to "
                             "handoff.variants")


@dataclass
class ReconstructConfig:
    steps: int = _f(0, "reconstruction-stage steps between stage 1 and the answer stage: the frozen LM regenerates "
                       "each training context from the K memory vectors alone (0 = no such stage)", minimum=0)
    batch_size: int = _f(8, "reconstruction-stage batch size (distinct training contexts)", minimum=1)
    lr: float = _f(1e-3, "reconstruction-stage learning rate of the projector", above=0, maximum=MAX_LR)
    encoder_lr: float = _f(1e-3, "reconstruction-stage learning rate of the pooler and VAE", above=0, maximum=MAX_LR)
    warmup_steps: int = _f(10, "linear learning-rate warm-up steps", minimum=0)
    val_every_steps: int = _f(50, "validate (teacher-forced loss) every N steps and at the end", minimum=1)
    max_target_tokens: int = _f(128, "context tokens regenerated (a longer context keeps its first tokens)", minimum=1)
    token_steps: int = _f(0, "steps of the token loss alone, before the reconstruction steps: no LM forward, so "
                             "cheap (needs compressor.chunk_tokens = handoff.num_memory_tokens)", minimum=0)
    token_weight: float = _f(0.0, "weight of the token loss added to the reconstruction loss: memory vector j of a "
                                  "chunk should read as the chunk's j-th token (0 = none)",
                             minimum=0, maximum=MAX_WEIGHT)
    token_candidates: int = _f(4096, "token loss: vocabulary rows sampled as negatives at each step", minimum=1)
    token_shape_weight: float = _f(1.0, "token loss: weight of the cosine and norm terms that keep each vector at its "
                                        "token's direction and scale (a snapped codec, handoff.vocabulary_snap, "
                                        "needs only the cross-entropy's ranking)", minimum=0, maximum=MAX_WEIGHT)
    token_logits: str = _f("cosine", "token loss: the cross-entropy's scores, 'cosine' (at the fixed temperature "
                                     "0.05) or 'dot' (inner products with the embedding rows; read it with "
                                     "handoff.snap_metric=dot)")
    random_texts: int = _f(0, "token-loss steps: texts of random whole-word tokens drawn fresh at each step besides "
                              "the batch's task contexts (no token of a held-out facts value is drawn; 0 = none)",
                           minimum=0)
    random_words: int = _f(12, "whole-word tokens per random text", minimum=1)
    texts: list = _f(["task"], "what the stage reads: 'task' (the training contexts), 'prose' (passages of the "
                               "background books), or task names whose contexts it reads (squad, babi:all, jsonl:PATH, "
                               "...), each split as the task splits it; besides 'task' needs a memory kind that "
                               "reads the sender's LM (compressor.memory.kind=slots)")
    texts_per_source: int = _f(2000, "the most training texts read from each source besides 'task' (validation: a tenth)",
                               minimum=1)
    continuation: float = _f(0.0, "share of texts read as a continuation: the memory of a text's first half, the receiver "
                                  "goes on with the second (0 = reconstruction only; needs a memory kind that reads "
                                  "the sender's LM, compressor.memory.kind=slots)",
                             minimum=0, maximum=1)
    patience: int = _f(0, "stop after this many validations without a lower validation loss (0 = run every step)",
                       minimum=0)
    beta: float = _f(0.0, "weight of the memory latents' KL term in the reconstruction loss; above 0 the training "
                          "memory is read from latents drawn from their posterior, a noisy channel (its mean still "
                          "crosses in eval and the export; 0 = the mean and no KL term)", minimum=0, maximum=MAX_WEIGHT)
    text_tokens: int = _f(0, "cut every text the stage reads into consecutive windows of this many tokens, each its "
                             "own text (a last window under half of it dropped): every slot's memory is then one the "
                             "loss reads (0 = whole texts; needs a memory kind that reads the sender's LM, "
                             "compressor.memory.kind=slots)",
                          minimum=0)

    @property
    def enabled(self) -> bool:
        """Whether the stage runs."""
        return self.steps + self.token_steps > 0

    def __post_init__(self):
        check_declared(self, "reconstruct.{}".format)  # types, ranges and choices as declared
        if self.token_logits not in SNAP_METRICS:
            raise ValueError(f"reconstruct.token_logits must be one of {list(SNAP_METRICS)}, got {self.token_logits!r}")
        if not isinstance(self.texts, list) or not self.texts or not all(isinstance(t, str) and t for t in self.texts):
            raise ValueError(f"reconstruct.texts must be a non-empty list of names, got {self.texts!r}")
        from .names import unknown_task  # the standard library only

        for name in self.texts:
            problem = None if name in ("task", "prose") else unknown_task(name)
            if problem:
                raise ValueError(f"reconstruct.texts: {problem} (or 'task', 'prose')")
        if self.texts_per_source < 1 or self.patience < 0 or not 0 <= self.continuation <= 1:
            raise ValueError("reconstruct.texts_per_source must be >= 1, reconstruct.patience >= 0 and "
                             f"reconstruct.continuation in [0, 1], got {self.texts_per_source}, {self.patience}, "
                             f"{self.continuation}")


ACCELERATORS = ("auto", "cpu", "gpu", "cuda", "mps", "tpu")


def _valid_devices(devices) -> bool:
    """Lightning's forms of ``devices``: 'auto', an int >= 1 or -1, a non-empty list of indices
    >= 0, or a string of an int or of comma-separated indices."""
    def index(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    if isinstance(devices, bool):
        return False
    if isinstance(devices, int):
        return devices >= 1 or devices == -1
    if isinstance(devices, list):
        return bool(devices) and all(index(d) for d in devices)
    if isinstance(devices, str):
        text = devices.strip()
        if text == "auto":
            return True
        parts = [p.strip() for p in text.split(",") if p.strip()]
        try:
            numbers = [int(p) for p in parts]
        except ValueError:
            return False
        return bool(numbers) and (all(n >= 0 for n in numbers) if "," in text else numbers[0] >= 1 or numbers[0] == -1)
    return False


@dataclass
class TrainerConfig:
    accelerator: str = _f("auto", "Lightning accelerator: auto, cpu, gpu (= cuda), mps, tpu (with torch_xla)")
    devices: Any = _f(1, "Lightning devices (an int, a list, or 'auto'); with more than one, the batch sizes are "
                         "global (each device takes batch_size / devices rows a step)")
    num_nodes: int = _f(1, "Lightning num_nodes", minimum=1)
    strategy: str = _f("auto", "Lightning strategy: auto, ddp, fsdp, ... (ranks start as processes that re-run the "
                               "command: spawn and fork strategies are refused)")
    precision: str = _f("auto", "compute precision of every forward through the LM, in training, state "
                                "extraction, evaluation and ILCPHandoff: 32-true, bf16-mixed (bfloat16 autocast; "
                                "weights, exports and payloads stay float32) or auto (bf16-mixed where the CPU or "
                                "GPU computes bfloat16 natively and the LM's weights are float32, else 32-true)")
    seed: int = _f(0, "global seed for initialisation and batch order")
    progress: bool = _f(True, "show progress bars")
    recompute_layers: bool = _f(False, "stages through the LM keep each layer's input alone and recompute its "
                                       "activations in the backward pass: far less memory, about a third more "
                                       "compute a step (ilcp.training.recompute)")
    length_groups: bool = _f(True, "a training batch's rows run as one forward per group of similar lengths "
                                   "(ilcp.encoder.pooling.length_groups: less padding, far faster on batches of mixed "
                                   "lengths); false: one padded forward per batch, the memory pretraining's route "
                                   "(it pretrains better that way: docs/results/length-groups-training)")

    def __post_init__(self):
        check_declared(self, "trainer.{}".format)  # types, ranges and choices as declared
        if self.accelerator not in ACCELERATORS:
            raise ValueError(f"trainer.accelerator must be one of {', '.join(ACCELERATORS)}, got {self.accelerator!r}")
        if self.accelerator == "tpu" and importlib.util.find_spec("torch_xla") is None:
            raise ValueError("trainer.accelerator=tpu needs torch_xla, which is not installed here: use "
                             "trainer.accelerator=cpu, gpu or auto")
        if not _valid_devices(self.devices):
            raise ValueError(f"trainer.devices must be 'auto', an int >= 1 (or -1: all), a list of device indices "
                             f"or a string of them such as '0,1'; got {self.devices!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"trainer.precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if any(word in str(self.strategy) for word in ("spawn", "fork", "notebook")):
            raise ValueError(f"trainer.strategy={self.strategy!r} is not supported: the ranks of a run start as "
                             "processes that re-run the training command; use ddp (or fsdp)")
