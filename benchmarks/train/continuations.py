"""Greedy continuations of held-out standard-library code by a checkpoint (default beam-tiny-code).

    python benchmarks/train/continuations.py [--model NAME|DIR] [--max-new-tokens 48]
Each prompt is a held-out file up to a line (at most the last MAX_PROMPT_TOKENS tokens of it, whole
lines: the model was trained on 1024-token windows); none of these files was trained on
(beam_jax/train/heldout_files.txt). The output shows each prompt's last lines.
"""

from __future__ import annotations

import argparse

from beam_jax.api import load
from beam_jax.train import corpus

PROMPTS = [("modulefinder.py", 119), ("fractions.py", 333), ("_weakrefset.py", 39)]  # (file, last line)
MAX_PROMPT_TOKENS = 800
SHOWN_PROMPT_LINES = 4


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="beam-tiny-code")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args()
    beam = load(args.model)
    heldout = set(corpus.read_heldout_list())
    for path, last in PROMPTS:
        assert path in heldout, path
        lines = (corpus.stdlib_dir() / path).read_text().splitlines(keepends=True)[:last]
        first = last
        while first > 0 and len(beam.encode("".join(lines[first - 1 :]))) <= MAX_PROMPT_TOKENS:
            first -= 1
        # Without its final newline: the tokenizer merges a newline with the next line's indent, so a
        # prompt ending in a bare "\n" token would be a split the model never saw in training.
        prompt = "".join(lines[first:]).removesuffix("\n")
        print(f"# {path}, lines {first + 1}-{last} as the prompt (last {SHOWN_PROMPT_LINES} shown), then ⟨greedy continuation⟩:")
        print("".join(lines[-SHOWN_PROMPT_LINES:]).removesuffix("\n") + "⟨" + beam.generate(prompt, args.max_new_tokens) + "⟩\n")

if __name__ == "__main__":
    main()
