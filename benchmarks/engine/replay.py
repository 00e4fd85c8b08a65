"""Multi-turn agentic replay (issue 6), shaped like the blog's workload and scaled to the model:
every user works on one repository, so all conversations start with the same long context; each
conversation asks `questions` questions, each answered in 2-4 tool rounds that add a tool result of
about `tool_tokens` tokens, and every request resends the whole history (context, questions, the
model's own replies, tool results). Users run concurrently: a user sends the next request as soon as
the previous reply is complete.

Reported:
- prefix-cache hit rate: prompt tokens served from the cache / prompt tokens sent, against the ideal
  for this workload: for each request, the longest prefix of it shared with an EARLIER request
  (that request's prompt, plus its reply once finished), in whole pages and leaving the last prompt
  token to compute. This assumes earlier requests are computed before this one is admitted, so it
  is an upper bound of what any cache could serve;
- TTFT (arrival to first token), per-user decode speed (tokens/s after the first), and the longest
  pause between two tokens of a decoding request.

Usage:  python benchmarks/engine/replay.py [--users 3 --questions 3 --context 1024 --tool-tokens 256]
        (defaults run beam-tiny on a CPU in a couple of minutes)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from serving.engine import EngineConfig, LLMEngine  # noqa: E402
from serving.sampling import SamplingParams  # noqa: E402


@dataclasses.dataclass
class User:
    turns: list[list[int]]  # new tokens of each request after the previous reply: question or tool result
    history: list[int]
    next_turn: int = 0


def make_users(args, rng) -> list[User]:
    ids = lambda n: rng.integers(16, 8000, int(n)).tolist()
    context = ids(args.context)
    users = []
    for _ in range(args.users):
        turns = []
        for _ in range(args.questions):
            turns.append(ids(rng.integers(args.question_tokens // 2, args.question_tokens * 3 // 2)))
            for _ in range(rng.integers(2, 5)):
                turns.append(ids(rng.integers(args.tool_tokens // 2, args.tool_tokens * 3 // 2)))
        users.append(User(turns, list(context)))
    return users


def ideal_cached(prompt: list[int], computed: list[list[int]], page: int) -> int:
    """Longest prefix of `prompt` shared with one of `computed`, in whole pages, < len(prompt)."""
    best = 0
    for seq in computed:
        n = min(len(seq), len(prompt) - 1)
        same = np.flatnonzero(np.asarray(seq[:n]) != np.asarray(prompt[:n]))
        best = max(best, int(same[0]) if len(same) else n)
    return best // page * page


def replay(engine: LLMEngine, users: list[User], reply_tokens: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=reply_tokens, ignore_eos=True)
    page = engine.pool.page_tokens
    earlier: dict[str, list[int]] = {}  # request id -> its prompt, and its reply once finished
    sent = cached = ideal = 0
    arrival, first, last_token, ttft, decode_rates, pauses = {}, {}, {}, [], [], [0.0]
    tokens_out: dict[str, int] = {}

    def submit(u: int):
        user = users[u]
        user.history += user.turns[user.next_turn]
        request_id = f"u{u}t{user.next_turn}"
        user.next_turn += 1
        nonlocal sent, ideal
        sent += len(user.history)
        ideal += ideal_cached(user.history, list(earlier.values()), page)
        earlier[request_id] = list(user.history)
        engine.add_request(request_id, list(user.history), params)
        arrival[request_id] = time.monotonic()

    for u in range(len(users)):
        submit(u)
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.monotonic()
            rid = out.request_id
            if out.new_token_ids:
                if rid not in first:
                    first[rid] = now
                    ttft.append(now - arrival[rid])
                else:
                    pauses.append(now - last_token[rid])
                last_token[rid] = now
                tokens_out[rid] = tokens_out.get(rid, 0) + len(out.new_token_ids)
            if out.finished:
                cached += out.num_cached_tokens
                if tokens_out.get(rid, 0) > 1:
                    decode_rates.append((tokens_out[rid] - 1) / max(last_token[rid] - first[rid], 1e-9))
                u = int(rid[1 : rid.index("t")])
                user = users[u]
                user.history = user.history + out.outputs[0].token_ids
                earlier[rid] = list(user.history)
                if user.next_turn < len(user.turns):
                    submit(u)
    return {
        "requests": len(earlier),
        "prompt_tokens_sent": sent,
        "hit_rate": cached / sent,
        "ideal_hit_rate": ideal / sent,
        "ttft_s_median": float(np.median(ttft)),
        "ttft_s_p90": float(np.percentile(ttft, 90)),
        "decode_tokens_per_s_per_user_median": float(np.median(decode_rates)),
        "longest_pause_s": float(max(pauses)),
        "engine": engine.stats(),
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="beam-tiny")
    parser.add_argument("--users", type=int, default=3)
    parser.add_argument("--questions", type=int, default=3)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--question-tokens", type=int, default=64)
    parser.add_argument("--tool-tokens", type=int, default=256)
    parser.add_argument("--reply-tokens", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--num-pages", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    engine = LLMEngine(args.model, config=EngineConfig(
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, num_pages=args.num_pages))
    engine.warmup()
    result = replay(engine, make_users(args, np.random.default_rng(args.seed)), args.reply_tokens)
    result["args"] = vars(args)
    print(json.dumps(result, indent=1))
    print(f"prefix-cache hit rate {100 * result['hit_rate']:.1f}% (ideal {100 * result['ideal_hit_rate']:.1f}%), "
          f"TTFT median {result['ttft_s_median'] * 1e3:.0f} ms, decode {result['decode_tokens_per_s_per_user_median']:.1f} "
          f"tok/s/user, longest pause {result['longest_pause_s'] * 1e3:.0f} ms")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
