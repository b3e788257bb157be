"""Small trained MoE language models shipped inside the package, and how to find them by name."""

from __future__ import annotations

from pathlib import Path

import torch
from tqdm.auto import tqdm

MODELS_DIR = Path(__file__).parent / "models"
DEFAULT_MODEL = "deepseek-tiny"


def embedded_models() -> dict[str, Path]:
    """Name -> directory of every shipped model (each loads with from_pretrained, offline)."""
    return {p.name: p for p in sorted(MODELS_DIR.iterdir()) if (p / "config.json").exists()} if MODELS_DIR.exists() else {}


def resolve_model(name_or_path: str) -> str:
    """An embedded model's directory for its name; anything else (a path, a hub id) as given."""
    return str(embedded_models().get(name_or_path, name_or_path))


def load_model(name: str, dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, object | None]:
    """(model, tokenizer) for an embedded name, a local directory or hub id, or `tiny:ARCH` (random, no tokenizer)."""
    from ..tiny_models import TINY_ARCHITECTURES, tiny_model

    if name.startswith("tiny:"):
        arch = name.removeprefix("tiny:")
        if arch not in TINY_ARCHITECTURES:
            raise SystemExit(f"unknown tiny model {arch!r}; choose from {', '.join(TINY_ARCHITECTURES)}")
        return tiny_model(arch, dtype=dtype), None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model(name)
    with tqdm(total=2, desc="loading", leave=False) as bar:
        tokenizer = AutoTokenizer.from_pretrained(path)
        bar.update()
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        bar.update()
    return model, tokenizer
