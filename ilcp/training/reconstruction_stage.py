"""The reconstruction stage: the frozen LM learns nothing; the ILCP encoder learns to make it say
the context back.

From the K memory vectors alone, followed by a fixed instruction
(`ilcp.receiver.prompts.reconstruction_prompt`), the frozen LM is trained, teacher-forced, to regenerate
the sender's context text; the cross-entropy over the context tokens trains the pooler, the
beta-VAE encoder and the projector end to end. It needs no labels, so it runs on every distinct
training context before the answer stage (``reconstruct.steps > 0``), the way ICAE,
500xCompressor and xRAG pretrain their compressors before any question is asked.

A token codec (chunks of C tokens, K = C memory vectors per chunk) can also learn from a token
loss: memory vector j of a chunk should read as the chunk's j-th token. Its first
``reconstruct.token_steps`` steps use that loss alone, with no LM forward, on the task's contexts
plus ``reconstruct.random_texts`` texts of random whole-word tokens drawn fresh at every step;
``reconstruct.token_weight`` adds it to the later reconstruction steps.
"""

from __future__ import annotations

import hashlib
import json

import lightning as L
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import Tensor

from .. import export
from ..receiver import prompts
from ..names import is_babilong_name, parse_babilong_name
from ..tasks.background import background_sentences
from ..tasks import resolve_task
from ..receiver.prefix import receiver_prefix
from ..config import TrainConfig
from ..encoder.model import ILCPEncoder
from ..lm import LM
from ..encoder.pooling import sender_token_states, tokenize_contexts
from .data import HandoffDataModule, HandoffRows, heldout_values, sender_max_length, word_tokens
from .distributed import save_stage
from .handoff_stage import HandoffModule, attach_projector, fit_stage
from .log import parameter_counts, say
from .losses import LossTerm, reconstruction_terms, weighted_sum

STAGE = "reconstruct"
TOKEN_TEMPERATURE = 0.05  # of the token loss's cosine cross-entropy


def distinct_contexts(rows: HandoffRows) -> HandoffRows:
    """One row per distinct context, in first-seen order, with empty question and answer."""
    first: dict[str, int] = {}
    for i, r in enumerate(rows.rows):
        first.setdefault(r["context"], i)
    keep = list(first.values())
    if rows.states is None:
        states = None
    elif rows.has_token_states:
        states = rows.states.take(keep)  # the same (memory-mapped) storage
    else:
        states = rows.states[keep]
    return HandoffRows([{"context": rows.rows[i]["context"], "question": "", "answer": ""} for i in keep], states)


