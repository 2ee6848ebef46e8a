"""The written form of every measurement, generated from its JSON: ``python -m ilcp_experiments report``.

docs/results/ holds one folder per experiment; its JSON files are the data, and everything else
written there is generated from them:

- each folder's ``README.md`` (how the measurement was made, the hand-written notes.md, the tables
  and plots), ``results.md`` beside every eval results.json and ``sweep.md`` beside every
  sweep.json, and ``docs/results/README.md``, the index (`folders`);
- the blocks between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->`` of the repository's README.md
  (``results``: the results at a glance) and of the pages of docs/ (``babilong`` in docs/long-contexts.md,
  ``served`` in docs/serving.md; ``datasets`` and ``general`` wherever a page holds their markers), the
  pages ``docs/results/babilong.md`` and ``docs/results/general.md`` and the figures (`blocks`);
- `report`: the list of every generated file (`generated`), the files that differ from it (`stale`,
  which tests/test_results_docs.py asserts is empty), `write` and the command line.
"""

from .babilong import babilong_block, babilong_targets, draw_babilong
from .blocks import GLANCE, datasets_block, draw_at_a_glance, glance_rows, glance_table, served_block
from .general import GENERAL_FOLDER, draw_general, general_block
from .folders import RESULTS_DIR, experiment_folders, folder_readme, replace_block
from .report import generated, main, stale, write

__all__ = ["GENERAL_FOLDER", "GLANCE", "RESULTS_DIR", "babilong_block", "babilong_targets", "datasets_block", "draw_at_a_glance",
           "draw_babilong", "draw_general", "experiment_folders", "general_block", "folder_readme", "generated", "glance_rows", "glance_table", "main",
           "replace_block", "served_block", "stale", "write"]
