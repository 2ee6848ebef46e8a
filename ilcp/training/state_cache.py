"""The sender-state cache file: a safetensors file of pooled states (``pooled``) or of every real
token's states (``states`` and row ``offsets``), where it lives and what decides it.

    from ilcp.training.state_cache import cache_path, pooled_cache_key, read_cache
    key = pooled_cache_key(lm.fingerprint, task_key, 512, (-1,), dtype="float32")
    pooled = read_cache(cache_path(key), {"pooled": (torch.float32, [n, lm.hidden_size])})["pooled"]

`pooled_cache_key` names everything that decides the states (the LM fingerprint, the task
configuration, the maximum length, the layers, the stored dtype: `cache_dtype`), and `cache_path`
is the file of a key. `write_safetensors` writes a file by streaming, one tensor after another;
`read_cache` reads one back as memory maps, never whole, so the page cache holds what was read
once for every process of a run and a process's own memory does not grow with the rows. A file
that does not match what is asked (another key, other rows, dtype, sizes, truncated) is refused
with a `CacheMismatch` saying why in one line. Each file carries a sha256 digest of its tensors
(layout and bytes) in its metadata, written as it streams; `check_contents` reads the file in
blocks, compares the digest and checks every float state is finite, so damage inside the data is
refused too (a file without a digest, from before digests, is refused as stale). A file truncated
in place while mapped would end the process on the next read of the lost pages (SIGBUS), so each
map holds a read lease on its file (`hold_lease`): another process that opens the file for writing
or truncates it is held by the kernel (up to /proc/sys/fs/lease-break-time, 45 s) while this one
stops with `CacheChanged`, one line naming the file. Where no lease can be taken (a file owned by
another user, a file system without leases, a thread other than the main one) `faulthandler` is
enabled, so a SIGBUS ends with Python's traceback rather than silently.
The extraction that fills the cache is `ilcp.training.extraction`.
"""

from __future__ import annotations

import errno
import faulthandler
import fcntl
import hashlib
import json
import os
import shutil
import signal
import threading
import weakref
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from ..encoder.pooling import TokenStates
from ..lm import default_cache_dir

CACHE_FORMAT = 2  # 2: the stored dtype is part of the key; the file is written by streaming
CACHE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# safetensors' names of the dtypes a cache holds, and the numpy dtype each is mapped as
_STORED = {torch.float32: "F32", torch.bfloat16: "BF16", torch.int64: "I64"}
_MAPPED = {"F32": (np.float32, None), "BF16": (np.int16, torch.bfloat16), "I64": (np.int64, None)}
DIGEST = "sha256"
# each float dtype as the unsigned integers its bytes are read as, and the bound from which its bits
# without the sign are a NaN or an infinity (every exponent bit set)
_EXPONENT = {"F32": (np.uint32, 0x7F800000), "BF16": (np.uint16, 0x7F80)}
CHECK_BLOCK = 8 << 20  # bytes read at a time by `check_contents`


def cache_dtype(setting: str, precision: str, lm_dtype: str = "float32") -> str:
    """The dtype sender states are stored in: ``setting`` (`data.cache_dtype`), whose ``auto`` is
    bfloat16 when the run computes in bfloat16 (``bf16-mixed``, or an LM whose weights are
    bfloat16) and float32 otherwise."""
    if setting == "auto":
        return "bfloat16" if precision == "bf16-mixed" or lm_dtype == "bfloat16" else "float32"
    if setting not in CACHE_DTYPES:
        raise ValueError(f"the sender-state cache dtype must be auto, {' or '.join(CACHE_DTYPES)}, got {setting!r}")
    return setting


def pooled_cache_key(fingerprint: str, task_key: dict, max_length: int, layers: Sequence[int],
                     kind: str = "mean", precision: str = "32-true", dtype: str = "float32") -> dict:
    """Everything that decides the cached states, as a JSON-serialisable dict: the stored dtype
    always, the compute precision when it is not float32."""
    key = {"lm": fingerprint, "task": task_key, "max_length": int(max_length),
           "layers": [int(i) for i in layers], "pool": kind, "dtype": dtype, "format": CACHE_FORMAT}
    if precision != "32-true":
        key["precision"] = precision
    return key


