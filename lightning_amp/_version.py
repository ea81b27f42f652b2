"""The package's version: from the installed distribution's metadata, else (running from a source tree
that is not installed) from the tree's ``pyproject.toml``."""
import importlib.metadata
import pathlib
import tomllib

DISTRIBUTION = "lightning-amp"


def version() -> str:
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        pass
    pyproject = pathlib.Path(__file__).resolve().parent.parent / "pyproject.toml"
    try:
        return tomllib.loads(pyproject.read_text())["project"]["version"]
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return "0+unknown"  # neither installed nor in a source tree: a copied package
