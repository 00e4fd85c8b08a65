"""The training corpus: every `.py` file of the Python standard library, split by file.

The held-out files are those whose relative path hashes to 0 mod `HELDOUT_MODULUS` (a stable
hash, so the split needs no randomness); `heldout_files.txt` lists them as committed, and the
evaluation reads that list, so results can be reproduced from any checkout. A small share of the
training files is also rendered as chat turns (a user shows the head of a file, the assistant
continues it in the final channel), so the chat format's tokens are seen in use.
"""

from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from beam_jax.tokenizer import render_chat

HELDOUT_MODULUS = 25  # ~4% of the files
HELDOUT_LIST = Path(__file__).parent / "heldout_files.txt"
DOCUMENT_SEPARATOR = "<|endoftext|>"
CHAT_SHARE_MODULUS = 8  # one training file in 8 also appears as a chat turn
CHAT_PROMPT_LINES = 12


def stdlib_dir() -> Path:
    """The standard library of the interpreter running this code."""
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root: Path) -> list[str]:
    """Paths (relative to `root`, sorted) of the `.py` files under it that decode as UTF-8;
    third-party packages (`site-packages`) are not the standard library."""
    paths = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if "site-packages" in relative.parts or not path.is_file():
            continue
        try:
            path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a few test fixtures are deliberately not UTF-8
        paths.append(relative.as_posix())
    return paths


def _stable_hash(relative_path: str) -> int:
    return int.from_bytes(hashlib.sha256(relative_path.encode()).digest()[:8], "little")


def is_heldout(relative_path: str) -> bool:
    return _stable_hash(relative_path) % HELDOUT_MODULUS == 0


def split(paths: list[str]) -> tuple[list[str], list[str]]:
    """(train, held-out) by the hash rule."""
    return [p for p in paths if not is_heldout(p)], [p for p in paths if is_heldout(p)]


def read_heldout_list(path: Path = HELDOUT_LIST) -> list[str]:
    return [line for line in path.read_text().splitlines() if line and not line.startswith("#")]


def write_heldout_list(paths: list[str], root: Path, path: Path = HELDOUT_LIST) -> None:
    header = f"# held-out files of beam-tiny-code's corpus, relative to {root} (see beam_jax/train/corpus.py)\n"
    path.write_text(header + "".join(p + "\n" for p in paths))


def training_paths(paths: list[str]) -> list[str]:
    """`paths` less the committed held-out list."""
    heldout = set(read_heldout_list())
    return [p for p in paths if p not in heldout]


def read_sources(root: Path, paths: list[str]) -> list[str]:
    missing = [p for p in paths if not (root / p).is_file()]
    if missing:
        raise FileNotFoundError(f"{len(missing)} corpus files are missing under {root}, e.g. {missing[:3]}")
    return [(root / p).read_text(encoding="utf-8") for p in paths]


def chat_document(source: str) -> str | None:
    """A file as one chat exchange: the user shows its first lines, the assistant continues."""
    lines = source.splitlines(keepends=True)
    if len(lines) <= CHAT_PROMPT_LINES:
        return None
    head, rest = "".join(lines[:CHAT_PROMPT_LINES]), "".join(lines[CHAT_PROMPT_LINES:])
    # Fenced, so that the user's turn ends after "```", never right after a line of code: plain
    # code completions then have no reason to predict <|end|>.
    prompt = render_chat([{"role": "user", "content": f"Continue this Python file:\n```python\n{head}```"}])
    return f"{prompt}<|channel|>final<|message|>{rest}<|return|>"


def training_documents(paths: list[str], sources: list[str]) -> Iterator[str]:
    """Every training file as plain text, plus the chat form of one file in CHAT_SHARE_MODULUS."""
    for path, source in zip(paths, sources, strict=True):
        yield source
        if _stable_hash("chat:" + path) % CHAT_SHARE_MODULUS == 0 and (chat := chat_document(source)):
            yield chat


def token_stream(tokenizer, documents) -> np.ndarray:
    """The documents' ids (uint16), each followed by the separator, in order."""
    separator = tokenizer.token_to_id(DOCUMENT_SEPARATOR)
    ids = []
    for encoding in tokenizer.encode_batch(list(documents)):
        ids.extend(encoding.ids)
        ids.append(separator)
    return np.asarray(ids, np.uint16)
