"""The docs hold together: every relative link in README.md, CONTRIBUTING.md and docs/ resolves.

A link `[text](path)` or `![alt](path)` must name a file or directory of the repository
(relative to the page it is on), and a `#fragment` must name a heading of the page it points to,
spelled as GitHub spells heading anchors. A repository path a page names in backticks
(`trio_pd/pd/attempt.py`, `tests/conftest.py`, `docs/flags.md`...) must exist too: that is how a
page notices a module that moved. Links inside code blocks and spans are code, not links. And
docs/architecture.md's two trees name exactly the packages and modules of `trio_pd/` and of the
test engines' `testing/trio_pd_testing/`.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FRONT = (ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "bench" / "README.md")
PAGES = sorted([*FRONT, *(ROOT / "docs").rglob("*.md")])
LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(([^()\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")
CODE_SPAN = re.compile(r"`[^`\n]+`")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
# Backticked paths below these top-level folders are the repository's own files.
REPO_DIRS = ("trio_pd/", "testing/", "tests/", "bench/", "docs/")
# Made by a run, not in the repository (git-ignored), named bare or as a folder.
GENERATED = ("bench/results", "bench/.peers")


def prose_lines(text: str) -> list[str]:
    """The page's lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def links(page: Path) -> list[str]:
    found = []
    for line in prose_lines(page.read_text()):
        found += LINK.findall(CODE_SPAN.sub("", line))
    return found


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`([^`]*)`", r"\1", heading).lower()
    return "".join(c for c in text if c.isalnum() or c in "-_ ").replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    result = set()
    for line in prose_lines(page.read_text()):
        match = HEADING.match(line)
        if match is None:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return result


def dangling(page: Path) -> list[str]:
    problems = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path_part, _, fragment = target.partition("#")
        resolved = (page.parent / path_part).resolve() if path_part else page
        if not resolved.exists():
            problems.append(f"{target}: no such file")
        elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
            problems.append(f"{target}: no heading #{fragment} in {resolved.name}")
    return problems


def named_paths(page: Path) -> list[str]:
    """Repository paths the page names in backticks, outside code blocks."""
    paths = []
    for line in prose_lines(page.read_text()):
        for span in CODE_SPAN.findall(line):
            text = span.strip("`")
            if (
                text.startswith(REPO_DIRS)
                and not text.startswith(GENERATED)
                and re.fullmatch(r"[\w./-]+", text)
            ):
                paths.append(text)
    return paths


def test_the_pages_are_found() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in PAGES}
    assert {"README.md", "CONTRIBUTING.md", "docs/protocol.md", "docs/flags.md"} <= names
    assert sum(len(links(p)) for p in PAGES) > 50


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page: Path) -> None:
    assert dangling(page) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_named_repository_path_exists(page: Path) -> None:
    missing = [p for p in named_paths(page) if not (ROOT / p).exists()]
    assert missing == []


def test_a_dangling_link_and_a_moved_module_are_caught(tmp_path: Path) -> None:
    """The checks can fail: a page with a link to nothing, a link to a heading that is not
    there, and a module that does not exist."""
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n\n[gone](nowhere.md) [self](#title) [bad](#no-such-heading)\n"
        "`trio_pd/no_such_module.py`\n```\n[in code](nowhere-either.md)\n```\n"
    )
    assert dangling(page) == [
        "nowhere.md: no such file",
        "#no-such-heading: no heading #no-such-heading in page.md",
    ]
    assert named_paths(page) == ["trio_pd/no_such_module.py"]


def test_the_slugs_are_githubs() -> None:
    assert slug("4. What each leg's end means (the outcome table)") == (
        "4-what-each-legs-end-means-the-outcome-table"
    )
    assert slug("Sticky sessions (`manual`)") == "sticky-sessions-manual"
    assert slug("`--workers N` with etcd or Kubernetes") == "--workers-n-with-etcd-or-kubernetes"


def architecture_tree(top: str) -> set[str]:
    """The paths the tree of docs/architecture.md that starts at `top` names (`top/...`; a folder
    ends with /)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text[text.index(f"```\n{top}\n") + 4 :]
    block = block[: block.index("```")]
    names: set[str] = set()
    stack: list[str] = []
    for line in block.splitlines():
        depth = (len(line) - len(line.lstrip(" "))) // 2
        name = line.split()[0]
        stack[depth:] = [name]
        names.add("".join(stack))
    return names


def package_tree(package: Path, opaque: tuple[str, ...] = ()) -> set[str]:
    """The package's modules and subpackages as a tree names them (`name/...`), the insides of
    the subpackages in `opaque` excepted: they have pages of their own."""
    top = package.name + "/"
    actual = {top}
    for path in package.rglob("*.py"):
        relative = path.relative_to(package.parent)
        if len(relative.parts) > 2 and relative.parts[1] in opaque:
            continue
        if path.name != "__init__.py":
            actual.add(relative.as_posix())
        if path.parent != package:
            actual.add(path.parent.relative_to(package.parent).as_posix() + "/")
    actual |= {f"{top}{name}/" for name in opaque}
    actual.discard(f"{top}__init__.py")
    return actual


def test_the_architecture_tree_is_the_package() -> None:
    """Every package and module of trio_pd/ has its line in docs/architecture.md, and every
    line names one that exists."""
    assert architecture_tree("trio_pd/") == package_tree(ROOT / "trio_pd")


def test_the_test_engines_tree_is_their_package() -> None:
    """The same for the test engines' package (the simulator's and the SGLang and vLLM
    launchers' insides excepted: they have pages of their own)."""
    package = ROOT / "testing" / "trio_pd_testing"
    expected = package_tree(package, opaque=("engine", "sglang", "vllm"))
    assert "trio_pd_testing/engine/" in expected and "trio_pd_testing/cli.py" in expected
    assert architecture_tree("trio_pd_testing/") == expected
