"""Prepare the training data: split the corpus, train the tokenizer on the training files only,
and write both token streams (`train.npy`, `heldout.npy`, uint16) beside the tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from beam_jax.tokenizer import load_tokenizer
from beam_jax.train import corpus
from beam_jax.train.bpe import train_tokenizer, write_tokenizer_dir

TOKENIZER_SUBDIR = "tokenizer"


def prepare(out_dir: Path, root: Path | None = None, *, write_list: bool = False) -> dict:
    """Writes `out_dir/{tokenizer/, train.npy, heldout.npy, corpus.json}`; returns corpus.json's
    content. The held-out files are the committed list (`write_list` regenerates it by the hash
    rule, for a new corpus)."""
    root = corpus.stdlib_dir() if root is None else Path(root)
    paths = corpus.source_files(root)
    train_paths, heldout_paths = corpus.split(paths)
    if write_list:
        corpus.write_heldout_list(heldout_paths, root)
    else:
        heldout_paths, train_paths = corpus.read_heldout_list(), corpus.training_paths(paths)
    train_sources = corpus.read_sources(root, train_paths)
    heldout_sources = corpus.read_sources(root, heldout_paths)

    tokenizer = train_tokenizer(train_sources)
    write_tokenizer_dir(tokenizer, out_dir / TOKENIZER_SUBDIR)
    tokenizer = load_tokenizer(out_dir / TOKENIZER_SUBDIR)
    train_ids = corpus.token_stream(tokenizer, corpus.training_documents(train_paths, train_sources))
    heldout_ids = corpus.token_stream(tokenizer, heldout_sources)
    np.save(out_dir / "train.npy", train_ids)
    np.save(out_dir / "heldout.npy", heldout_ids)
    summary = {
        "corpus_root": str(root),
        "train_files": len(train_paths),
        "heldout_files": len(heldout_paths),
        "train_tokens": int(train_ids.size),
        "heldout_tokens": int(heldout_ids.size),
        "train_bytes": sum(len(s.encode()) for s in train_sources),
    }
    (out_dir / "corpus.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def load_heldout_tokens(tokenizer, root: Path | None = None) -> np.ndarray:
    """The committed held-out files, tokenized with `tokenizer` (for evaluating any checkpoint)."""
    root = corpus.stdlib_dir() if root is None else Path(root)
    return corpus.token_stream(tokenizer, corpus.read_sources(root, corpus.read_heldout_list()))