def cache_path(key: dict, cache_dir=None) -> Path:
    """Where the states of ``key`` are cached: ``CACHE/pooled/DIGEST.safetensors``."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return root / "pooled" / f"{digest}.safetensors"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


def process_start(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot, from /proc), or None where that cannot
    be read: with its pid it names one process, whose pid a later process may reuse."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()  # after the command name, which may hold spaces
    return fields[19] if len(fields) > 19 and fields[19].isdigit() else None


def _changed_before_start(folder: Path, pid: int) -> bool:
    """Whether ``folder`` was last changed before process ``pid`` started (False where /proc cannot
    tell): a writer changes its folder after it starts, so such a folder is another process's."""
    ticks = process_start(pid)
    try:
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        changed = folder.stat().st_mtime
    except (OSError, StopIteration, ValueError, IndexError):
        return False
    if ticks is None:
        return False
    # btime is whole seconds: a start computed from it may be up to a second early
    return changed < boot + int(ticks) / os.sysconf("SC_CLK_TCK") - 1


def writer_folder(path: Path) -> Path:
    """The folder this process writes ``path`` in: ``.NAME.PID-START.partial`` (START as
    `process_start` gives it, absent where it cannot be read)."""
    start = process_start(os.getpid())
    return path.parent / f".{path.name}.{os.getpid()}{'-' + start if start else ''}.partial"


def clear_dead_writers(path: Path) -> None:
    """The folders that killed extractions of ``path`` left (``.NAME.PID[-START].partial``): those
    whose process is gone, or whose pid now belongs to a process that started at another time (for
    the old form without START: a process that started after the folder last changed)."""
    for folder in path.parent.glob(f".{path.name}.*.partial"):
        pid, _, start = folder.name[len(path.name) + 2:-len(".partial")].partition("-")
        if not pid.isdigit():
            continue
        alive = _pid_alive(int(pid))
        if start.isdigit():
            reused = alive and process_start(int(pid)) not in (None, start)
        else:  # the old form, without a start: a folder last changed before its pid's process began is not its own
            reused = alive and _changed_before_start(folder, int(pid))
        if not alive or reused:
            shutil.rmtree(folder, ignore_errors=True)


class _Hashing:
    """A file being written that hashes what goes through it."""

    def __init__(self, f, digest):
        self.f, self.digest = f, digest

    def write(self, data) -> int:
        self.digest.update(data)
        return self.f.write(data)

    def tell(self) -> int:
        return self.f.tell()


def _layout_bytes(header: dict) -> bytes:
    """What the digest covers besides the data: every tensor's dtype, shape and offsets."""
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    return json.dumps(tensors, sort_keys=True, separators=(",", ":")).encode()


def write_safetensors(path: Path, layout: list[tuple[str, torch.dtype, list[int]]], fill,
                      metadata: dict[str, str] | None = None) -> None:
    """A safetensors file written by streaming: the header from ``layout`` ((name, dtype, shape)
    in file order), then ``fill(file, name)`` writes each tensor's bytes in turn; checked against
    the layout, its digest (metadata ``digest``: sha256 of the layout and the bytes) written into
    the header last, flushed to disk."""
    header, begin, sizes = {}, 0, []
    for name, dtype, shape in layout:
        size = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _STORED[dtype], "shape": list(shape), "data_offsets": [begin, begin + size]}
        sizes.append(size)
        begin += size
    digest = hashlib.new(DIGEST, _layout_bytes(header))
    placeholder = f"{DIGEST}:{'0' * 2 * digest.digest_size}"

    def encoded(value: str) -> bytes:
        text = json.dumps({**header, "__metadata__": {**(metadata or {}), "digest": value}},
                          separators=(",", ":")).encode()
        return text + b" " * (-len(text) % 8)  # the data starts 8-byte aligned

    text = encoded(placeholder)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        hashing = _Hashing(f, digest)
        for (name, _, _), size in zip(layout, sizes):
            at = f.tell()
            fill(hashing, name)
            if f.tell() - at != size:
                raise RuntimeError(f"{name}: wrote {f.tell() - at} bytes where the header says {size}")
        final = encoded(f"{DIGEST}:{digest.hexdigest()}")
        f.seek(8)
        f.write(final)
        f.flush()
        os.fsync(f.fileno())


