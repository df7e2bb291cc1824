"""vLLM's own tests as the overlay's gate: select, bundle, run per file, compare stock with overlay.

A base's pinned sdist (`[vllm."X".sdist]` in the recipe, fetched and re-hashed by
dsa_image.core.wheels) ships vLLM's `tests/`. From it, one stage per module:

* **select** (`dsa_image.upstream.selection`): the test files that import an overlaid module
  (the base's manifest entries: vllm/a/b.py -> vllm.a.b), by import analysis of every import
  anywhere in the file, and the support files collecting them needs (conftests, packages,
  tests-local modules, transitively).
* **bundle** (`dsa_image.upstream.bundle`): just those files, extracted into a small directory
  with `bundle.json` (the sdist, the overlaid modules, the selection and why, each file's
  sha256, the third-party modules each selected file needs at import) and the upstream-tests
  lock's packages.
* **run** (`dsa_image.upstream.run`): each selected file in its own pytest process against one
  site, junit XML per file, a timeout per file; a file whose import needs a module the site
  lacks is not run, and the result says which. `dsa_image.upstream.recorder`, a plugin in each
  of those processes, records every test as it ends, so a file longer than its timeout goes on
  in parts (deselecting what finished), across calls, and a file of many slow tests can run in
  shards, processes at once that share its tests out by node id.
* **compare** (`dsa_image.upstream.compare`): a stock run and an overlaid run of the same
  bundle, test by test. The rule: no test that passes (or is skipped) on stock may fail,
  error, be skipped (if it passed) or be missing on the overlay; a test failing on both is
  listed, not fixed.

This module is the gate's face: the names `scripts/upstream_tests.py` and the tests use, from
the stage that defines each. Stdlib only (it runs in a bare build stage and against any site).
"""

from __future__ import annotations

from dsa_image.upstream.bundle import Bundle, lib_requirements, load_bundle, make_bundle, pinned_sdist, read_sdist, selection_doc, write_bundle
from dsa_image.upstream.compare import compare_runs, comparison_doc, file_outcomes, format_comparison, is_regression, junit_outcomes, junit_results, node_id
from dsa_image.upstream.recorder import one_line
from dsa_image.upstream.run import CRASHED, RUN_FILE, RUN_SCHEMA, SIDES, TIMEOUT, Progress, Shard, Site, forget_files, junit_name, load_run, read_record, record_path, run_tasks
from dsa_image.upstream.selection import Selected, Selection, UpstreamTestsError, UpstreamTree, loads_module, overlaid_modules, select

__all__ = [
    # selection
    "Selected", "Selection", "UpstreamTestsError", "UpstreamTree", "loads_module", "overlaid_modules", "select",
    # bundle
    "Bundle", "lib_requirements", "load_bundle", "make_bundle", "pinned_sdist", "read_sdist", "selection_doc",
    "write_bundle",
    # run
    "CRASHED", "RUN_FILE", "RUN_SCHEMA", "SIDES", "TIMEOUT", "Progress", "Shard", "Site", "forget_files", "junit_name",
    "load_run",
    "read_record", "record_path", "run_tasks",
    # recorder
    "one_line",
    # compare
    "compare_runs", "comparison_doc", "file_outcomes", "format_comparison", "is_regression", "junit_outcomes",
    "junit_results", "node_id",
]
