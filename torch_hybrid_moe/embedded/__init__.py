"""Small trained MoE language models shipped inside the package, and how to find them by name."""

from __future__ import annotations

import re
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..errors import InputError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

MODELS_DIR = Path(__file__).parent / "models"
DEFAULT_MODEL = "deepseek-tiny"


def embedded_models() -> dict[str, Path]:
    """Name -> directory of every shipped model (each loads with from_pretrained, offline)."""
    return (
        {p.name: p for p in sorted(MODELS_DIR.iterdir()) if (p / "config.json").exists()} if MODELS_DIR.exists() else {}
    )


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def resolve_model(name_or_path: str) -> str:
    """An existing directory as given (as transformers would load it, even where an embedded model has its name);
    else an embedded model's directory for its name, or a hub id (owner/name) as given. Anything else is an
    InputError saying what was looked for."""
    if not name_or_path.strip():
        raise InputError("the model name is empty: pass an embedded model's name, a directory or a hub id")
    embedded = embedded_models()
    path = Path(name_or_path).expanduser()
    if name_or_path in embedded and not path.is_dir():
        return str(embedded[name_or_path])
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise InputError(f"model directory {name_or_path} has no config.json (is it a transformers checkpoint?)")
        return str(path)
    if path.exists():
        raise InputError(
            f"{name_or_path} is a file; pass the checkpoint's directory (generate also reads a .gguf file)"
        )
    if _HUB_ID.fullmatch(name_or_path) and not name_or_path.startswith((".", "~")):
        return name_or_path
    raise InputError(
        f"no model {name_or_path!r}: not an embedded model ({', '.join(embedded)}), an existing "
        "directory or a hub id (owner/name)"
    )


def load_model(
    name: str, dtype: torch.dtype | str = torch.float32
) -> tuple[torch.nn.Module, PreTrainedTokenizerBase | None]:
    """(model, tokenizer) for an embedded name, a local directory or hub id, or `tiny:ARCH` (random, no tokenizer;
    dtype "auto", the checkpoint's own, is float32 for them)."""
    from ..tiny_models import TINY_ARCHITECTURES, tiny_model

    if name.startswith("tiny:"):
        arch = name.removeprefix("tiny:")
        if arch not in TINY_ARCHITECTURES:
            raise InputError(f"unknown tiny model {arch!r}; choose from {', '.join(TINY_ARCHITECTURES)}")
        return tiny_model(arch, dtype=dtype if isinstance(dtype, torch.dtype) else torch.float32), None
    from transformers import AutoModelForCausalLM

    from ..prepared import MARKER

    path = resolve_model(name)
    if (Path(path) / MARKER).is_file():  # transformers would load it with freshly initialised experts
        raise InputError(
            f"{name} is a prepared store (experts fused and quantised for torch_hybrid_moe), which only generate "
            "and thm.from_pretrained read: pass the checkpoint it was prepared from"
        )
    tokenizer = load_tokenizer(name)
    with _loading_errors(name):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    return model, tokenizer


def load_tokenizer(name: str) -> PreTrainedTokenizerBase:
    """The tokenizer of an embedded name, a local directory or a hub id."""
    from transformers import AutoTokenizer

    path = Path(name).expanduser()
    if path.suffix == ".gguf" and not path.is_file():  # not a hub id to retry for a minute
        what = "is a directory" if path.is_dir() else "does not exist"
        raise InputError(f"{name} {what}; pass the path of a .gguf file")
    with _loading_errors(name):
        if path.suffix == ".gguf":  # the tokenizer beside the file, else the file's own
            if any((path.parent / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
                return AutoTokenizer.from_pretrained(path.parent)
            try:
                return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
            except (ValueError, KeyError, struct.error) as err:  # an architecture or vocabulary it cannot convert,
                # or a file cut short (struct.error)
                raise InputError(
                    f"transformers cannot read the tokenizer in {path.name} ({type(err).__name__}: {err}); if it is a "
                    "whole GGUF file, put the model's tokenizer.json and tokenizer_config.json beside it"
                ) from None
        try:
            return AutoTokenizer.from_pretrained(resolve_model(name))
        except InputError:  # resolve_model's own one line
            raise
        except ValueError as err:  # a checkpoint saved without its tokenizer (save_pretrained of a model alone)
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise InputError(
                f"no tokenizer transformers can build in {name} ({first}); put the model's tokenizer files "
                "(tokenizer.json, tokenizer_config.json) beside its weights"
            ) from None


@contextmanager
def _loading_errors(name: str) -> Iterator[None]:
    """transformers' OSError (a missing file, an unreachable hub) as a one-line InputError."""
    try:
        yield
    except OSError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise InputError(f"cannot load model {name!r}: {first}") from None
