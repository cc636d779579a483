"""Which kernel headers bcc gets: the host's when present, else the image's bundled tree.

The real compile against the bundled tree, in a container without the host's /lib/modules, is
tests/container/test_exporter_container.py.
"""

from pathlib import Path

from gpulens.exporter.kheaders import choose

REL = "6.18.0-test"


def tree(root: Path) -> Path:
    (root / "include/linux").mkdir(parents=True)
    (root / "include/linux/kconfig.h").write_text("/* */\n")
    return root


def test_host_build_and_source_wins_over_bundled(tmp_path):
    mods = tmp_path / "modules"
    tree(mods / REL / "source")
    (mods / REL / "build").mkdir()
    bundled = tree(tmp_path / "bundled")
    got = choose(REL, {"GPULENS_KERNEL_HEADERS": str(bundled)}, modules_dir=mods,
                 kheaders_tar=tmp_path / "none.tar.xz")
    assert (got.origin, got.path) == ("host", str(mods / REL / "source"))
    assert "BCC_KERNEL_SOURCE" not in got.env


def test_host_build_only(tmp_path):
    mods = tmp_path / "modules"
    tree(mods / REL / "build")
    got = choose(REL, {}, modules_dir=mods, kheaders_tar=tmp_path / "none")
    assert (got.origin, got.path, dict(got.env)) == ("host", str(mods / REL / "build"), {})


def test_leftover_dirs_without_headers_fall_back_to_bundled(tmp_path):
    mods = tmp_path / "modules"
    (mods / REL / "build/include").mkdir(parents=True)    # a build dir with no headers in it
    (mods / REL / "source").mkdir()
    bundled = tree(tmp_path / "bundled")
    got = choose(REL, {"GPULENS_KERNEL_HEADERS": str(bundled)}, modules_dir=mods,
                 kheaders_tar=tmp_path / "none")
    assert got.origin == "bundled"
    assert dict(got.env) == {"BCC_KERNEL_SOURCE": str(bundled)}


def test_other_release_headers_do_not_count(tmp_path):
    mods = tmp_path / "modules"
    tree(mods / "6.1.0-57-amd64" / "build")
    got = choose(REL, {}, modules_dir=mods, kheaders_tar=tmp_path / "none")
    assert (got.origin, got.path, dict(got.env)) == ("none", None, {})


def test_kernel_archive_before_bundled(tmp_path):
    tar = tmp_path / "kheaders.tar.xz"
    tar.write_bytes(b"\xfd7zXZ\x00")
    bundled = tree(tmp_path / "bundled")
    got = choose(REL, {"GPULENS_KERNEL_HEADERS": str(bundled)}, modules_dir=tmp_path / "m", kheaders_tar=tar)
    assert (got.origin, dict(got.env)) == ("kheaders", {})


def test_bundled_path_without_headers_is_not_used(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    got = choose(REL, {"GPULENS_KERNEL_HEADERS": str(empty)}, modules_dir=tmp_path / "m",
                 kheaders_tar=tmp_path / "none")
    assert got.origin == "none" and "BCC_KERNEL_SOURCE" not in got.env
    assert got.describe() == "none"


def test_explicit_bcc_kernel_source_is_respected(tmp_path):
    mods = tmp_path / "modules"
    tree(mods / REL / "build")
    got = choose(REL, {"BCC_KERNEL_SOURCE": "/custom"}, modules_dir=mods)
    assert (got.origin, got.path, dict(got.env)) == ("env", "/custom", {})
