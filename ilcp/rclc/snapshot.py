"""Agent snapshots: the retained input rows of a bound agent, as one safetensors file.

A snapshot holds two tensors and string metadata, nothing else (no weights, KV caches, chat
history, queued handoffs or sampling settings):

    input_embeds   [positions, hidden], the model's dtype: the exact input rows
    token_ids      int64 [positions], -1 for continuous rows (received or latent)
    metadata       format, version, fingerprint (`ilcp.lm.lm_fingerprint`), dtype, hidden_size,
                   positions, inherited_positions, latent_steps, model identity, digest

The digest (version 2) is the sha256 of every other metadata string and of both tensors' raw
bytes, so a flipped bit anywhere in the file is refused; version-1 files, written before it,
still load (structural checks only). The digest protects against accidents, not edits: whoever
can change the file can recompute it. With a key (``key=`` of `write_snapshot` and
`read_snapshot`, `Agent.save` and `Agent.load`), the metadata also carries ``signature``, an
HMAC-SHA256 of the digest under the key; a reader given the key refuses a snapshot whose
signature is missing or does not verify, so an edit with a recomputed digest is refused.

Files are written atomically (temporary file, then rename) and read without unpickling: the
header is parsed and checked before any tensor is loaded, so truncated, corrupted or foreign
files raise `SnapshotError` with the reason.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from ilcp.checks import check_key
from ilcp.io import atomic_save_safetensors

FORMAT = "ilcp.rclc.agent-snapshot"
VERSION = "2"
READABLE_VERSIONS = ("1", "2")
TENSOR_NAMES = ("input_embeds", "token_ids")
_MAX_HEADER = 1 << 20


class SnapshotError(ValueError):
    """A snapshot file that cannot be restored into this agent; the message says why."""


@dataclass(frozen=True)
class Snapshot:
    """A parsed, structurally valid snapshot (not yet checked against a model).

    Attributes:
        input_embeds: [positions, hidden] rows on the CPU.
        token_ids: int64 [positions], -1 for continuous rows.
        inherited_positions / latent_steps: the leading carried prefix and the latent tail.
        fingerprint: the LM fingerprint the rows belong to.
        metadata: every metadata string of the file.
    """

    input_embeds: torch.Tensor
    token_ids: torch.Tensor
    inherited_positions: int
    latent_steps: int
    fingerprint: str
    metadata: dict

    @property
    def positions(self) -> int:
        return int(self.input_embeds.shape[0])


def write_snapshot(path, input_embeds: torch.Tensor, token_ids: torch.Tensor, *, inherited_positions: int,
                   latent_steps: int, fingerprint: str, identity: dict | None = None,
                   key: bytes | None = None) -> None:
    """Atomically write a snapshot of rows [T, hidden] and IDs [T] to ``path``; with ``key``,
    signed (see the module docstring)."""
    dtype = str(input_embeds.dtype).replace("torch.", "")
    metadata = {
        "format": FORMAT,
        "version": VERSION,
        "fingerprint": fingerprint,
        "dtype": dtype,
        "hidden_size": str(int(input_embeds.shape[1])),
        "positions": str(int(input_embeds.shape[0])),
        "inherited_positions": str(int(inherited_positions)),
        "latent_steps": str(int(latent_steps)),
        "model": json.dumps(identity or {}, sort_keys=True, default=str),
    }
    tensors = {"input_embeds": input_embeds.detach().cpu().contiguous(),
               "token_ids": token_ids.detach().cpu().to(torch.long).contiguous()}
    metadata["digest"] = content_digest(metadata, tensors["input_embeds"], tensors["token_ids"])
    if key is not None:
        metadata["signature"] = _signature(metadata["digest"], key)
    atomic_save_safetensors(tensors, Path(path), metadata=metadata)


def content_digest(metadata: dict, input_embeds: torch.Tensor, token_ids: torch.Tensor) -> str:
    """sha256 over the metadata (but its digest and signature) and the raw bytes of both tensors."""
    kept = {k: v for k, v in metadata.items() if k not in ("digest", "signature")}
    h = hashlib.sha256(json.dumps(kept, sort_keys=True).encode())
    for t in (input_embeds, token_ids):
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _signature(digest: str, key: bytes) -> str:
    return hmac.new(check_key(key), f"{FORMAT}:{digest}".encode(), hashlib.sha256).hexdigest()


def _int(metadata: dict, key: str) -> int:
    value = metadata.get(key)
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise SnapshotError(f"snapshot metadata {key!r} is missing or not an integer: {value!r}") from None
    if number < 0:
        raise SnapshotError(f"snapshot metadata {key!r} must be >= 0, got {number}")
    return number


def _header(data: bytes) -> dict:
    if len(data) < 8:
        raise SnapshotError(f"not a snapshot: {len(data)} bytes is shorter than a safetensors header")
    (length,) = struct.unpack("<Q", data[:8])
    if length > _MAX_HEADER or 8 + length > len(data):
        raise SnapshotError(f"truncated or corrupted snapshot: a {length}-byte header in a {len(data)}-byte file")
    try:
        header = json.loads(data[8:8 + length].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SnapshotError(f"corrupted snapshot header: {e}") from None
    if not isinstance(header, dict):
        raise SnapshotError("corrupted snapshot header: not a JSON object")
    end = 8 + length
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            raise SnapshotError(f"corrupted snapshot header entry for {name!r}")
        if end + offsets[1] > len(data):
            raise SnapshotError(f"truncated snapshot: tensor {name!r} ends past the end of the file")
    return header


def read_snapshot(path, key: bytes | None = None) -> Snapshot:
    """Parse and structurally validate a snapshot file (shapes, dtypes, counts, finite rows);
    with ``key``, its signature must verify.

    Raises:
        SnapshotError: unreadable, truncated, corrupted, of another format or version, or
            inconsistent (rows, IDs and counts that disagree); with a key, unsigned or signed
            otherwise (edited, or under another key).
        ValueError: a key that is not bytes of length >= 16.
    """
    if key is not None:
        key = check_key(key)
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise SnapshotError(f"cannot read snapshot {str(path)!r}: {e}") from None
    header = _header(data)
    metadata = header.get("__metadata__") or {}
    if metadata.get("format") != FORMAT:
        raise SnapshotError(f"{str(path)!r} is not an agent snapshot (format {metadata.get('format')!r})")
    if metadata.get("version") not in READABLE_VERSIONS:
        raise SnapshotError(f"snapshot version {metadata.get('version')!r} is not supported "
                            f"(this package reads {', '.join(READABLE_VERSIONS)})")
    names = sorted(k for k in header if k != "__metadata__")
    if names != sorted(TENSOR_NAMES):
        raise SnapshotError(f"a snapshot holds exactly {TENSOR_NAMES}, found {names}")
    from safetensors.torch import load as load_tensors

    try:
        tensors = load_tensors(data)
    except Exception as e:  # the parser's own error types vary between releases
        raise SnapshotError(f"corrupted snapshot: {e}") from None
    rows, ids = tensors["input_embeds"], tensors["token_ids"]
    if metadata.get("version") != "1":
        if metadata.get("digest") != content_digest(metadata, rows, ids):
            raise SnapshotError("corrupted snapshot: its content does not match its digest")
    if key is not None:
        signature = metadata.get("signature")
        if signature is None or metadata.get("version") == "1":
            raise SnapshotError("the snapshot carries no signature, but a key was given: save it with the key "
                                "(agent.save(path, key=key)), or load it without one")
        if not hmac.compare_digest(str(signature), _signature(str(metadata.get("digest")), key)):
            raise SnapshotError("the snapshot's signature does not verify: it was edited after saving (its digest "
                                "recomputed), or signed with another key")
    positions = _int(metadata, "positions")
    hidden = _int(metadata, "hidden_size")
    inherited = _int(metadata, "inherited_positions")
    latent = _int(metadata, "latent_steps")
    if positions < 1:
        raise SnapshotError(f"a snapshot holds at least one position; its metadata says {positions} "
                            f"(input_embeds is {tuple(rows.shape)})")
    if rows.dim() != 2 or tuple(rows.shape) != (positions, hidden):
        raise SnapshotError(f"input_embeds is {tuple(rows.shape)}, metadata says ({positions}, {hidden})")
    if not rows.is_floating_point() or str(rows.dtype).replace("torch.", "") != metadata.get("dtype"):
        raise SnapshotError(f"input_embeds dtype {rows.dtype} does not match metadata {metadata.get('dtype')!r}")
    if ids.dtype != torch.int64 or tuple(ids.shape) != (positions,):
        raise SnapshotError(f"token_ids must be int64 [{positions}], got {ids.dtype} {tuple(ids.shape)}")
    if bool((ids < -1).any()):
        raise SnapshotError("token_ids must be -1 (continuous) or non-negative")
    if inherited + latent > positions:
        raise SnapshotError(f"inherited_positions={inherited} and latent_steps={latent} overlap in {positions} rows")
    if latent and bool((ids[positions - latent:] != -1).any()):
        raise SnapshotError("the latent tail must have token_ids -1")
    if not bool(torch.isfinite(rows).all()):
        raise SnapshotError("input_embeds contain non-finite values")
    fingerprint = metadata.get("fingerprint")
    if not isinstance(fingerprint, str) or not fingerprint:
        raise SnapshotError("the snapshot has no LM fingerprint")
    return Snapshot(rows, ids, inherited, latent, fingerprint, dict(metadata))


def check_compatible(snapshot: Snapshot, *, fingerprint: str, dtype: torch.dtype, hidden_size: int,
                     vocab_size: int, context_limit: int) -> None:
    """Raise SnapshotError unless ``snapshot`` can be restored into the described agent."""
    want = str(dtype).replace("torch.", "")
    if snapshot.metadata.get("dtype") != want:
        raise SnapshotError(f"the snapshot holds {snapshot.metadata.get('dtype')} rows; the bound model is {want}: bind the same checkpoint and dtype")
    if snapshot.input_embeds.shape[1] != hidden_size:
        raise SnapshotError(f"the snapshot's hidden size {snapshot.input_embeds.shape[1]} != the model's {hidden_size}")
    if snapshot.fingerprint != fingerprint:
        raise SnapshotError(
            f"the snapshot was saved from another model (fingerprint {snapshot.fingerprint}, this model "
            f"{fingerprint}): weights, forward configuration or tokenizer vocabulary differ"
        )
    if bool((snapshot.token_ids >= vocab_size).any()):
        raise SnapshotError(f"token_ids exceed the vocabulary of {vocab_size}")
    if snapshot.positions > context_limit:
        raise SnapshotError(f"the snapshot's {snapshot.positions} positions exceed the agent's context limit of {context_limit}")
