"""The README's first commands are the ones that work: right image tag, the test command CI runs."""

import ast
import re
import tomllib
from pathlib import Path

import pytest

from dsa_image.core.recipe import load_recipe

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def code_lines() -> list[str]:
    return [line.strip() for line in README.splitlines() if line.startswith("    ")]


def test_the_first_command_builds_and_serves_the_recipes_sm120_image():
    recipe = load_recipe()
    first = code_lines()[0]
    assert first.startswith("docker buildx bake sm120 && docker run ")
    assert f"dsa-image:{recipe.vllm_version}-sm120" in first


def test_every_image_tag_in_the_readme_is_the_recipes_version():
    version = load_recipe().vllm_version
    tags = re.findall(r"dsa-image:([0-9][^\s-]*)-sm\d+", README)
    assert tags and set(tags) == {version}  # the default base's: what the plain targets build


def test_the_second_command_is_the_one_ci_runs():
    assert code_lines()[1] == "python3 scripts/test.py"
    assert "python3 scripts/test.py" in (REPO / ".ci" / "run").read_text()


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: made from the rendered text (a link's text, not
    its target)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    return {_slug(line.lstrip("#")) for line in markdown.splitlines() if line.startswith("#")}


def test_right_under_the_first_command_hosts_without_registry_bridge_or_direct_tls_are_pointed_to_the_docs():
    after = README.split(code_lines()[0], 1)[1].lstrip("\n")
    note = after.split("\n\n", 1)[0]
    assert not note.startswith("    "), "the next paragraph after the first command must be the note"
    for needed in ("BASE_IMAGE", "BUILD_NETWORK=host", "--allow network.host", "PIP_CA", "network bridge not found",
                   "TLS-intercepting proxy", "python3 scripts/preflight.py"):
        assert needed in note, needed
    links = re.findall(r"\]\((docs/image\.md)#([^)]+)\)", note)
    assert links, "no link to a section of docs/image.md"
    image_md = (REPO / "docs" / "image.md").read_text()
    for path, anchor in links:
        assert anchor in anchors(image_md), f"{path}#{anchor}: no such section"
    section = image_md.split("## Hosts without a registry, a bridge or direct TLS", 1)[1].split("\n## ", 1)[0]
    for needed in ("network bridge not found", "--allow network.host", "PIP_CA", "--allow fs.read",
                   "BASE_IMAGE=dsa-image-base:bookworm", "scripts/bootstrap_base_image.sh", "scripts/preflight.py"):
        assert needed in section, needed
    assert (REPO / "scripts" / "preflight.py").is_file()


def test_docs_say_how_to_get_docker_and_buildx_and_the_hints_point_there():
    image_md = (REPO / "docs" / "image.md").read_text()
    assert "getting-docker-and-buildx" in anchors(image_md)
    section = image_md.split("## Getting Docker and buildx", 1)[1].split("\n## ", 1)[0]
    assert "scripts/install_docker.sh" in section and "docker buildx version" in section
    from dsa_image.build import image_build
    for link in (image_build.DOCKER_DOCS, image_build.HOST_DOCS):
        path, anchor = link.split("#")
        assert anchor in anchors((REPO / path).read_text()), link
    assert "Getting Docker\n# and buildx" in (REPO / "scripts" / "install_docker.sh").read_text()


# The files a user reads or runs: none may send them to a path on the machine this was made on.
USER_FACING = ["README.md", "docs/**/*.md", "docs/**/*.txt", "Dockerfile", "docker-bake.hcl", ".ci/run",
               "scripts/*", "dsa_image/**/*.py", "tests/*.py", "emulation/**/*.py", "overlay/**/*.toml"]


def test_no_development_machine_path_in_the_files_users_read_or_run():
    found = []
    for pattern in USER_FACING:
        for path in sorted(REPO.glob(pattern)):
            if path.is_file() and path != Path(__file__).resolve():  # this file holds the pattern
                text = path.read_text(errors="replace")
                found += [f"{path.relative_to(REPO)}: {m.group(0)}" for m in re.finditer(r"(?<![\w.])/work/\S*|(?<![\w.])(?:\.\./)?shared/(?:reference|env|style)\S*", text)]
    assert found == []


def _relative_links(markdown: str) -> list[str]:
    links = re.findall(r"\]\(([^)\s]+)\)", markdown)
    return [link for link in links if not re.match(r"[a-z]+:", link)]


def test_every_relative_link_in_the_docs_names_a_file_and_section_that_exist():
    """The validation records link to each other's sections by anchor; a renamed heading or a
    moved record must fail here, not in a reader's browser."""
    broken = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]:
        for link in _relative_links(doc.read_text()):
            path, _, anchor = link.partition("#")
            target = (doc.parent / path).resolve() if path else doc
            if not target.exists():
                broken.append(f"{doc.relative_to(REPO)}: {link} (no {path})")
            elif anchor and target.suffix == ".md" and anchor not in anchors(target.read_text()):
                broken.append(f"{doc.relative_to(REPO)}: {link} (no section #{anchor})")
    assert not broken, "\n".join(broken)


