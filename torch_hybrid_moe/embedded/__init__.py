"""Small trained MoE language models shipped inside the package, and how to find them by name."""

from __future__ import annotations

from pathlib import Path

MODELS_DIR = Path(__file__).parent / "models"
DEFAULT_MODEL = "deepseek-tiny"


def embedded_models() -> dict[str, Path]:
    """Name -> directory of every shipped model (each loads with from_pretrained, offline)."""
    return {p.name: p for p in sorted(MODELS_DIR.iterdir()) if (p / "config.json").exists()} if MODELS_DIR.exists() else {}


def resolve_model(name_or_path: str) -> str:
    """An embedded model's directory for its name; anything else (a path, a hub id) as given."""
    return str(embedded_models().get(name_or_path, name_or_path))