class CacheMismatch(ValueError):
    """A cache file that is not what was asked for (one line saying why)."""


class CacheChanged(BaseException):
    """A mapped cache file is being opened for writing or truncated (by another process, or by this
    one): raised from the lease's signal handler wherever this process is, so that it stops before
    reading pages that may be gone. A BaseException, like KeyboardInterrupt, which it resembles: it
    arrives asynchronously and must not be swallowed by an ``except Exception`` on the way out."""


_LEASES: dict[int, Path] = {}  # descriptor -> file, for each read lease held by a live map
_PREVIOUS_SIGIO = None


def _lease_broken(signum, frame) -> None:
    for fd, path in list(_LEASES.items()):
        try:
            broken = fcntl.fcntl(fd, fcntl.F_GETLEASE) == fcntl.F_UNLCK  # the lease being broken reads F_UNLCK
        except OSError:
            continue
        if broken:
            raise CacheChanged(f"the sender-state cache file {path} was opened for writing or truncated while this "
                               f"process reads it; stopped before reading a changed file (nothing was exported). "
                               f"Run again once the other writer is done, or delete the file to have it computed "
                               f"again")
    if callable(_PREVIOUS_SIGIO):  # a signal of someone else's
        _PREVIOUS_SIGIO(signum, frame)


def _release(fd: int) -> None:
    _LEASES.pop(fd, None)
    try:
        os.close(fd)
    except OSError:
        pass


def hold_lease(path: Path, owner: object) -> bool:
    """Hold a read lease on ``path`` for as long as ``owner`` (a map of the file) lives: an open for
    writing or a truncate of the file then waits while this process raises `CacheChanged`. False
    where no lease can be had (see the module's notes); the caller goes on without one."""
    global _PREVIOUS_SIGIO
    if threading.current_thread() is not threading.main_thread():
        return False  # a signal handler can only be installed, and only runs, in the main thread
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
    except OSError as e:  # EAGAIN: open for writing somewhere; EACCES: not ours; EINVAL: no leases here
        os.close(fd)
        if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EPERM, errno.EINVAL, errno.ENOLCK):
            raise
        return False
    if signal.getsignal(signal.SIGIO) is not _lease_broken:
        _PREVIOUS_SIGIO = signal.signal(signal.SIGIO, _lease_broken)
    _LEASES[fd] = path
    weakref.finalize(owner, _release, fd)
    return True


