"""betterproto2's version, found without importlib.metadata.

betterproto2 (0.10) reads its own version when it is imported, through
`importlib.metadata.version`; that loads importlib.metadata with zipfile, its
compression modules and importlib.resources, 0.7 MB of an idle server's
memory that the server itself never needs (docs/architecture.md, "Memory at
idle"). Its
private module `betterproto2._version` holds just that version and the check
our generated code runs when it is imported (`check_compiler_version`: the
runtime and the compiler that generated `jobsignal/_proto` must agree on
major.minor). Imported first by `jobsignal/__init__.py`, before the
generated code imports betterproto2, this module puts an equivalent in its place,
with the version read from the METADATA of the one distribution installed
beside the package, which is what importlib.metadata reads for an ordinary
install. Where that is not certain (betterproto2 already imported, no
dist-info or several, no Version header) it does nothing, and betterproto2
finds its version itself.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types

DISTRIBUTION = "betterproto2"
MODULE = f"{DISTRIBUTION}._version"


def provide() -> None:
    """Install `betterproto2._version` ahead of betterproto2's own, where the version is certain."""
    if DISTRIBUTION in sys.modules or MODULE in sys.modules:
        return
    spec = importlib.util.find_spec(DISTRIBUTION)
    if spec is None or not spec.submodule_search_locations:
        return  # not installed: its import fails as it would have
    version = installed_version(os.path.dirname(spec.submodule_search_locations[0]))
    if version is not None:
        sys.modules[MODULE] = version_module(version)


def installed_version(site: str) -> str | None:
    """The Version header of the one `betterproto2-*.dist-info` in `site`, else None."""
    try:
        found = [
            name
            for name in os.listdir(site)
            if name.startswith(f"{DISTRIBUTION}-") and name.endswith(".dist-info")
        ]
    except OSError:
        return None
    if len(found) != 1:
        return None
    try:
        with open(os.path.join(site, found[0], "METADATA"), encoding="utf-8") as metadata:
            for line in metadata:
                if not line.strip():
                    return None  # the headers ended without one
                name, colon, value = line.partition(":")
                if colon and name.strip().lower() == "version" and value.strip():
                    return value.strip()
    except (OSError, UnicodeDecodeError):
        return None
    return None


def version_module(version: str) -> types.ModuleType:
    """A module with what betterproto2 imports from its `_version`."""

    def check_compiler_version(compiler_version: str) -> None:
        # betterproto2's rule: a runtime x.y.z runs code from a compiler x.y.*.
        major, minor = major_minor(compiler_version)
        if (major, minor) != major_minor(version):
            raise ImportError(
                f"jobsignal's generated code (jobsignal/_proto) comes from "
                f"betterproto2_compiler {compiler_version}, which needs betterproto2 "
                f"{major}.{minor}.x; betterproto2 {version} is installed (reinstall "
                "jobsignal to get the version it pins)"
            )

    module = types.ModuleType(MODULE, "betterproto2's version (jobsignal/betterproto_version.py)")
    vars(module).update(__version__=version, check_compiler_version=check_compiler_version)
    return module


def major_minor(version: str) -> tuple[int, int]:
    """`0.10` of `0.10.1` (a ValueError for a version that does not start with two numbers)."""
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


provide()
