"""An export's config.json is covered by its own digest (an edit is refused in one line, key or
no key), its sizes are bounded before anything is built, and weights with NaN or infinity are
never written (issue 52, items 2, 4, 5 and 9)."""

import json
import random
import shutil
import time
import warnings
from pathlib import Path

import pytest
import torch

from ilcp.encoder.spec import MAX_PARAMETERS, EncoderSpec
from ilcp.export import ExportError, read_config, read_export, sign_export
from ilcp.export_integrity import CONFIG_DIGEST, redigest
from ilcp.export_writing import save_encoder
from ilcp.handoff import ILCPHandoff

KEY = b"k" * 32


def copy_run(tiny_run, tmp_path: Path, name: str = "run") -> Path:
    return Path(shutil.copytree(tiny_run.run_dir, tmp_path / name))


def config_of(run: Path) -> dict:
    return json.loads((run / "config.json").read_text())


def write(run: Path, config: dict) -> None:
    (run / "config.json").write_text(json.dumps(config, sort_keys=True, indent=2))


def test_a_written_export_carries_its_digest_and_reads_without_a_warning(tiny_run):
    assert CONFIG_DIGEST in config_of(tiny_run.run_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        read_config(tiny_run.run_dir)


@pytest.mark.parametrize("edit", ["pooling.max_length", "num_memory_tokens", "lm.precision"])
def test_an_edited_setting_is_refused_in_one_line_key_or_no_key(tiny_run, tiny_lm, tmp_path, edit):
    for key in (None, KEY):
        run = copy_run(tiny_run, tmp_path, f"run-{key is None}")
        if key is not None:
            sign_export(run, key)
        config = config_of(run)
        section, _, entry = edit.rpartition(".")
        node = config[section] if section else config
        node[entry] = {"pooling.max_length": 16, "num_memory_tokens": 3, "lm.precision": "bf16-mixed"}[edit]
        write(run, config)
        with pytest.raises(ExportError, match="was changed after it was written") as info:
            read_config(run, key)
        assert "\n" not in str(info.value)
        with pytest.raises(ExportError, match="was changed after it was written"):
            ILCPHandoff.from_pretrained(run, lm=tiny_lm, export_key=key)


def test_no_bit_flip_in_config_json_changes_what_loads_without_a_word(tiny_run, tmp_path):
    """Each of 300 single-bit flips is refused, or reads back the same settings, or (a flip in the
    digest's own name) is read with the warning that the settings are unchecked."""
    run = copy_run(tiny_run, tmp_path)
    original = (run / "config.json").read_bytes()
    want = {k: v for k, v in json.loads(original).items() if k != CONFIG_DIGEST}
    rng = random.Random(0)
    outcomes = {"refused": 0, "same": 0, "warned": 0}
    for _ in range(300):
        data = bytearray(original)
        bit = rng.randrange(len(data) * 8)
        data[bit // 8] ^= 1 << (bit % 8)
        (run / "config.json").write_bytes(bytes(data))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                got = read_config(run)
            except ExportError:
                outcomes["refused"] += 1
                continue
        if {k: v for k, v in got.items() if k != CONFIG_DIGEST} == want:
            outcomes["same"] += 1
        else:
            assert any("carries no config_digest" in str(w.message) for w in caught), f"bit {bit} loaded silently"
            outcomes["warned"] += 1
    assert outcomes["refused"] > 250, outcomes


def test_an_export_without_a_digest_still_reads_and_says_so_once(tiny_run, tmp_path):
    run = copy_run(tiny_run, tmp_path)
    config = config_of(run)
    del config[CONFIG_DIGEST]
    write(run, config)
    with pytest.warns(UserWarning, match="carries no config_digest"):
        read_export(run)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        read_export(run)  # once per export and process


def test_a_signed_export_read_without_its_key_says_once_that_it_is_unverified(tiny_run, tmp_path):
    run = copy_run(tiny_run, tmp_path)
    sign_export(run, KEY)
    with pytest.warns(UserWarning, match="is signed, but no key was given"):
        read_config(run)
    read_config(run, KEY)  # with the key: verified, nothing to say


def test_a_bogus_precision_names_the_file_and_the_entry(tiny_run, tmp_path):
    run = copy_run(tiny_run, tmp_path)
    config = config_of(run)
    config["lm"]["precision"] = "fp7"
    write(run, redigest(config))
    with pytest.raises(ExportError, match=r"config\.json: lm\.precision must be one of 32-true, bf16-mixed, auto, got 'fp7'"):
        read_config(run)


@pytest.mark.parametrize("entry, value", [("num_memory_tokens", 1_000_000), ("projector.hidden", 2_000_000),
                                          ("latent_dim", 10**9), ("compressor.hidden_dim", 10**8),
                                          ("pooling.max_length", 1 << 40)])
def test_a_size_over_its_maximum_is_refused_naming_it_before_anything_is_built(tiny_run, tmp_path, entry, value):
    run = copy_run(tiny_run, tmp_path)
    config = config_of(run)
    section, _, name = entry.rpartition(".")
    (config[section] if section else config)[name] = value
    write(run, redigest(config))
    start = time.perf_counter()
    with pytest.raises(ExportError, match=rf"'{entry}' must be <= "):
        read_export(run)
    assert time.perf_counter() - start < 2


@pytest.mark.parametrize("entry, value", [("max_slots", 50_000_000), ("tokens_per_slot", 1 << 20),
                                          ("adapter_rank", 1 << 20)])
def test_a_memory_kind_s_count_over_its_maximum_is_refused_naming_it(tiny_run, entry, value):
    config = config_of(tiny_run.run_dir)
    config["pooling"] = {"kind": "slots", "layers": [-1], "max_length": 64, "tokens_per_slot": 8, "min_slots": 1,
                         "max_slots": 8, entry: value}
    with pytest.raises(ExportError, match=rf"'pooling.{entry}' must be <= "):
        EncoderSpec.from_config(config)


def test_settings_within_each_maximum_but_too_large_together_are_refused_by_the_parameter_budget(tiny_run):
    spec = EncoderSpec.from_config(config_of(tiny_run.run_dir))
    hidden = 64  # the tiny LM's width
    built = spec.build(hidden)
    assert spec.check_parameters(hidden) == sum(p.numel() for p in built.parameters())
    big = EncoderSpec.from_config({**config_of(tiny_run.run_dir), "num_memory_tokens": 4000,
                                   "projector": {"hidden": 60_000}})
    start = time.perf_counter()
    with pytest.raises(ExportError, match=rf"more than {MAX_PARAMETERS:,}"):
        big.build(hidden)
    assert time.perf_counter() - start < 2


def test_the_budget_check_draws_no_random_numbers(tiny_run):
    spec = EncoderSpec.from_config(config_of(tiny_run.run_dir))
    torch.manual_seed(0)
    first = spec.build(64).state_dict()
    torch.manual_seed(0)
    spec.check_parameters(64)
    again = spec._build(64).state_dict()
    assert all(torch.equal(first[k], again[k]) for k in first)


def test_weights_with_nan_are_never_written(tiny_run, tmp_path):
    run = read_export(tiny_run.run_dir)
    encoder = run.encoder
    with torch.no_grad():
        next(encoder.projector.parameters()).view(-1)[0] = float("nan")
    with pytest.raises(ExportError, match="hold NaN or infinite values"):
        save_encoder(encoder, run.config, tmp_path / "saved")
    assert not (tmp_path / "saved" / "config.json").exists()


def test_a_file_task_without_its_path_is_named_in_one_line():
    from ilcp.config import load_config

    with pytest.raises(ValueError, match=r"data.task: task 'jsonl:' names no file: give its path, e.g. jsonl:"):
        load_config(None, ["data.task=jsonl:"])
