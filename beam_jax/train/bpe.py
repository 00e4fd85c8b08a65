"""Byte-level BPE tokenizers with Beam's control tokens, trained with `tokenizers`, and the files
that make a directory loadable by transformers' AutoTokenizer (`write_tokenizer_dir`)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from beam_jax.tokenizer import CHAT_TEMPLATE_PATH, PARAMETER_CLOSER_TOKEN, SPECIAL_TOKENS, VOCAB_SIZE

MODEL_MAX_LENGTH = 1_048_576  # Beam's served context
PAD_TOKEN = BOS_TOKEN = "<|endoftext|>"  # no BOS is ever prepended; Beam prompts open with <|start|>
EOS_TOKEN = "<|return|>"
MASK_TOKEN = "<|mask|>"


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


def write_tokenizer_dir(tokenizer: Tokenizer, output_dir: Path) -> None:
    """tokenizer.json, tokenizer_config.json (with the chat template), special_tokens_map.json and
    chat_template.jinja."""
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "tokenizer.json").write_text(tokenizer.to_str() + "\n", encoding="utf-8")
    chat_template = CHAT_TEMPLATE_PATH.read_text(encoding="utf-8")
    write_json(output_dir / "tokenizer_config.json", tokenizer_config(chat_template))
    write_json(output_dir / "special_tokens_map.json", special_tokens_map())
    if output_dir.resolve() != CHAT_TEMPLATE_PATH.parent.resolve():
        (output_dir / CHAT_TEMPLATE_PATH.name).write_text(chat_template, encoding="utf-8")