def test_the_readme_points_to_the_b12x_section():
    assert "docs/image.md#the-b12x-indexer-and-its-variables-sm120-image" in README
    assert "the-b12x-indexer-and-its-variables-sm120-image" in anchors(B12X_DOC.read_text())


# -- the b12x section: every variable, version and default it names is an image's own ---------
# Facts come from the recipe and each base's overlay source (its b12x module's constants and
# functions); tests/test_b12x_api.py ties those constants to the pinned b12x wheels.

# The section lives in docs/image.md (the README points there); it is that doc's level-2 section.
B12X_DOC = REPO / "docs" / "image.md"
B12X_SECTION = "\n## The b12x indexer and its variables"
ENV_NAME = re.compile(r"\b(?:VLLM|B12X)_[A-Z0-9_]+\b")
RELEASE = re.compile(r"\b\d+\.\d+\.(?:\d+|x)\b")  # 1.5.1, 1.5.x; not compute capability 12.0


def _b12x_items() -> list[str]:
    """The section's paragraphs and list items, each on one line."""
    section = B12X_DOC.read_text().split(B12X_SECTION, 1)[1].split("\n## ", 1)[0].split("\n", 1)[1]
    return [" ".join(item.split()) for item in re.split(r"\n(?=- )|\n\n", section) if item.strip()]


def _b12x_module(version: str) -> tuple[str, dict]:
    from dsa_image.build import b12x_api
    from dsa_image.overlay import cli as overlay
    source = (overlay.overlay_dir(version) / b12x_api.OVERLAY_MODULE).read_text()
    return source, b12x_api.module_constants(source)


def _base_facts(base) -> tuple[set[str], set[str]]:
    """(variables its overlay names, versions and release lines of its image)."""
    from dsa_image.overlay import cli as overlay
    sources = "".join(path.read_text() for path in sorted(overlay.overlay_dir(base.vllm_version).rglob("*.py")))
    _, constants = _b12x_module(base.vllm_version)
    releases = constants.get("SUPPORTED_RELEASES") or (constants["SUPPORTED_RELEASE"],)
    b12x = next(e for e in base.targets["sm120"].extras if e.name == "b12x").version
    return set(ENV_NAME.findall(sources)), {base.vllm_version, b12x, *(f"{a}.{b}.x" for a, b in releases)}


def _items_by_base() -> dict[str, list[str]]:
    """Each item under the base it speaks of: another base's when it names that base's vLLM
    version or bake suffix (both bases' when it names the default's too), else the default's."""
    from dsa_image.core.recipe import load_every_base
    default = load_recipe().vllm_version
    by_base: dict[str, list[str]] = {base.vllm_version: [] for base in load_every_base()}
    for item in _b12x_items():
        named = [v for v in by_base if v != default and (v in item or f"vllm{v.replace('.', '_')}" in item)]
        for version in named + ([default] if not named or default in item else []):
            by_base[version].append(item)
    return by_base


def test_every_variable_and_version_the_b12x_section_names_is_its_images_own():
    from dsa_image.core.recipe import load_every_base
    bases = {base.vllm_version: base for base in load_every_base()}
    by_base = _items_by_base()
    wrong = []
    for item in _b12x_items():
        speaks_of = [v for v, items in by_base.items() if item in items]
        facts = [_base_facts(bases[v]) for v in speaks_of]
        known_names = set().union(*(names for names, _ in facts))
        known_versions = set().union(*(versions for _, versions in facts))
        wrong += [f"{name} (not in the overlay of vLLM {'/'.join(speaks_of)}): {item[:80]}"
                  for name in ENV_NAME.findall(item) if name not in known_names]
        wrong += [f"{release} (not a version of the vLLM {'/'.join(speaks_of)} image): {item[:80]}"
                  for release in RELEASE.findall(item) if release not in known_versions]
    assert wrong == []
    for version, base in bases.items():
        _, versions = _base_facts(base)
        b12x = next(e for e in base.targets["sm120"].extras if e.name == "b12x").version
        assert any(b12x in item for item in by_base[version]), f"the b12x pin of vLLM {version} ({b12x})"


def _overlay_functions(source: str, constants: dict, *names: str) -> dict:
    """Pure functions of an overlay module, run from its source (the module imports torch and
    vLLM), with its constants as globals."""
    tree = ast.parse(source)
    wanted = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in names]
    namespace = dict(constants)
    exec(compile(ast.Module(body=wanted, type_ignores=[]), "<overlay>", "exec"), namespace)
    return {name: namespace[name] for name in names}