def pretraining_rows(cfg: TrainConfig, lm: LM, rows: HandoffRows, split: str) -> HandoffRows:
    """The texts the stage reads from a split (``reconstruct.texts``), one row each, distinct, in
    source order: the training rows' contexts ('task'), passages of the background books
    ('prose', about ``reconstruct.max_target_tokens`` tokens each) and the contexts of other
    tasks, split as each task splits; at most ``reconstruct.texts_per_source`` from each source
    but 'task' (a tenth of that for validation). With ``reconstruct.text_tokens`` each text is cut
    into windows of that many tokens (`text_windows`). Only 'task' rows read whole carry sender
    states."""
    r = cfg.reconstruct
    if r.texts == ["task"]:
        rows = distinct_contexts(rows)
        if not r.text_tokens:
            return rows
        windows = text_windows(lm.tokenizer, [row["context"] for row in rows.rows], r.text_tokens)
        say(f"reconstruction: {len(windows)} distinct {split} texts (windows of {r.text_tokens} tokens) "
            f"from {len(rows.rows)} task contexts")
        return HandoffRows([{"context": t, "question": "", "answer": ""} for t in windows], None)
    limit = r.texts_per_source if split == "train" else max(1, r.texts_per_source // 10)
    texts: list[str] = []
    for name in r.texts:
        if name == "task":
            texts += [row["context"] for row in rows.rows]
        elif name == "prose":
            texts += prose_passages(lm.tokenizer, split, r.max_target_tokens)[:limit]
        else:
            task = resolve_task(name)
            max_tokens = lm.context_limit if sender_max_length(cfg, lm) >= lm.context_limit else None
            kwargs = task.training_kwargs(cfg.data, limit, lm.tokenizer, max_tokens)
            texts += list(dict.fromkeys(task.load(split, **kwargs)["context"]))[:limit]
    unique = list(dict.fromkeys(t for t in texts if t.strip()))
    if r.text_tokens:
        unique = text_windows(lm.tokenizer, unique, r.text_tokens)
    windows = f" (windows of {r.text_tokens} tokens)" if r.text_tokens else ""
    say(f"reconstruction: {len(unique)} distinct {split} texts{windows} from {', '.join(r.texts)}")
    return HandoffRows([{"context": t, "question": "", "answer": ""} for t in unique], None)


def text_windows(tokenizer, texts: list[str], tokens: int) -> list[str]:
    """Each text cut into consecutive windows of `tokens` tokens, decoded back to text, distinct,
    in order; a text's last window shorter than half of `tokens` is dropped unless it is the whole
    text."""
    out: list[str] = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        for start in range(0, len(ids), tokens):
            window = ids[start:start + tokens]
            if start == 0 or 2 * len(window) >= tokens:
                out.append(tokenizer.decode(window).strip())
    return list(dict.fromkeys(t for t in out if t))


def check_pretraining_texts(cfg: TrainConfig) -> None:
    """Refuse (one line) a ``reconstruct.texts`` task that holds a task ``data.heldout_tasks`` keeps out."""
    if not cfg.reconstruct.enabled or not cfg.data.heldout_tasks:
        return
    held = {_stories_of(resolve_task(name).name): resolve_task(name).name for name in cfg.data.heldout_tasks}
    for name in cfg.reconstruct.texts:
        if name in ("task", "prose"):
            continue
        leaked = sorted(held[key] for key in {_stories_of(p.name) for p in resolve_task(name).parts()} if key in held)
        if leaked:
            raise ValueError(f"reconstruct.texts: {name!r} holds {', '.join(leaked)}, which data.heldout_tasks keeps "
                             "out of every stage")


def _stories_of(name: str) -> str:
    """What a single task's contexts are built from: a BABILong task's bAbI task (``babilong:2:1k``
    holds the stories of ``babi:2``), any other task itself."""
    if is_babilong_name(name):
        return f"babi:{parse_babilong_name(name).number}"
    return name


def prose_passages(tokenizer, split: str, tokens: int) -> list[str]:
    """The background books' sentences of a split, joined in book order into passages of about
    ``tokens`` tokens (a passage never spans two books)."""
    passages, current, count, source = [], [], 0, None
    for sentence in background_sentences(split):
        n = len(tokenizer(sentence.text, add_special_tokens=False)["input_ids"]) + 1
        if current and (count + n > tokens or sentence.source != source):
            passages.append(" ".join(current))
            current, count = [], 0
        current.append(sentence.text)
        count, source = count + n, sentence.source
    if current:
        passages.append(" ".join(current))
    return passages


def reads_as_continuation(text: str, share: float) -> bool:
    """Whether a text is read as a continuation (a fixed choice per text: sha256 of its content
    against ``share``), so that validation asks the same of it at every step."""
    if share <= 0:
        return False
    digest = int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:4], "big")
    return digest / 2**32 < share


