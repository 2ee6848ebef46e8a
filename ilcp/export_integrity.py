"""The integrity of an export's config.json: the sha256 digest of each weights file
(`file_digest`), the sha256 of config.json's own entries (`config_digest`, `seal_config`,
`check_config_digest`), and the HMAC-SHA256 signature under a key of config.json itself
(`sign_config`, `check_signature`); see `ilcp.export` for what each protects against.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from pathlib import Path

from .checks import check_key
from .encoder.spec import ExportError

SIGNATURE = "signature"  # config.json's HMAC entry (`sign_config`)
CONFIG_DIGEST = "config_digest"  # config.json's sha256 of its other entries (`seal_config`)


def file_digest(path: Path) -> str:
    """sha256 of a file's bytes, hex."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _canonical(config: dict, leave: tuple[str, ...]) -> bytes:
    return json.dumps({k: v for k, v in config.items() if k not in leave}, sort_keys=True,
                      separators=(",", ":")).encode("utf-8")


def config_digest(config: dict) -> str:
    """sha256 of config.json's entries but the digest and the signature, as canonical JSON."""
    return hashlib.sha256(_canonical(config, (SIGNATURE, CONFIG_DIGEST))).hexdigest()


def seal_config(config: dict, key: bytes | None = None) -> dict:
    """`config` as it is written: with its ``config_digest`` and, with `key`, signed (`sign_config`)."""
    config = redigest({k: v for k, v in config.items() if k != SIGNATURE})
    return config if key is None else sign_config(config, key)


def redigest(config: dict) -> dict:
    """`config` with its ``config_digest`` computed anew, anything else (a signature) kept as it is."""
    return {**config, CONFIG_DIGEST: {"algorithm": "sha256", "value": config_digest(config)}}


def check_config_digest(config: dict, where: Path) -> bool:
    """Refuse a config.json edited after it was written (its entries no longer give its
    ``config_digest``); False for one written before config.json carried a digest."""
    digest = config.get(CONFIG_DIGEST)
    if digest is None:
        return False
    value = digest.get("value") if isinstance(digest, dict) else None
    if not isinstance(value, str) or digest.get("algorithm") != "sha256":
        raise ExportError(f"{where}: {CONFIG_DIGEST} must be {{'algorithm': 'sha256', 'value': hex}}")
    if not hmac.compare_digest(value, config_digest(config)):
        raise ExportError(f"{where} was changed after it was written (its entries no longer match its {CONFIG_DIGEST}): "
                          "copy the export again from where it was trained, or train it anew")
    return True


def _signature(config: dict, key: bytes) -> str:
    body = json.dumps({k: v for k, v in config.items() if k != SIGNATURE}, sort_keys=True, separators=(",", ":"))
    return hmac.new(check_key(key), body.encode("utf-8"), hashlib.sha256).hexdigest()


def sign_config(config: dict, key: bytes) -> dict:
    """`config` with its ``signature``: HMAC-SHA256 under `key` of every other entry (its weights'
    digests included). Raises ExportError when a listed file has no digest (it would be unsigned)."""
    unsigned = sorted(f for f in config.get("files", {}).values() if f not in (config.get("digests") or {}))
    if unsigned:
        raise ExportError(f"cannot sign an export whose config.json lists files without a digest: {unsigned}")
    return {**config, SIGNATURE: {"algorithm": "hmac-sha256", "value": _signature(config, key)}}


def check_signature(config: dict, key: bytes, where: Path) -> None:
    signature = config.get(SIGNATURE)
    if signature is None:
        raise ExportError(f"{where} carries no signature, but a key was given: sign the export with "
                          "ilcp.export.sign_export(run, key), or read it without a key")
    value = signature.get("value") if isinstance(signature, dict) else None
    if not isinstance(value, str) or signature.get("algorithm") != "hmac-sha256":
        raise ExportError(f"{where}: signature must be {{'algorithm': 'hmac-sha256', 'value': hex}}")
    if not hmac.compare_digest(value, _signature(config, key)):
        raise ExportError(f"{where}: the signature does not verify: config.json or a weights digest was changed "
                          "after signing, or it was signed with another key")
    unsigned = sorted(f for f in config["files"].values() if f not in (config.get("digests") or {}))
    if unsigned:
        raise ExportError(f"{where}: files {unsigned} have no digest, so the signature does not cover them")
