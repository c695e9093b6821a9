"""The docs say what the code does (issue 22, item 9): the protocol's additions to sglang's API are
all named, the README's layout has every package and only paths that exist, no doc points at one
machine's folders, and `p2pweights doctor` reads sglang's version as both sides do."""
from __future__ import annotations

import pathlib
import re

import pytest

from p2pweights.control import protocol, routes

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "python" / "p2pweights"


def _section(text: str, first_line: str) -> str:
    """The lines from the one starting with ``first_line`` up to the next blank line."""
    start = text.index(first_line)
    end = text.find("\n\n", start)
    return text[start:] if end < 0 else text[start:end]


def test_the_protocol_doc_names_every_addition_to_sglangs_api():
    """docs/protocol.md says the control plane is sglang's own API plus a table of additions: every
    route only a receiver serves, every X-P2PW- header and every ``p2pw_`` body key is in that table."""
    table = _section((ROOT / "docs" / "protocol.md").read_text(), "| addition |")
    additions = [*sorted(routes.OWN_PATHS), routes.RANK_ROUTE_PREFIX,
                 *(v for k, v in vars(protocol).items() if k.endswith("_HEADER") and isinstance(v, str)),
                 protocol.END_FOLDS, protocol.END_THEN, protocol.TIMINGS_KEY]
    assert len(additions) > 6  # the routes, three headers and the markers were all found
    missing = [a for a in additions if a not in table]
    assert not missing, f"docs/protocol.md's table of additions to sglang's API lacks: {missing}"


def _readme_layout_paths() -> list[str]:
    """The paths of the README layout table's first column; a bare name (``errors.py`` after
    ``python/p2pweights/settings.py``) is in the folder of the path before it."""
    section = (ROOT / "README.md").read_text().split("## Layout", 1)[1].split("\n## ", 1)[0]
    paths = []
    for row in re.findall(r"^\|([^|]+)\|", section, re.M):
        folder = ""
        for p in re.findall(r"`([^`]+)`", row):
            p = p if "/" in p.rstrip("/") else folder + p
            folder = p[: p.rstrip("/").rfind("/") + 1]
            paths.append(p)
    return paths


def test_the_readme_layout_names_every_package_and_only_paths_that_exist():
    paths = _readme_layout_paths()
    assert "python/p2pweights/copyplans/" in paths and "python/p2pweights/errors.py" in paths, paths
    missing = [p for p in paths if not any(ROOT.glob(p.rstrip("/")))]
    assert not missing, f"README's layout names paths that do not exist: {missing}"
    packages = sorted(f"python/p2pweights/{d.name}/" for d in PKG.iterdir()
                      if d.is_dir() and (d / "__init__.py").is_file())
    unlisted = [p for p in packages if p not in paths]
    assert not unlisted, f"README's layout lacks packages: {unlisted}"


def test_the_architecture_doc_draws_every_package_in_its_layer():
    text = (ROOT / "docs" / "architecture.md").read_text()
    diagram = text.split("```", 2)[1]
    packages = sorted(d.name for d in PKG.iterdir() if d.is_dir() and (d / "__init__.py").is_file())
    assert "copyplans" in packages and "copyplans/" in diagram  # the packages and the diagram were found
    undrawn = [p for p in packages if f"{p}/" not in diagram]
    assert not undrawn, f"docs/architecture.md's diagram lacks packages: {undrawn}"
    unlisted = [p for p in packages if f"| `{p}/` |" not in text]
    assert not unlisted, f"docs/architecture.md's table of packages lacks: {unlisted}"


@pytest.mark.parametrize("doc", sorted(p.name for p in (ROOT / "docs").glob("*.md")) + ["README.md"])
def test_no_doc_points_at_one_machines_folders(doc):
    path = ROOT / doc if doc == "README.md" else ROOT / "docs" / doc
    found = re.findall(r"(?<![\w.])(/work/\S*|/home/\S*|/root/\S*|\.\./shared/\S*)", path.read_text())
    assert not found, f"{doc} names folders outside the repository: {found}"


def test_doctor_reports_the_sglang_version_both_sides_read(monkeypatch):
    """One lookup of sglang's version (models/sglang_version.py), for the replica key, the build
    check, the receiver's report and doctor alike; a source tree that fails to import is reported."""
    from p2pweights.commands import doctor
    from p2pweights.models import sglang_version as sv

    monkeypatch.setattr(sv, "sglang_version", lambda: "0.0.0-from-the-one-lookup")
    assert doctor.collect()["sglang"] == "0.0.0-from-the-one-lookup"

    def broken() -> str:
        raise ImportError("a broken source tree")

    monkeypatch.setattr(sv, "sglang_version", broken)
    assert "a broken source tree" in doctor.collect()["sglang"]
