"""The export directory of a training run, and reading it back.

    checkpoints/RUN/
      config.json                  sorted keys: sizes, beta, LM spec + fingerprint, pooling, files
      model.safetensors            ilcp: compressor.* (with its standardisation stats) + projector.*
                                   (+ pooler.* when the run used attention pooling)
      prompt_tuned.safetensors     soft_prompt (K, H)
      cold_read_tuned.safetensors  soft_prompt (K, H)
      selection_tuned.safetensors  soft_prompt (K, H), when handoff.variants has selection_tuned
                                   (K: config.json's tuned_vectors where the memory reads another K,
                                   as the chunk memory's one vector a chunk; else num_memory_tokens)
      train_config.yaml            the resolved training config
      metrics.json                 validation curves and final figures per variant
      README.md                    a short model card: base LM, fingerprint, task, metrics, loading

`ilcp.export_writing` writes the directory (`export_run`, `save_encoder`), this module reads it
back, and `ilcp.export_integrity` holds its digests and signature.

This module is the only place that names state-dict keys: `encoder_state` / `load_encoder_state`
for an `ILCPEncoder`, `soft_prompt_state` / `load_soft_prompt` for a `ConstantMemory`, and
`trained_state` / `load_trained_state` for either (training's stage files use them too).

``compressor.latent_bound``, a float32 scalar in model.safetensors (so under its digest, and
with a key under the signature), is the largest |z| a receiver of the export accepts
(`ILCPEncoder.latent_bound`; `ILCPHandoff.parse` refuses a value beyond it): training records 4x
the largest |z| its encoder gives over the validation and training rows
(`ilcp.training.data.latent_bound`). An export written before it has none: its receivers bound
no latent value, and still refuse memory that projects to NaN or infinity.

The encoder's entries of config.json (sizes, pooling, placement, snap) are one typed dataclass,
`ilcp.encoder.spec.EncoderSpec`, which writes, checks and rebuilds them; the rest (LM, files,
digests, format version) is the run's and is checked here.

Only trained modules are written, never the frozen LM. Every file is written atomically, and
config.json last, so a directory with a config.json holds a complete export. Reading never
unpickles (safetensors only), and `check_fingerprint` refuses an export made for another LM.

Integrity. config.json records the sha256 of every weights file (``digests``) and of its own
other entries (``config_digest``, checked before anything else is read: an edited setting is
refused in one line). Without a key the digests protect against accidents (a truncated copy, a
flipped bit, a hand edit, a file from another run), not against deliberate edits: whoever can
change a file can write its new sha256 into config.json. An export written before config.json
had its digest still reads, with one warning.
With a key (``key=`` of `export_run`, `save_encoder`, `read_export`; `sign_export` for an export
already written), config.json also carries ``signature``, an HMAC-SHA256 under the key of
config.json itself (every entry but the signature, canonical JSON), digests included; a reader
given the key refuses an export whose signature is missing or does not verify, so an edited
file with a recomputed digest is refused. metrics.json, train_config.yaml and README.md are
not covered (they are read for reports only).
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor

from .encoder.model import ConstantMemory, ILCPEncoder, MemorySource
from .encoder.spec import EncoderSpec, ExportError
from .lm import LM, LMLoadError, load_lm
from .export_integrity import CONFIG_DIGEST, SIGNATURE, check_config_digest, check_signature, file_digest, seal_config
from .io import atomic_write_json, file_kind
from .names import PRECISIONS
from .weights_header import HeaderError, safetensors_shapes
from .encoder.kinds import config_value

EXPORT_FORMAT = "ilcp-export"
EXPORT_VERSION = EncoderSpec.VERSION
BASELINES = ("prompt_tuned", "cold_read_tuned", "selection_tuned")  # the soft-prompt variants
MODEL_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
CARD_FILE = "README.md"

# the state-dict prefixes of the exported files
_PARTS = {"compressor": "vae", "projector": "projector", "pooler": "pooler", "format": "format_prompt"}
_SOFT_PROMPT = "soft_prompt"
_LATENT_BOUND = "compressor.latent_bound"  # `ILCPEncoder.latent_bound`, a float32 scalar (not a VAE tensor)


# --------------------------------------------------------------------------------------------
# state dicts


def encoder_state(encoder: ILCPEncoder) -> dict[str, Tensor]:
    """The encoder's tensors with export names: compressor.* (with compressor.latent_bound when the
    encoder has a bound), projector.* (when built), pooler.* (attention pooling), detached on the CPU."""
    state = {}
    for prefix, attr in _PARTS.items():
        part = getattr(encoder, attr)
        if part is not None:
            state.update({f"{prefix}.{k}": v.detach().cpu() for k, v in part.state_dict().items()})
    if encoder.latent_bound is not None:
        state[_LATENT_BOUND] = torch.tensor(float(encoder.latent_bound), dtype=torch.float32)
    return state


def load_encoder_state(encoder: ILCPEncoder, state: dict[str, Tensor], *, source: str = "the weights") -> None:
    """Load `encoder_state` tensors into `encoder` (parts it has; a projector-less state leaves its
    projector as it is; a state without compressor.latent_bound leaves the encoder's bound as it is).
    Raises ExportError when a part the encoder has is missing or does not fit."""
    state = dict(state)
    bound = state.pop(_LATENT_BOUND, None)  # an export written before the bound has none
    if bound is not None and (bound.dtype != torch.float32 or bound.dim() != 0 or not bool(torch.isfinite(bound))
                              or float(bound) <= 0):
        what = f"{float(bound):g}" if bound.numel() == 1 else f"shape {tuple(bound.shape)}"
        raise ExportError(f"{source}: {_LATENT_BOUND} must be one finite float32 > 0, got {what} "
                          f"({str(bound.dtype).removeprefix('torch.')})")
    for prefix, attr in _PARTS.items():
        part = getattr(encoder, attr)
        tensors = {k[len(prefix) + 1:]: v for k, v in state.items() if k.startswith(prefix + ".")}
        if part is None:
            if tensors:
                raise ExportError(f"{source} hold {prefix}.* tensors, but the config names no {prefix}")
            continue
        if not tensors:
            if prefix == "projector" or not part.state_dict():  # a parameter-free pooler has no tensors
                continue
            raise ExportError(f"{source} hold no {prefix}.* tensors")
        _check_tensors(tensors, part.state_dict(), f"{source}: {prefix}")
        part.load_state_dict(tensors)
    unread = sorted(k for k in state if k.split(".", 1)[0] not in _PARTS)
    if unread:
        raise ExportError(f"{source}: unexpected tensors {unread[:4]} (this package reads only "
                          f"{', '.join(p + '.*' for p in _PARTS)})")
    if bound is not None:
        encoder.latent_bound = float(bound)
    if "compressor.input_std" in state:
        if not bool((state["compressor.input_std"] > 0).all()):
            raise ExportError(f"{source}: compressor.input_std must be > 0 everywhere")


def soft_prompt_state(source: ConstantMemory) -> dict[str, Tensor]:
    return {_SOFT_PROMPT: source.soft_prompt.detach().cpu()}


def load_soft_prompt(state: dict[str, Tensor], *, source: str = "the weights",
                     shape: tuple[int, int] | None = None) -> Tensor:
    """The (K, H) soft prompt of a `soft_prompt_state`, float32; `shape` checks (K, H)."""
    if set(state) != {_SOFT_PROMPT} or state[_SOFT_PROMPT].dim() != 2:
        raise ExportError(f"{source}: expected exactly one (K, H) tensor named {_SOFT_PROMPT!r}, found "
                          f"{sorted(state)}")
    tensor = state[_SOFT_PROMPT]
    if shape is not None and tuple(tensor.shape) != tuple(shape):
        raise ExportError(f"{source}: {_SOFT_PROMPT} has shape {tuple(tensor.shape)}, the config says {tuple(shape)}")
    _check_tensors(state, {_SOFT_PROMPT: tensor.float()}, source)
    return tensor.float()


def _check_tensors(found: dict[str, Tensor], expected: dict[str, Tensor], source: str) -> None:
    """Exactly the expected names, each float32, of the expected shape, and finite."""
    missing, extra = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
    if missing or extra:
        raise ExportError(f"{source}: tensors do not match the config (missing {missing[:4]}, unexpected {extra[:4]})")
    for name, want in expected.items():
        got = found[name]
        if got.dtype != torch.float32:
            raise ExportError(f"{source}: tensor {name} is {got.dtype}, expected torch.float32")
        if tuple(got.shape) != tuple(want.shape):
            raise ExportError(f"{source}: tensor {name} has shape {tuple(got.shape)}, expected {tuple(want.shape)}")
        if not bool(torch.isfinite(got).all()):
            raise ExportError(f"{source}: tensor {name} holds NaN or Inf values")


def trained_state(source: MemorySource) -> dict[str, Tensor]:
    """The trained tensors of any memory source, with export names."""
    if isinstance(source, ILCPEncoder):
        return encoder_state(source)
    return soft_prompt_state(source)


def load_trained_state(source: MemorySource, state: dict[str, Tensor], *, origin: str = "the weights") -> None:
    if isinstance(source, ILCPEncoder):
        load_encoder_state(source, state, source=origin)
    else:
        source.soft_prompt.data.copy_(load_soft_prompt(state, source=origin))


# --------------------------------------------------------------------------------------------
# signing an export already written


def sign_export(path: str | Path, key: bytes) -> Path:
    """Sign an export already written (after checking it reads, digests and tensors, as it is):
    config.json gains its ``signature`` under `key`, written atomically. Returns the directory."""
    path = Path(path)
    run = read_export(path)
    atomic_write_json(path / CONFIG_FILE, seal_config(run.config, key))
    return path


# --------------------------------------------------------------------------------------------
# reading


def build_encoder(config: dict, state: dict[str, Tensor] | None = None, *, source: str = "the weights",
                  where: str | Path = CONFIG_FILE) -> ILCPEncoder:
    """The `ILCPEncoder` an export's config describes (`EncoderSpec.from_config(config).build`),
    with `state`'s weights when given, in eval mode."""
    return _build(EncoderSpec.from_config(config, where), config["lm"]["hidden_size"], state, source, where)


def _build(spec: EncoderSpec, hidden_size: int, state: dict[str, Tensor] | None, source: str,
           where: str | Path) -> ILCPEncoder:
    try:
        encoder = spec.build(hidden_size)
    except ExportError:
        raise
    except ValueError as e:  # settings that pass one by one but do not fit together (widths)
        raise ExportError(f"{where}: the encoder's settings do not fit together: {e}") from None
    if state is not None:
        load_encoder_state(encoder, state, source=source)
    return encoder.eval()


@dataclass
class ExportedRun:
    """The trained memory sources of one export, on the CPU in float32.

    ``spec`` holds every setting of the encoder (None when the export has none); ``config`` is
    config.json as read, for the run's own entries (lm, task, task_settings, files).
    """

    path: Path
    config: dict
    spec: EncoderSpec | None = None
    encoder: ILCPEncoder | None = None
    soft_prompts: dict[str, Tensor] = field(default_factory=dict)  # baseline name -> (K, H)

    @property
    def fingerprint(self) -> str:
        return self.config["lm"]["fingerprint"]

    @property
    def lm_spec(self) -> str:
        return self.config["lm"]["spec"]


class ExportLMError(ExportError, LMLoadError):
    """An export names an LM (``lm.spec``, ``lm.dtype``) that cannot be loaded here: an
    `ExportError`, as every refusal of an export is, and an `ilcp.lm.LMLoadError`, as every LM
    that does not load is (`load_export_lm`)."""


def export_path(path) -> Path:
    """``path`` as a Path when it can name an export folder (a str or os.PathLike); else ExportError."""
    if not isinstance(path, (str, os.PathLike)):
        raise ExportError(f"an export is a run folder such as 'checkpoints/default' (a str or os.PathLike), got "
                          f"{type(path).__name__}")
    if not str(path).strip():
        raise ExportError("an export is a run folder such as 'checkpoints/default', got an empty path")
    return Path(path)


def load_export_lm(config: dict, where: str | Path, *, device: str = "cpu",
                   cache_dir: str | os.PathLike | None = None) -> LM:
    """The LM an export's config.json names (``lm.spec``, ``lm.dtype``), loaded with `load_lm`.

    Raises:
        ExportLMError: it cannot be loaded here (an unknown spec or dtype, a missing wheel or
            folder), one line naming ``where`` and both entries.
    """
    named = config["lm"]
    spec, dtype = named["spec"], named.get("dtype", "float32")
    try:
        return load_lm(spec, dtype=dtype, device=device, cache_dir=cache_dir)
    except LMLoadError as e:
        raise ExportLMError(f"{where}: the LM it names (lm.spec {spec!r}, lm.dtype {dtype!r}) cannot be loaded here: "
                            f"{' '.join(str(e).split())}") from None


def read_config(path: str | Path, key: bytes | None = None) -> dict:
    """config.json of an export, checked against the schema this package writes; with ``key``,
    its signature must verify (see the module docstring).

    Raises:
        ExportError: one line naming the file and the problem.
    """
    path = export_path(path)
    cfg_path = path / CONFIG_FILE
    if not path.is_dir():
        raise ExportError(f"{str(path)!r} is not a directory; pass a run folder such as checkpoints/default")
    if not cfg_path.is_file() and (cfg_path.exists() or cfg_path.is_symlink()):
        raise ExportError(f"{cfg_path} is {file_kind(cfg_path)}, not a regular file: not a readable export")
    if not cfg_path.is_file():
        raise ExportError(f"{str(path)!r} holds no config.json: not a finished export (train with python train.py)")
    try:
        config = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ExportError(f"{cfg_path} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ExportError(f"{cfg_path} must hold a JSON object, got {type(config).__name__}")
    if config.get("format") != EXPORT_FORMAT:
        raise ExportError(f"{cfg_path} is not an ilcp export (format {config.get('format')!r})")
    if config.get("format_version") != EXPORT_VERSION:
        raise ExportError(f"{cfg_path} has export format version {config.get('format_version')}, this package reads {EXPORT_VERSION}")
    digested = check_config_digest(config, cfg_path)
    _check_schema(config, cfg_path)
    if key is not None:
        check_signature(config, key, cfg_path)
    elif SIGNATURE in config:
        _say_once(cfg_path, f"{cfg_path} is signed, but no key was given: its signature is not verified (pass the "
                            "key it was signed with to verify it)")
    if not digested:
        _say_once(cfg_path, f"{cfg_path} carries no config_digest (written before exports had one): an edit of its "
                            "settings would not be noticed; export it again to add one")
    return config


_SAID: set[tuple[str, str]] = set()


def _say_once(where: Path, message: str) -> None:
    """One warning per export and message in a process (eval reads an export more than once)."""
    if (str(where), message) not in _SAID:
        _SAID.add((str(where), message))
        warnings.warn(message, UserWarning, stacklevel=3)


def _field(config: dict, dotted: str, kind, where: Path, *, minimum=None, required: bool = True):
    try:
        return config_value(config, dotted, kind, minimum=minimum, required=required)
    except ValueError as e:
        raise ExportError(f"{where}: {e}") from None


# config.json's own top-level entries (beside the encoder's, `EncoderSpec.config_keys`)
RUN_ENTRIES = frozenset({"format", "format_version", "package_version", "lm", "num_memory_tokens", "tuned_vectors",
                         "task", "heldout_tasks", "task_settings", "files", "digests", "train_config", "metrics", SIGNATURE,
                         CONFIG_DIGEST})


def tuned_vectors(config: dict) -> int:
    """The tuned baselines' K (prompt_tuned, cold_read_tuned): ``tuned_vectors`` where the memory
    reads another K per latent (the chunk memory's one vector a chunk), else ``num_memory_tokens``."""
    return int(config.get("tuned_vectors", config["num_memory_tokens"]))


def _check_schema(config: dict, where: Path) -> None:
    unknown = sorted(set(config) - RUN_ENTRIES - EncoderSpec.config_keys())
    if unknown:
        raise ExportError(f"{where}: unknown entry {unknown[0]!r} (this package writes no such entry: the file is "
                          "damaged or was edited)")
    _field(config, "lm", dict, where)
    _field(config, "lm.spec", str, where)
    _field(config, "lm.fingerprint", str, where)
    _field(config, "lm.dtype", str, where, required=False)
    precision = _field(config, "lm.precision", str, where, required=False)
    if precision is not None and precision not in PRECISIONS:
        raise ExportError(f"{where}: lm.precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    _field(config, "lm.hidden_size", int, where, minimum=1)
    files = _field(config, "files", dict, where)
    for name, fname in files.items():
        if not isinstance(fname, str) or not fname:
            raise ExportError(f"{where}: files.{name} must be a file name, got {fname!r}")
        if Path(fname).is_absolute() or not (where.parent / fname).resolve().is_relative_to(where.parent.resolve()):
            raise ExportError(f"{where}: files.{name} = {fname!r} points outside the run directory")
        if name != "ilcp" and name not in BASELINES:
            raise ExportError(f"{where}: unknown entry files.{name} (this package reads ilcp, {', '.join(BASELINES)})")
    if files:
        _field(config, "num_memory_tokens", int, where, minimum=1)
    _field(config, "tuned_vectors", int, where, minimum=1, required=False)
    digests = _field(config, "digests", dict, where, required=False)
    if digests is not None and not all(isinstance(v, str) for v in digests.values()):
        raise ExportError(f"{where}: digests must map file names to sha256 hex strings")
    if "ilcp" in files:
        EncoderSpec.from_config(config, where)


def _read_weights(path: Path, fname: str, digests: dict | None) -> dict[str, Tensor]:
    fpath = path / fname
    if not fpath.is_file():
        if fpath.exists() or fpath.is_symlink():
            raise ExportError(f"{fpath} is listed in config.json but is {file_kind(fpath)}, not a regular file: copy "
                              "the export's weights file there")
        raise ExportError(f"{fpath} is listed in config.json but missing")
    if digests is not None and fname in digests and file_digest(fpath) != digests[fname]:
        raise ExportError(f"{fpath} changed after export: its sha256 differs from the one in config.json")
    try:
        return load_file(str(fpath))
    except (SafetensorError, OSError, ValueError) as e:
        raise ExportError(f"{fpath} is not a readable safetensors file: {str(e).splitlines()[0]}") from None


def read_export(path: str | Path, key: bytes | None = None) -> ExportedRun:
    """Read every trained memory source of an export (no LM needed); with ``key``, config.json's
    signature must verify, so no file covered by it was edited (see the module docstring).

    Raises:
        ExportError: one line naming the file and the problem, for any file that is missing,
            tampered with, of the wrong schema, or whose tensors do not fit the config; a
            metrics.json or train_config.yaml it lists that does not parse.
    """
    path = export_path(path)
    config = read_config(path, key)
    _check_run_files(path, config)
    run = ExportedRun(path=path, config=config)
    digests = config.get("digests")
    for name, fname in config["files"].items():
        if name == "ilcp":
            run.spec = EncoderSpec.from_config(config, path / CONFIG_FILE)
            _check_declared_shapes(run.spec, config["lm"]["hidden_size"], path / fname, path / CONFIG_FILE)
        state = _read_weights(path, fname, digests)
        if name == "ilcp":
            run.encoder = _build(run.spec, config["lm"]["hidden_size"], state, str(path / fname), path / CONFIG_FILE)
        else:
            shape = (tuned_vectors(config), config["lm"]["hidden_size"])
            run.soft_prompts[name] = load_soft_prompt(state, source=str(path / fname), shape=shape)
    return run


def _check_declared_shapes(spec: EncoderSpec, hidden_size: int, weights: Path, where: Path) -> None:
    """The tensor shapes `spec` builds (counted on the meta device, nothing allocated) against the
    header of the weights file (`ilcp.weights_header`, no tensor read): a config.json whose settings
    disagree with its weights is refused before anything is built."""
    if not weights.is_file():
        return  # `_read_weights` names what is there instead
    try:
        found = safetensors_shapes(weights)
    except OSError as e:
        raise ExportError(f"{weights} cannot be read: {e}") from None
    except HeaderError as e:
        raise ExportError(str(e)) from None
    try:
        spec.check_parameters(hidden_size)
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            encoder = spec._build(hidden_size)
    except ExportError:
        raise
    except ValueError as e:  # settings that pass one by one but do not fit together (widths)
        raise ExportError(f"{where}: the encoder's settings do not fit together: {e}") from None
    expected = {f"{prefix}.{k}": tuple(v.shape) for prefix, attr in _PARTS.items()
                if getattr(encoder, attr) is not None for k, v in getattr(encoder, attr).state_dict().items()}
    found = {k: v for k, v in found.items() if k != _LATENT_BOUND}  # an export written before the bound has none
    missing, extra = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
    if missing or extra:
        raise ExportError(f"{weights}: tensors do not match {where} (missing {missing[:4]}, unexpected {extra[:4]})")
    for name, shape in expected.items():
        if found[name] != shape:
            raise ExportError(f"{weights}: tensor {name} has shape {found[name]}, but {where} declares {shape}")


def _check_run_files(path: Path, config: dict) -> None:
    """The training run's own files config.json lists, where present: metrics.json a JSON
    object, train_config.yaml a YAML mapping."""
    import yaml

    for entry, what in (("metrics", "JSON"), ("train_config", "YAML")):
        fname = config.get(entry)
        if fname is None:
            continue
        fpath = path / str(fname)
        if not isinstance(fname, str) or not fpath.resolve().is_relative_to(path.resolve()):
            raise ExportError(f"{path / CONFIG_FILE}: {entry} = {fname!r} is not a file of the run directory")
        if not fpath.is_file():  # not needed to load the modules; a copy may leave it out
            continue
        try:
            text = fpath.read_text(encoding="utf-8")
            value = json.loads(text) if what == "JSON" else yaml.safe_load(text)
        except (UnicodeDecodeError, ValueError, yaml.YAMLError) as e:
            problem, mark = getattr(e, "problem", None), getattr(e, "problem_mark", None)
            if problem and mark is not None:  # PyYAML's message spans several lines
                problem = f"{problem} (line {mark.line + 1}, column {mark.column + 1})"
            raise ExportError(f"{fpath} is not valid {what}: {problem or ' '.join(str(e).split())}") from None
        if not isinstance(value, dict):
            raise ExportError(f"{fpath} must hold a {what} mapping, got {type(value).__name__}")


def check_fingerprint(config: dict, fingerprint: str) -> None:
    """Raise ExportError when the export was trained on another LM than the one given."""
    expected = config["lm"]["fingerprint"]
    if fingerprint != expected:
        raise ExportError(
            f"this export was trained on LM {config['lm']['spec']!r} with fingerprint {expected}, but the "
            f"LM given has fingerprint {fingerprint}: load the same weights, dtype and tokenizer "
            "(or train a new run for this LM)"
        )
