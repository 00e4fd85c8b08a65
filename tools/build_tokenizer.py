"""Build beam-jax's small byte-level BPE tokenizer into beam_jax/assets/tokenizer/.

Beam's real tokenizer is not available, so we train our own on a corpus every machine with
CPython 3.12.1 has: the top-level .py files of its standard library, read in sorted order.
The output is reproducible: the same corpus gives byte-identical files.

    python tools/build_tokenizer.py [--corpus-dir DIR] [--output-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # run from a checkout without installing the package

from beam_jax.tokenizer import (  # noqa: E402
    CHAT_TEMPLATE_PATH,
    PARAMETER_CLOSER_TOKEN,
    SPECIAL_TOKENS,
    TOKENIZER_DIR,
    VOCAB_SIZE,
)

DEFAULT_CORPUS_DIR = Path("/root/.pyenv/versions/3.12.1/lib/python3.12")
MODEL_MAX_LENGTH = 1_048_576  # Beam's served context
PAD_TOKEN = BOS_TOKEN = "<|endoftext|>"  # no BOS is ever prepended; Beam prompts open with <|start|>
EOS_TOKEN = "<|return|>"
MASK_TOKEN = "<|mask|>"


def read_corpus(corpus_dir: Path) -> list[str]:
    """The top-level .py files of `corpus_dir`, sorted by name."""
    paths = sorted(corpus_dir.glob("*.py"))
    if not paths:
        raise SystemExit(f"no .py files in {corpus_dir}")
    return [path.read_text(encoding="utf-8") for path in paths]


def train_tokenizer(texts: list[str]) -> Tokenizer:
    """Byte-level BPE with SPECIAL_TOKENS at ids 0..15 and the parameter closer as the last id."""
    tokenizer = Tokenizer(models.BPE())
    # No normalizer and no prefix space: decode(encode(text)) == text for any UTF-8 text.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - 1,  # one id left for PARAMETER_CLOSER_TOKEN
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte, seen or not
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    tokenizer.add_tokens([AddedToken(PARAMETER_CLOSER_TOKEN, special=False, normalized=False)])
    if tokenizer.get_vocab_size(with_added_tokens=True) != VOCAB_SIZE:
        raise SystemExit(f"vocab size {tokenizer.get_vocab_size()} != {VOCAB_SIZE}; corpus too small?")
    for token_id, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_to_id(token) == token_id, token
    return tokenizer


def tokenizer_config(chat_template: str) -> dict:
    """tokenizer_config.json for transformers' AutoTokenizer."""
    named = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, MASK_TOKEN)
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "mask_token": MASK_TOKEN,
        "extra_special_tokens": [token for token in SPECIAL_TOKENS if token not in named],
        "model_max_length": MODEL_MAX_LENGTH,
        "clean_up_tokenization_spaces": False,  # keep decode exact
        "chat_template": chat_template,
    }


def special_tokens_map() -> dict:
    return {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN, "mask_token": MASK_TOKEN}


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus-dir", type=Path, default=DEFAULT_CORPUS_DIR)
    parser.add_argument("--output-dir", type=Path, default=TOKENIZER_DIR)
    args = parser.parse_args()

    tokenizer = train_tokenizer(read_corpus(args.corpus_dir))
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / "tokenizer.json").write_text(tokenizer.to_str() + "\n", encoding="utf-8")
    chat_template = CHAT_TEMPLATE_PATH.read_text(encoding="utf-8")
    write_json(args.output_dir / "tokenizer_config.json", tokenizer_config(chat_template))
    write_json(args.output_dir / "special_tokens_map.json", special_tokens_map())
    if args.output_dir.resolve() != CHAT_TEMPLATE_PATH.parent.resolve():
        (args.output_dir / CHAT_TEMPLATE_PATH.name).write_text(chat_template, encoding="utf-8")
    print(f"wrote {args.output_dir} ({tokenizer.get_vocab_size()} ids)")


if __name__ == "__main__":
    main()
