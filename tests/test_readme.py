"""The README's first commands are the ones that work: right image tag, the test command CI runs."""

import re
from pathlib import Path

from dsa_image.recipe import load_recipe

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
    from dsa_image import image_build
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
