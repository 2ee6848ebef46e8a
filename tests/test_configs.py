"""configs/README.md lists every training recipe under configs/, so a new or renamed config cannot
go unlisted (tests/test_training.py loads each one)."""

from pathlib import Path

import pytest

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
RECIPES = sorted(CONFIGS.glob("*.yaml"))


def test_there_are_recipes():
    assert {"default.yaml", "tiny.yaml", "spec.yaml"} <= {p.name for p in RECIPES}


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_a_recipe_is_listed(path):
    assert path.name in (CONFIGS / "README.md").read_text(), f"configs/README.md does not list {path.name}"


def test_the_sweep_files_are_listed():
    assert "configs/sweep/*.yaml" in (CONFIGS / "README.md").read_text()