class ReconstructionModule(HandoffModule):
    """[K memory vectors ; reconstruction instruction ; context + end token], labels on the context.

    Args:
        encoder: the ILCP encoder with its projector.
        lm: the frozen LM.
        cfg: the run's config (``reconstruct`` section; ``handoff`` for the shared settings).
    """

    def __init__(self, encoder: ILCPEncoder, lm: LM, cfg: TrainConfig):
        super().__init__(encoder, lm, cfg.handoff, val_decode_size=0, recompute_layers=cfg.trainer.recompute_layers,
                         grouped=cfg.trainer.length_groups)
        self.reconstruct_cfg = cfg.reconstruct
        self.max_target_tokens = cfg.reconstruct.max_target_tokens
        self.max_context_tokens = sender_max_length(cfg, lm)
        self.prompt_ids = lm.tokenizer(prompts.reconstruction_prompt(lm.tokenizer), add_special_tokens=False)["input_ids"]
        self.continuation = cfg.reconstruct.continuation
        self.continuation_ids = lm.tokenizer(prompts.continuation_prompt(lm.tokenizer),
                                             add_special_tokens=False)["input_ids"]
        self.token_loss = cfg.reconstruct.token_weight > 0 or cfg.reconstruct.token_steps > 0
        self.pool_layers, self.seed, self.word_pool = tuple(cfg.data.pool_layers), cfg.trainer.seed, None
        if not encoder.encoder_frozen:  # the KL term, when the loss has one, trains the posterior's spread
            encoder.vae.logvar_head.requires_grad_(self.kl_in_loss())
        if self.token_loss and not (encoder.chunked and encoder.num_memory_tokens == encoder.chunk_tokens):
            raise ValueError("the token loss reads memory vector j of a chunk as its j-th token: it needs "
                             "compressor.memory.chunk_tokens > 0 and handoff.num_memory_tokens equal to it")

    def _random_texts(self) -> tuple[list[Tensor], list[list[int]]]:
        """(memory, token ids) of ``reconstruct.random_texts`` texts of random whole-word tokens,
        drawn fresh for this step (seeded by the step) and read by the sender as any context."""
        r = self.reconstruct_cfg
        if self.word_pool is None:
            self.word_pool = torch.tensor(word_tokens(self.tokenizer, heldout_values()))
            if len(self.word_pool) < 16:
                raise ValueError(f"the tokenizer has {len(self.word_pool)} whole-word tokens; random texts need 16")
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.global_step)
        ids = self.word_pool[torch.randint(0, len(self.word_pool), (r.random_texts, r.random_words), generator=g)]
        ids = ids.to(self.lm.get_input_embeddings().weight.device)
        with torch.no_grad():
            states = sender_token_states(self.lm, ids, torch.ones_like(ids), self.pool_layers)
        memory, _ = self.memory({"tokens": states, "token_mask": torch.ones_like(ids)})
        return list(memory), ids.tolist()

    def memory(self, batch: dict) -> tuple[Tensor | list[Tensor], Tensor]:
        """(memory in the LM's dtype, mean KL) of a batch: in training with ``reconstruct.beta`` > 0
        from latents drawn from the posterior, else from its mean (what crosses)."""
        sample = self.training and self.kl_in_loss()
        return self.source.memory_for_batch(batch, self.lm.get_input_embeddings().weight.dtype, sample=sample)

    def token_only(self) -> bool:
        """Whether this training step is one of the first ``token_steps`` (token loss alone)."""
        return self.training and self.global_step < self.reconstruct_cfg.token_steps

    def context_token_ids(self, contexts: list[str]) -> list[list[int]]:
        """The tokens the sender's states were computed from (as `ilcp.encoder.pooling` tokenizes them)."""
        return tokenize_contexts(self.tokenizer, contexts, self.max_context_tokens)

    def _token_loss(self, memory: list[Tensor], token_ids: list[list[int]]) -> tuple[Tensor, Tensor]:
        """(loss, accuracy): memory vector j of each chunk read as the chunk's j-th context token
        (`token_ids`: each row's context tokens, as the sender's states were computed from).

        The loss is a cross-entropy over cosine similarities to the LM's input-embedding rows (at
        temperature `TOKEN_TEMPERATURE`), or over inner products with them
        (``reconstruct.token_logits=dot``; the token's row against the batch's other tokens and
        sampled ones, or every row in validation), plus the cosine distance to that row and the
        squared relative error of the vector's norm against the row's, those two weighted by
        ``reconstruct.token_shape_weight``: the memory vectors stand where the tokens' own
        embeddings stand, at their scale (a plain dot-product cross-entropy is won by growing the
        norm, and a frozen LM reads a vector 30x too long as noise; a snapped codec reads only the
        ranking, so it may drop those terms). With ``K = C`` vectors per chunk, a row's memory is
        one vector per context position, padding of its last chunk left out. Accuracy: argmax
        over the candidates.
        """
        table = self.lm.get_input_embeddings().weight
        vectors, targets = [], []
        for m, ids in zip(memory, token_ids):
            n = min(len(ids), m.shape[0])
            vectors.append(m[:n].float())
            targets.append(torch.tensor(ids[:n], device=table.device))
        vectors, targets = torch.cat(vectors), torch.cat(targets)
        if self.training:
            sampled = torch.randint(0, table.shape[0], (self.reconstruct_cfg.token_candidates,), device=table.device)
            candidates = torch.unique(torch.cat([targets, sampled]))
        else:
            candidates = torch.arange(table.shape[0], device=table.device)
        if self.reconstruct_cfg.token_logits == "dot":
            logits = vectors @ table[candidates].float().T
        else:
            logits = F.normalize(vectors, dim=-1) @ F.normalize(table[candidates].float(), dim=-1).T / TOKEN_TEMPERATURE
        index = torch.searchsorted(candidates, targets)
        target = table[targets].float()
        cosine = F.cosine_similarity(vectors, target, dim=-1)
        norm_ratio = vectors.norm(dim=-1) / target.norm(dim=-1).clamp(min=1e-6)
        shape = (1.0 - cosine).mean() + (norm_ratio - 1.0).pow(2).mean()
        loss = F.cross_entropy(logits, index) + self.reconstruct_cfg.token_shape_weight * shape
        accuracy = (logits.argmax(-1) == index).float().mean()
        return loss, accuracy

    def target_ids(self, context: str) -> list[int]:
        """The context's tokens and the end token; a long context keeps its first tokens."""
        ids = self.tokenizer(prompts.answer_text(context, self.tokenizer), add_special_tokens=False)["input_ids"]
        return ids[: self.max_target_tokens]

    def tasks(self, batch: dict) -> tuple[dict, list[list[int]], list[list[int]]]:
        """(the batch as the sender reads it, each row's target ids, each row's prompt ids): a text
        read as a continuation (`reads_as_continuation`) hands over its first half and is
        continued with its second; any other is said back whole."""
        contexts, targets, prompt_ids = [], [], []
        for context in batch["context"]:
            # tokenised only for a text read as a continuation: the others are said back whole
            ids = self.context_token_ids([context])[0] if reads_as_continuation(context, self.continuation) else []
            if len(ids) >= 4:
                cut = len(ids) // 2
                contexts.append(self.tokenizer.decode(ids[:cut]))
                targets.append(self.target_ids(self.tokenizer.decode(ids[cut:])))
                prompt_ids.append(self.continuation_ids)
            else:
                contexts.append(context)
                targets.append(self.target_ids(context))
                prompt_ids.append(self.prompt_ids)
        return ({**batch, "context": contexts} if contexts != batch["context"] else batch), targets, prompt_ids

    def reconstruction_loss(self, batch, memory, targets, prompt_ids) -> tuple[Tensor, Tensor]:
        """(the mean cross-entropy of each row's target tokens after its memory and prompt, the KL)
        of a batch as `tasks` rewrote it, with its `memory` (the rows' memory, the KL)."""
        memory, kl = memory
        device = self.lm.get_input_embeddings().weight.device
        sequences, labels = [], []
        for i, target in enumerate(targets):
            prefix = receiver_prefix(self.tokenizer, None, memory=memory[i], prompt_ids=prompt_ids[i])
            sequences.append(prefix.embeds(self.lm, target))
            labels.append(torch.tensor([-100] * len(prefix) + target, device=device))
        return self._loss_on_tail(sequences, labels)[0], kl

    @property
    def loss_terms(self) -> list[LossTerm]:
        """This stage's loss, term by term (`ilcp.training.losses.reconstruction_terms`)."""
        return reconstruction_terms(self.reconstruct_cfg)

    def step_outputs(self, batch: dict) -> dict:
        """The forward every loss term reads: the batch as the sender reads it (``batch``), its
        ``memory``, the regenerated text's cross-entropy ``reconstruction_ce`` and the ``kl``."""
        batch, targets, prompt_ids = self.tasks(batch)
        memory = self.memory(batch)
        loss, kl = self.reconstruction_loss(batch, memory, targets, prompt_ids)
        return {"batch": batch, "memory": memory[0], "reconstruction_ce": loss, "kl": kl}

    def token_loss_of(self, out: dict) -> Tensor:
        """The token loss of a step's memory (`_token_loss`); its accuracy goes to ``out``."""
        loss, out["token_acc"] = self._token_loss(out["memory"], self.context_token_ids(out["batch"]["context"]))
        return loss

    def training_step(self, batch, batch_idx):
        n = len(batch["context"])
        if self.token_only():
            memory, _ = self.memory(batch)
            ids = self.context_token_ids(batch["context"])
            if self.reconstruct_cfg.random_texts:
                random_memory, random_ids = self._random_texts()
                memory, ids = list(memory) + list(random_memory), ids + random_ids
            loss, accuracy = self._token_loss(memory, ids)
            self.log_dict({"train/token_loss": loss, "train/token_acc": accuracy}, prog_bar=True, batch_size=n)
            return loss
        out = self.step_outputs(batch)
        total, values = weighted_sum(self.loss_terms, self, batch, out, self.global_step)
        logged = {"train/loss": total, "train/kl": out["kl"], **{f"train/{name}": v for name, v in values.items()}}
        if "token_acc" in out:
            logged["train/token_acc"] = out["token_acc"]
        self.log_dict(logged, prog_bar=True, batch_size=n)
        return total

    def validation_step(self, batch, batch_idx):
        batch, targets, prompt_ids = self.tasks(batch)
        memory = self.memory(batch)
        loss, _ = self.reconstruction_loss(batch, memory, targets, prompt_ids)
        n = len(batch["context"])
        self.log("val/loss", loss, prog_bar=True, batch_size=n, sync_dist=True)
        if self.token_loss:
            accuracy = self._token_loss(memory[0], self.context_token_ids(batch["context"]))[1]
            self.log("val/token_acc", accuracy, batch_size=n, sync_dist=True)

    def kl_in_loss(self) -> bool:
        """Whether the loss has the latents' KL term (``reconstruct.beta`` > 0). False while the base
        class's __init__ asks, before ``reconstruct_cfg`` is set; __init__ then sets the logvar head."""
        r = getattr(self, "reconstruct_cfg", None)
        return r is not None and r.beta > 0

    def configure_optimizers(self):
        r = self.reconstruct_cfg
        return self._adamw(self.source.parameter_groups(r.lr, r.encoder_lr), r.token_steps + r.steps, r.warmup_steps)