def test_the_b12x_section_names_the_default_images_variables_and_defaults():
    recipe = load_recipe()
    text = " ".join(_items_by_base()[recipe.vllm_version])
    source, constants = _b12x_module(recipe.vllm_version)
    refused = {ast.literal_eval(key) for node in ast.parse(source).body if isinstance(node, ast.Assign)
               and getattr(node.targets[0], "id", "") == "IGNORED_VARIABLES" for key in node.value.keys}
    assert refused, "the overlay's IGNORED_VARIABLES"
    for name in (constants["SWITCH_VARIABLE"], constants["SUPERTILE_VARIABLE"], *refused):
        assert f"`{name}`" in text, name
    supertile = text.split(f"`{constants['SUPERTILE_VARIABLE']}` (", 1)[1]
    assert f"default {constants['SUPERTILE_DEFAULT']}, rounded up to a multiple of {constants['SUPERTILE_ALIGNMENT']}" \
        in supertile
    major, minor = constants["SUPPORTED_RELEASE"]
    b12x = next(e for e in recipe.targets["sm120"].extras if e.name == "b12x").version
    assert f"other than {major}.{minor}.x (the image pins {b12x})" in text
    # the rows per prefill chunk, from the overlay's own functions at the defaults named
    budget_mb = int(re.search(r"`VLLM_SPARSE_INDEXER_MAX_LOGITS_MB` \(default (\d+)\)", text).group(1))
    topk = tomllib.loads((REPO / "recipes" / "models" / "glm-5.toml").read_text())["config"]["index_topk"]
    rows = _overlay_functions(source, constants, "prefill_row_bytes", "prefill_rows_per_chunk")[
        "prefill_rows_per_chunk"](constants["SUPERTILE_DEFAULT"], topk, budget_mb * 1024 * 1024)
    assert f"{rows:,} rows per prefill chunk at the defaults" in text, rows


@pytest.mark.wheel
def test_the_logits_budget_the_b12x_section_names_is_the_pinned_vllms_default():
    from dsa_image.core import wheels
    recipe = load_recipe()
    wheel = recipe.wheel("amd64")
    envs = wheels.read_member(wheels.ensure_wheel(wheel.filename, wheel.sha256), "vllm/envs.py").decode()
    default = re.search(r'"VLLM_SPARSE_INDEXER_MAX_LOGITS_MB", "(\d+)"', envs).group(1)
    assert f"`VLLM_SPARSE_INDEXER_MAX_LOGITS_MB` (default {default})" in " ".join(_b12x_items())


# -- CI and disk figures: each one said with the run that measured it -------------------------

FIGURE = re.compile(r"\b\d[\d,.]*\s?(?:GB|min|s)\b|\b\d[\d,]* (?:passed|skipped|tests)\b")
NAMES_A_RUN = re.compile(r"20\d\d-\d\d-\d\d.*`[0-9a-f]{7,40}`.*`bash \.ci/run[^`]*`", re.S)


def _ci_paragraphs() -> list[str]:
    image_md = (REPO / "docs" / "image.md").read_text()
    section = image_md.split("## CI: `.ci/run`\n", 1)[1].split("\n## ", 1)[0]
    return [p for p in section.split("\n\n") if p.strip() and not p.startswith("#")]


def test_every_ci_figure_in_the_docs_says_which_run_measured_it():
    """A figure comes from a run someone made: a paragraph of docs/image.md's CI section with a
    count, a time or a size names its run (date, commit, `bash .ci/run`), or is about "that run"
    right after one that does."""
    named = False
    for paragraph in _ci_paragraphs():
        if FIGURE.search(paragraph):
            named = bool(NAMES_A_RUN.search(paragraph)) or (named and "that run" in paragraph)
            assert named, f"figures without their run: {paragraph[:160]}"


def test_the_readme_says_what_disk_a_build_needs_as_the_recorded_run_measured_it():
    paragraph = next(p for p in README.split("\n\n") if "disk where Docker keeps its data" in p)
    figures = re.findall(r"\b\d[\d.]* GB\b", paragraph)
    disk = (REPO / "docs" / "image.md").read_text().split("### Disk\n", 1)[1].split("\n## ", 1)[0]
    assert len(figures) >= 3 and all(figure in disk for figure in figures), (figures, disk)
    assert "docs/image.md#disk" in paragraph


# -- the README's shape: short, for users, in the order a new user needs it ---------------------

README_MAX_LINES = 200
# Words of the README's level-2 headings, in the order they must come.
README_SECTIONS = ["Quick start", "Prerequisites", "Build", "Serve the built-in", "Serve a real model",
                   "Verify", "What was proven", "Develop"]


def test_the_readme_is_at_most_200_lines():
    assert len(README.splitlines()) <= README_MAX_LINES


def test_the_readmes_sections_come_in_the_order_a_new_user_needs_them():
    headings = [line[3:] for line in README.splitlines() if line.startswith("## ")]
    assert len(headings) == len(README_SECTIONS), headings
    for heading, words in zip(headings, README_SECTIONS, strict=True):
        assert heading.startswith(words), (heading, words)


def test_the_readme_has_one_table_of_what_was_proven_each_row_linking_its_record():
    section = README.split("\n## What was proven\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| claim ")]
    assert rows
    tables = [block for block in section.split("\n\n") if block.lstrip().startswith("|")]
    assert len(tables) == 1, "one table"
    for row in rows:
        assert re.search(r"\]\(docs/(?:validation|benchmarks)/[^/)]+/README\.md\)", row), row