def read_cache(path: Path, expect: dict[str, tuple[torch.dtype, list[int | None]]],
               metadata: dict[str, str] | None = None) -> dict[str, Tensor]:
    """The tensors of a safetensors cache file as read-only memory maps (copy-on-write: pages are
    read from the file when touched, never the whole file at once).

    Args:
        expect: for each tensor, its dtype and shape (None for a size not known ahead).
        metadata: entries the file's metadata must hold.
    Raises:
        CacheMismatch: the file is truncated or too long, not safetensors, or its tensors, dtypes,
            shapes or metadata differ from what is expected.
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        first = f.read(8)
        if len(first) < 8:
            raise CacheMismatch(f"truncated: {size} bytes")
        n = int.from_bytes(first, "little")
        if 8 + n > size:
            raise CacheMismatch(f"truncated: {size} bytes, its header alone says {8 + n}")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise CacheMismatch("not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise CacheMismatch("not a safetensors file")
    found = header.pop("__metadata__", None) or {}
    for name, value in (metadata or {}).items():
        if found.get(name) != value:
            what = {"key": "states of other settings (another run's or another LM's)", "row_ids": "other rows",
                    "dtype": f"{found.get('dtype')} states where {value} ones are asked"}.get(name, f"another {name}")
            raise CacheMismatch(f"it holds {what}")
    if set(header) != set(expect):
        raise CacheMismatch(f"it holds tensors {sorted(header)}, not {sorted(expect)}")
    end = max((int(t["data_offsets"][1]) for t in header.values()), default=0)
    if 8 + n + end != size:
        raise CacheMismatch(f"{'truncated' if 8 + n + end > size else 'too long'}: {size} bytes where its header "
                            f"says {8 + n + end}")
    out = {}
    for name, (dtype, shape) in expect.items():
        t = header[name]
        begin, stop = (int(x) for x in t["data_offsets"])
        if t.get("dtype") != _STORED[dtype]:
            raise CacheMismatch(f"{name} is {t.get('dtype')}, not {_STORED[dtype]}")
        got = [int(x) for x in t["shape"]]
        if len(got) != len(shape) or any(w is not None and w != g for w, g in zip(shape, got)):
            raise CacheMismatch(f"{name} has shape {got} where {['*' if w is None else w for w in shape]} is asked")
        numpy_dtype, view = _MAPPED[_STORED[dtype]]
        if stop - begin != int(np.prod(got, dtype=np.int64)) * np.dtype(numpy_dtype).itemsize:
            raise CacheMismatch(f"{name}'s bytes do not match its shape")
        if stop == begin:
            tensor = torch.zeros(got, dtype=dtype)
        else:
            if path.stat().st_size != size:  # changed since it was checked: mapped pages past its end would kill
                raise CacheMismatch(f"it changed size while being read ({size} -> {path.stat().st_size} bytes)")
            mapped = np.memmap(path, dtype=numpy_dtype, mode="c", offset=8 + n + begin, shape=tuple(got))
            if not hold_lease(path, mapped) and not faulthandler.is_enabled():
                faulthandler.enable()  # a file truncated under its map: a traceback, not a silent death
            if path.stat().st_size != size:  # changed between the check above and the lease
                raise CacheMismatch(f"it changed size while being read ({size} -> {path.stat().st_size} bytes)")
            tensor = torch.from_numpy(mapped)
            tensor = tensor.view(view) if view is not None else tensor
        out[name] = tensor
    return out


def states_in_cache(found: dict[str, Tensor], tokens: bool, n: int):
    """The states a cache file's tensors hold, checked whole where that is cheap."""
    if not tokens:
        return found["pooled"]
    offsets = found["offsets"]
    if int(offsets[0]) != 0 or int(offsets[-1]) != found["states"].shape[0] or bool((offsets[1:] < offsets[:-1]).any()):
        raise CacheMismatch(f"its offsets do not rise from 0 to its {found['states'].shape[0]} token states")
    return TokenStates(found["states"], offsets)


def check_contents(path: Path) -> None:
    """Whether a cache file's tensors are those it was written with and its float states finite:
    the file is read in blocks of `CHECK_BLOCK` bytes (never whole) and hashed as
    `write_safetensors` hashed it, and each block of a float tensor checked for NaN and Inf.

    Raises:
        CacheMismatch: the file has no digest (written before digests), its bytes or layout do not
            match its digest, or a float tensor holds a NaN or an infinity.
    """
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        stored = str((header.get("__metadata__") or {}).get("digest", ""))
        name, _, expected = stored.partition(":")
        if name != DIGEST or not expected:
            raise CacheMismatch("it has no digest of its states (written before caches carried one): stale")
        digest = hashlib.new(DIGEST, _layout_bytes(header))
        tensors = sorted((v["data_offsets"], k, v["dtype"]) for k, v in header.items() if k != "__metadata__")
        buffer, scratch = bytearray(CHECK_BLOCK), bytearray(CHECK_BLOCK)
        view = memoryview(buffer)
        bad = []
        for (begin, stop), tensor, dtype in tensors:
            f.seek(8 + n + int(begin))
            left = int(stop) - int(begin)
            while left:
                got = f.readinto(view[:min(left, CHECK_BLOCK)])
                if not got:
                    raise CacheMismatch(f"truncated: {tensor} ends early")
                digest.update(view[:got])
                if dtype in _EXPONENT and not bad:
                    unsigned, bound = _EXPONENT[dtype]
                    bits = np.frombuffer(buffer, dtype=unsigned, count=got // np.dtype(unsigned).itemsize)
                    unsigned_bits = np.frombuffer(scratch, dtype=unsigned, count=len(bits))
                    if len(bits) and np.bitwise_and(bits, bound | (bound - 1), out=unsigned_bits).max() >= bound:
                        bad.append(tensor)
                left -= got
    if digest.hexdigest() != expected:
        raise CacheMismatch("its states do not match their digest (the file was changed or damaged after it was "
                            "written)")
    if bad:
        raise CacheMismatch(f"its {bad[0]} hold a NaN or an infinity")