def train_reconstruction(cfg: TrainConfig, lm: LM, encoder: ILCPEncoder, train: HandoffRows, val: HandoffRows,
                         resume: bool) -> dict:
    """Run the reconstruction stage on `encoder` in place (it gets its projector here, unless it
    has one: `ilcp.training.init_from`); metrics."""
    r = cfg.reconstruct
    stage_dir = cfg.run_dir / "stages" / STAGE
    done = stage_dir / f"{STAGE}.safetensors"
    L.seed_everything(cfg.trainer.seed, verbose=False)
    if encoder.projector is None:  # an encoder started from a pretrained one keeps its own
        attach_projector(encoder, cfg.handoff, lm)
    if resume and done.is_file() and (stage_dir / "metrics.json").is_file():
        export.load_encoder_state(encoder, load_file(str(done)), source=str(done))
        say("reconstruction: finished earlier, loaded")
        return json.loads((stage_dir / "metrics.json").read_text())
    train_ctx, val_ctx = pretraining_rows(cfg, lm, train, "train"), pretraining_rows(cfg, lm, val, "validation")
    module = ReconstructionModule(encoder, lm, cfg)
    tr, fr = parameter_counts(module)
    say(f"reconstruction: {len(train_ctx)} distinct contexts ({len(val_ctx)} validation); {tr:,} trainable "
        f"parameters, {fr:,} frozen; {r.token_steps} token-loss steps, then {r.steps} steps of batch {r.batch_size}")
    data = HandoffDataModule(train_ctx, val_ctx, r.batch_size, cfg.trainer.seed)
    # A stage of token-loss steps alone keeps its best token accuracy: the LM's reconstruction loss
    # is not what it trains (with reconstruct.token_logits=dot the vectors' scale is free).
    monitor, mode = ("val/token_acc", "max") if r.steps == 0 else ("val/loss", "min")
    steps, seconds, curve, best = fit_stage(cfg, STAGE, module, data, resume, monitor=monitor, mode=mode,
                                            max_steps=r.token_steps + r.steps, val_every_steps=r.val_every_steps,
                                            patience=r.patience)
    metrics = {"steps": steps, "train_seconds": round(seconds, 1), "contexts": len(train_ctx), "monitor": monitor,
               "best_step": best.get("step"), "best_val_loss": best.get("val/loss"),
               "best_val_token_acc": best.get("val/token_acc"),
               "first_val_loss": curve[0].get("val/loss") if curve else None,
               "last_val_token_acc": curve[-1].get("val/token_acc") if curve else None, "curve": curve}
    save_stage(stage_dir / "metrics.json", metrics, done, export.encoder_state(encoder))
    say(f"reconstruction: validation loss {metrics['first_val_loss']} at step {curve[0]['step'] if curve else '-'}; "
        f"kept step {metrics['best_step']} (best {monitor} {best.get(monitor)})")
    return metrics
