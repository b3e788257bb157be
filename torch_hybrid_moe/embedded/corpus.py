"""The training corpus present on every machine without a network: the Python standard library's source.

Files are split into training and held-out sets by a hash of their path relative to the stdlib root,
so the split is the same on every machine with the same Python. The held-out text the evaluation
uses is also shipped in the package (`data/heldout.txt`), so perplexities compare across machines.
"""

from __future__ import annotations

import sysconfig
import zlib
from pathlib import Path

HELDOUT_EVERY = 20  # one file in twenty is held out
SEPARATOR = "<|endoftext|>"
SHIPPED_HELDOUT = Path(__file__).parent / "data" / "heldout.txt"


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "__pycache__", "idlelib", "lib2to3"}
    return sorted(p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts))


def is_heldout(path: Path) -> bool:
    root = Path(sysconfig.get_paths()["stdlib"])
    return zlib.crc32(str(path.relative_to(root)).encode()) % HELDOUT_EVERY == 0


def read_texts(paths: list[Path], max_chars: int | None = None) -> list[str]:
    """File texts in path order, up to `max_chars` in all."""
    texts, total = [], 0
    for path in paths:
        text = path.read_text(encoding="utf-8", errors="ignore")
        if max_chars is not None and total + len(text) > max_chars:
            break
        texts.append(text)
        total += len(text)
    return texts


def split_corpus(max_train_chars: int | None = None) -> tuple[list[str], list[str]]:
    files = stdlib_files()
    train = [p for p in files if not is_heldout(p)]
    heldout = [p for p in files if is_heldout(p)]
    return read_texts(train, max_train_chars), read_texts(heldout)


def heldout_text() -> str:
    """The shipped held-out evaluation text: files never seen in training, joined by the separator."""
    return SHIPPED_HELDOUT.read_text(encoding="utf-8")
