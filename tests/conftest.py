"""Shared test fixtures: where the read-only assets in ``../shared`` live."""

import os
import pathlib

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


def assets_dir() -> pathlib.Path:
    """``$LLM_JAX_ASSETS`` if set, else ``../shared`` next to the repository root."""
    return pathlib.Path(os.environ.get("LLM_JAX_ASSETS", REPO_ROOT.parent / "shared"))


def require_asset(relative: str) -> pathlib.Path:
    """Path to an asset; missing assets skip locally but fail on CI (``CI=true``)."""
    path = assets_dir() / relative
    if not path.exists():
        message = f"test asset {path} is missing (set LLM_JAX_ASSETS to the shared/ folder)"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(message)
        pytest.skip(message)
    return path


@pytest.fixture(scope="session")
def stories260k_dir() -> pathlib.Path:
    return require_asset("models/stories260K")


@pytest.fixture(scope="session")
def llama2_tokenizer_path() -> pathlib.Path:
    return require_asset("tokenizers/llama2/tokenizer.model")
