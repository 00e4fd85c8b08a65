"""Build beam-jax's small byte-level BPE tokenizer into beam_jax/assets/tokenizer/.

Beam's real tokenizer is not available, so we train our own on a corpus every machine with
CPython 3.12.1 has: the top-level .py files of its standard library, read in sorted order.
The output is reproducible: the same corpus gives byte-identical files.

    python tools/build_tokenizer.py [--corpus-dir DIR] [--output-dir DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # run from a checkout without installing the package

from beam_jax.tokenizer import TOKENIZER_DIR
from beam_jax.train.bpe import train_tokenizer, write_tokenizer_dir

DEFAULT_CORPUS_DIR = Path("/root/.pyenv/versions/3.12.1/lib/python3.12")


def read_corpus(corpus_dir: Path) -> list[str]:
    """The top-level .py files of `corpus_dir`, sorted by name."""
    paths = sorted(corpus_dir.glob("*.py"))
    if not paths:
        raise SystemExit(f"no .py files in {corpus_dir}")
    return [path.read_text(encoding="utf-8") for path in paths]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus-dir", type=Path, default=DEFAULT_CORPUS_DIR)
    parser.add_argument("--output-dir", type=Path, default=TOKENIZER_DIR)
    args = parser.parse_args()

    tokenizer = train_tokenizer(read_corpus(args.corpus_dir))
    write_tokenizer_dir(tokenizer, args.output_dir)
    print(f"wrote {args.output_dir} ({tokenizer.get_vocab_size()} ids)")


if __name__ == "__main__":
    main()
