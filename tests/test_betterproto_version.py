"""betterproto2's version without importlib.metadata (jobsignal/betterproto_version.py).

It must give betterproto2 the version importlib.metadata would, enforce the
same compiler rule, and step aside wherever the version is not certain.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

from jobsignal import betterproto_version

ROOT = Path(__file__).resolve().parent.parent

FRESH_IMPORT = """
import json, sys
import jobsignal, betterproto2
loaded = "importlib.metadata" in sys.modules
stand_in = getattr(sys.modules["betterproto2._version"], "__file__", None) is None
import importlib.metadata
print(json.dumps({
    "metadata_loaded": loaded,
    "stand_in": stand_in,
    "version": betterproto2.__version__,
    "metadata_version": importlib.metadata.version("betterproto2"),
}))
"""


def test_a_fresh_import_gives_betterproto2_its_version_without_importlib_metadata() -> None:
    done = subprocess.run(
        [sys.executable, "-c", FRESH_IMPORT],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    report = json.loads(done.stdout)
    assert report["metadata_loaded"] is False
    assert report["stand_in"] is True
    assert report["version"] == report["metadata_version"]


def betterproto2_own_version_module() -> types.ModuleType:
    """betterproto2's real `_version`, loaded from its file under another name."""
    package = importlib.util.find_spec("betterproto2")
    assert package is not None and package.submodule_search_locations
    path = Path(package.submodule_search_locations[0]) / "_version.py"
    spec = importlib.util.spec_from_file_location("betterproto2_own_version", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "compiler_version", ["0.10.0", "0.10.1", "0.10.97", "0.9.0", "0.11.0", "1.10.0", "0.1.10"]
)
def test_the_compiler_check_agrees_with_betterproto2s_own(compiler_version: str) -> None:
    own = betterproto2_own_version_module()
    stand_in = betterproto_version.version_module(own.__version__)
    assert stand_in.__version__ == own.__version__ == importlib.metadata.version("betterproto2")

    def refused(check: types.ModuleType) -> bool:
        try:
            check.check_compiler_version(compiler_version)
        except ImportError:
            return True
        return False

    assert refused(stand_in) == refused(own)


def test_a_refused_compiler_version_says_which_versions_disagree() -> None:
    stand_in = betterproto_version.version_module("0.10.0")
    with pytest.raises(ImportError) as refused:
        stand_in.check_compiler_version("0.11.2")
    assert "betterproto2_compiler 0.11.2, which needs betterproto2 0.11.x" in str(refused.value)
    assert "betterproto2 0.10.0 is installed" in str(refused.value)


def dist_info(site: Path, name: str, metadata: bytes | None) -> None:
    directory = site / name
    directory.mkdir()
    if metadata is not None:
        (directory / "METADATA").write_bytes(metadata)


HEADERS = b"Metadata-Version: 2.4\nName: betterproto2\nVersion: 0.10.0\n\nVersion: 9.9.9\n"


def test_the_version_is_the_header_of_the_one_dist_info(tmp_path: Path) -> None:
    dist_info(tmp_path, "betterproto2-0.10.0.dist-info", HEADERS)
    dist_info(tmp_path, "betterproto2_compiler-0.10.1.dist-info", HEADERS.replace(b"0.10.0", b"x"))
    assert betterproto_version.installed_version(str(tmp_path)) == "0.10.0"


@pytest.mark.parametrize(
    ("dist_infos", "why"),
    [
        ([], "no dist-info"),
        ([("betterproto2_compiler-0.10.1.dist-info", HEADERS)], "only the compiler's"),
        (
            [
                ("betterproto2-0.10.0.dist-info", HEADERS),
                ("betterproto2-0.9.0.dist-info", HEADERS),
            ],
            "two installs",
        ),
        ([("betterproto2-0.10.0.dist-info", None)], "no METADATA"),
        ([("betterproto2-0.10.0.dist-info", b"Name: betterproto2\n\nVersion: 1\n")], "in body"),
        ([("betterproto2-0.10.0.dist-info", b"Name: betterproto2\nVersion:\n")], "empty"),
        ([("betterproto2-0.10.0.dist-info", b"Name: \xff\nVersion: 0.10.0\n")], "not UTF-8"),
    ],
)
def test_no_version_where_it_is_not_certain(
    tmp_path: Path, dist_infos: list[tuple[str, bytes | None]], why: str
) -> None:
    for name, metadata in dist_infos:
        dist_info(tmp_path, name, metadata)
    assert betterproto_version.installed_version(str(tmp_path)) is None, why


def test_no_version_from_a_missing_directory(tmp_path: Path) -> None:
    assert betterproto_version.installed_version(str(tmp_path / "absent")) is None


def test_an_imported_betterproto2_keeps_its_version_module() -> None:
    before = sys.modules["betterproto2._version"]
    betterproto_version.provide()
    assert sys.modules["betterproto2._version"] is before


def test_before_betterproto2_is_imported_the_stand_in_takes_its_place(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delitem(sys.modules, "betterproto2")
    monkeypatch.delitem(sys.modules, "betterproto2._version")
    betterproto_version.provide()
    provided = sys.modules["betterproto2._version"]
    assert provided.__name__ == "betterproto2._version"
    assert provided.__version__ == importlib.metadata.version("betterproto2")
