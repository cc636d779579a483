"""Object names in the docs follow the release (issue 31: docs said `<release>-gateway` where a
release `lens` makes `lens-gpulens-gateway`): every `<fullname>-X` the docs name is an object the
chart renders under a non-default release name, and the examples of names the docs give are
what the chart makes."""

from __future__ import annotations

import re

import pytest

from .chart import REPO, render
from .value_sets import EVERYTHING

DOCS = [REPO / "docs" / "kubernetes.md", REPO / "docs" / "metrics.md", REPO / "README.md",
        REPO / "helm" / "gpulens" / "README.md"]


def _names(release: str) -> set[str]:
    """Object names of the defaults (which generate the tokens Secret) and of everything switched on."""
    return {o["metadata"]["name"] for values in ({}, EVERYTHING) for o in render(values, name=release)}


def test_every_fullname_object_in_the_docs_exists_under_another_release_name():
    names = _names("lens")
    mentioned = {m for doc in DOCS for m in re.findall(r"<fullname>-([a-z][a-z-]*[a-z])", doc.read_text())}
    assert mentioned >= {"gateway", "tokens", "operator", "node"}
    assert {f"lens-gpulens-{m}" for m in mentioned} <= names


@pytest.mark.parametrize("release, prefix", [("lens", "lens-gpulens"), ("gpulens", "gpulens"),
                                             ("gpulens-prod", "gpulens-prod")])
def test_the_documented_naming_rule(release, prefix):
    names = _names(release)
    assert {f"{prefix}-gateway", f"{prefix}-tokens"} <= names
    text = (REPO / "docs" / "kubernetes.md").read_text()
    if release == "lens":
        assert "`lens-gpulens-gateway`" in text and "`lens-gpulens-tokens`" in text


def test_no_doc_names_objects_by_the_bare_release():
    for doc in DOCS:
        assert not re.findall(r"<release>-(?!gpulens)", doc.read_text()), doc
