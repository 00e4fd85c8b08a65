"""Speculative verification (serving/speculative.py): greedy acceptance gives exactly the tokens of
step-by-step greedy decoding; rejection sampling emits tokens distributed as the target's filtered
distribution (chi-square, several (p, q) pairs, including q with mass where p has none), and the same
test fails when the correction draws from p instead of the residual; per-row accept lengths with
padding rows; rows without drafts sample exactly as `sampling.sample`; keys are per request."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from serving import speculative
from serving.sampling import NO_TOKEN, SamplingBatch, SamplingParams, sample
from serving.speculative import verify

verify_jit = jax.jit(verify)

# Chi-square critical values at p = 0.001 by degrees of freedom (fixed seeds: deterministic tests).
CHI2_CRITICAL = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}
# Compiling takes seconds on CPU, so tests share two shapes: BATCH rows of K drafts over VOCAB_A
# tokens, and DRAWS rows of DRAFTS drafts over a small VOCAB for the distribution tests.
BATCH, K, VOCAB_A = 8, 4, 32
DRAWS, VOCAB, DRAFTS = 20000, 7, 2


def rows(params: list[SamplingParams], vocab: int, steps=None) -> SamplingBatch:
    n = len(params)
    return SamplingBatch.build(
        params, request_ids=list(range(n)), num_output_tokens=[0] * n if steps is None else steps, vocab_size=vocab
    )


def greedy_reference(logits: np.ndarray, drafts: np.ndarray, num_drafts: int) -> tuple[list[int], int]:
    """Step by step: emit drafts while each is the argmax, then the argmax where they stop."""
    out = []
    for j in range(num_drafts):
        best = int(np.argmax(logits[j]))
        if drafts[j] != best:
            return out + [best], j
        out.append(best)
    return out + [int(np.argmax(logits[num_drafts]))], num_drafts


def test_greedy_matches_argmax_per_position_with_padding_rows():
    rng = np.random.default_rng(0)
    batch, k, vocab = BATCH, K, VOCAB_A
    logits = rng.standard_normal((batch, k + 1, vocab)).astype(np.float32)
    best = logits.argmax(-1)
    drafts = best[:, :k].copy()
    for b in range(batch):  # diverge at a random point (or never)
        cut = rng.integers(0, k + 1)
        if cut < k:
            drafts[b, cut] = (drafts[b, cut] + 1 + rng.integers(vocab - 1)) % vocab
    num_drafts = np.array([k, k, 3, 0, k, 1, 2, 0], np.int32)
    drafts[num_drafts == 0] = -1  # padding rows carry no drafts
    out = verify_jit(
        jnp.asarray(logits), jnp.asarray(drafts), rows([SamplingParams(temperature=0)] * batch, vocab),
        num_draft_tokens=jnp.asarray(num_drafts),
    )
    for b in range(batch):
        expected, accepted = greedy_reference(logits[b], drafts[b], int(num_drafts[b]))
        assert int(out.num_accepted[b]) == accepted
        assert out.tokens[b].tolist() == expected + [NO_TOKEN] * (k + 1 - len(expected))


def test_greedy_speculative_decoding_equals_greedy_decoding():
    """A toy target (logits from the last two tokens) decoded with noisy drafts gives, token for
    token, what greedy decoding gives."""
    rng = np.random.default_rng(1)
    vocab, k, length = VOCAB_A, K, 40
    table = rng.standard_normal((vocab, vocab, vocab)).astype(np.float32)
    logits_after = lambda seq: table[seq[-2], seq[-1]]
    prompt = [3, 7]

    plain = list(prompt)
    while len(plain) < len(prompt) + length:
        plain.append(int(np.argmax(logits_after(plain))))

    greedy_rows = rows([SamplingParams(temperature=0)] * BATCH, vocab)
    padding = jnp.zeros(BATCH, jnp.int32).at[0].set(k)  # row 0 is the request, the others padding
    seq, accepted = list(prompt), []
    while len(seq) < len(prompt) + length:
        # The drafter guesses the greedy continuation, wrong a third of the time.
        drafts, context = [], list(seq)
        for _ in range(k):
            guess = int(np.argmax(logits_after(context)))
            if rng.random() < 1 / 3:
                guess = int(rng.integers(vocab))
            drafts.append(guess)
            context.append(guess)
        block = np.stack([logits_after(seq + drafts[:j]) for j in range(k + 1)])
        out = verify_jit(
            jnp.asarray(np.broadcast_to(block, (BATCH, k + 1, vocab))),
            jnp.asarray(np.broadcast_to(drafts, (BATCH, k))), greedy_rows, num_draft_tokens=padding,
        )
        n = int(out.num_accepted[0])
        seq += out.tokens[0, : n + 1].tolist()
        accepted.append(n)
    assert seq[: len(plain)] == plain
    assert 0 < np.mean(accepted) < k  # both acceptances and rejections happened


def filtered_target(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """numpy reference of the distribution `sample` draws from (temperature, top-k, top-p)."""
    scaled = logits / params.temperature
    order = np.argsort(-scaled, kind="stable")
    keep = np.zeros(len(logits), bool)
    k = params.top_k if params.top_k > 0 else len(logits)
    probs = np.exp(scaled[order[:k]] - scaled[order[0]])
    probs /= probs.sum()
    mass_before = np.cumsum(probs) - probs
    keep[order[:k][(mass_before < params.top_p) | (params.top_p >= 1)]] = True
    p = np.where(keep, np.exp(scaled - scaled.max()), 0)
    return p / p.sum()


def chi_square(counts: np.ndarray, p: np.ndarray) -> tuple[float, int]:
    """Statistic and degrees of freedom over p's support; a count outside the support is infinite."""
    if counts[p == 0].any():
        return float("inf"), 1
    support = p > 0
    expected = counts.sum() * p[support]
    return float(((counts[support] - expected) ** 2 / expected).sum()), int(support.sum()) - 1


def run_draws(verify_fn, target_logits: np.ndarray, q: np.ndarray, params: SamplingParams, seed: int):
    """DRAWS independent requests at one fixed context: drafts drawn from q (numpy), verified."""
    rng = np.random.default_rng(seed)
    drafts = np.stack([rng.choice(VOCAB, DRAWS, p=q[j]) for j in range(DRAFTS)], axis=1).astype(np.int32)
    batch = rows([params] * DRAWS, VOCAB)
    logits = jnp.broadcast_to(jnp.asarray(target_logits), (DRAWS, DRAFTS + 1, VOCAB))
    q_all = jnp.broadcast_to(jnp.asarray(q, jnp.float32), (DRAWS, DRAFTS, VOCAB))
    out = verify_fn(logits, jnp.asarray(drafts), batch, draft_probs=q_all)
    return np.asarray(out.tokens), np.asarray(out.num_accepted)


def case(name: str):
    """(target logits [DRAFTS+1, VOCAB], q [DRAFTS, VOCAB], params) of each tested (p, q) pair."""
    rng = np.random.default_rng(CASES.index(name))
    logits = rng.standard_normal((DRAFTS + 1, VOCAB)).astype(np.float32) * 1.5
    uniform = np.full((DRAFTS, VOCAB), 1 / VOCAB)
    if name == "q equals p":
        params = SamplingParams(temperature=1.0)
        q = np.stack([filtered_target(logits[j], params) for j in range(DRAFTS)])
    elif name == "q far from p":
        params = SamplingParams(temperature=0.8)
        q = np.stack([filtered_target(-2 * logits[j], SamplingParams(temperature=1.0)) for j in range(DRAFTS)])
    elif name == "q has mass where top-k p has none":
        params = SamplingParams(temperature=1.3, top_k=3)
        q = uniform
    elif name == "top-p and a q that misses p's best token":
        params = SamplingParams(temperature=0.7, top_p=0.8)
        logits = logits / 4  # a flatter target, so that top-p keeps several tokens
        q = uniform.copy()
        q[:, np.argmax(logits[:DRAFTS], axis=1)] = 0
        q /= q.sum(1, keepdims=True)
    elif name == "q one-hot (a drafter that proposes its argmax)":
        params = SamplingParams(temperature=1.0, top_k=4)
        q = np.eye(VOCAB)[np.argsort(logits[:DRAFTS], axis=1)[:, -2]]  # p's second-best token
    return logits, q, params


CASES = [
    "q equals p",
    "q far from p",
    "q has mass where top-k p has none",
    "top-p and a q that misses p's best token",
    "q one-hot (a drafter that proposes its argmax)",
]


@pytest.mark.parametrize("name", CASES)
def test_rejection_sampling_emits_the_target_distribution(name):
    logits, q, params = case(name)
    tokens, accepted = run_draws(verify_jit, logits, q, params, seed=2)
    p = [filtered_target(logits[j], params) for j in range(DRAFTS + 1)]

    # The first emitted token (an accepted draft or the correction) is distributed as p_0.
    stat, df = chi_square(np.bincount(tokens[:, 0], minlength=VOCAB), p[0])
    assert stat < CHI2_CRITICAL[df], (name, stat, df)
    # Given the first draft was accepted, the second emitted token is distributed as p_1.
    second = tokens[accepted >= 1, 1]
    stat, df = chi_square(np.bincount(second, minlength=VOCAB), p[1])
    assert stat < CHI2_CRITICAL[df], (name, stat, df)
    # The acceptance rate is sum_x min(p, q).
    expected_rate = np.minimum(p[0], q[0]).sum()
    assert abs((accepted >= 1).mean() - expected_rate) < 4 * np.sqrt(expected_rate * (1 - expected_rate) / DRAWS) + 1e-9


def test_a_wrong_correction_fails_the_chi_square(monkeypatch):
    """Drawing the correction from p instead of the residual max(p - q, 0) over-weights tokens q
    already proposes: the same test must reject it."""
    monkeypatch.setattr(speculative, "residual_distribution", lambda p, q: p)
    wrong_verify = jax.jit(lambda *args, **kwargs: speculative.verify(*args, **kwargs))  # a fresh trace
    for name in ("q far from p", "q has mass where top-k p has none"):
        logits, q, params = case(name)
        tokens, _ = run_draws(wrong_verify, logits, q, params, seed=2)
        stat, df = chi_square(np.bincount(tokens[:, 0], minlength=VOCAB), filtered_target(logits[0], params))
        assert stat > CHI2_CRITICAL[df], (name, stat)


def test_rows_without_drafts_sample_as_sample_does():
    rng = np.random.default_rng(3)
    batch, k, vocab = BATCH, K, VOCAB_A
    logits = rng.standard_normal((batch, k + 1, vocab)).astype(np.float32) * 2
    params = [SamplingParams(temperature=0.9, top_k=5, seed=b) if b % 2 else SamplingParams(temperature=0) for b in range(batch)]
    sampling = rows(params, vocab, steps=[4] * batch)
    out = verify_jit(
        jnp.asarray(logits), jnp.zeros((batch, k), jnp.int32), sampling, num_draft_tokens=jnp.zeros(batch, jnp.int32)
    )
    assert np.all(np.asarray(out.num_accepted) == 0)
    assert np.array_equal(out.tokens[:, 0], sample(jnp.asarray(logits[:, 0]), sampling).tokens)
    assert np.all(np.asarray(out.tokens[:, 1:]) == NO_TOKEN)


def test_mixed_batch_accept_lengths_and_keys_per_request():
    """Greedy, sampling and padding rows in one batch; a sampling row's output depends on its own
    key only (the same request gives the same tokens at another row of another batch)."""
    rng = np.random.default_rng(4)
    batch, k, vocab = BATCH, K, VOCAB_A
    logits = rng.standard_normal((batch, k + 1, vocab)).astype(np.float32)
    drafts = logits[:, :k].argmax(-1).astype(np.int32)  # the target's own greedy choices
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0, seed=11),
        SamplingParams(temperature=0),  # padding row: no drafts
        SamplingParams(temperature=0.5, top_p=0.9, seed=12),
        SamplingParams(temperature=0),  # partial: two real drafts
        SamplingParams(temperature=1.0, top_k=1, seed=13),  # top-k 1 is greedy in effect
        SamplingParams(temperature=2.0, seed=14),
        SamplingParams(temperature=0),  # padding row
    ]
    num_drafts = jnp.asarray([k, k, 0, k, 2, k, k, 0], jnp.int32)
    out = verify_jit(jnp.asarray(logits), jnp.asarray(drafts), rows(params, vocab), num_draft_tokens=num_drafts)
    accepted = np.asarray(out.num_accepted)
    assert accepted[[0, 2, 4, 5, 7]].tolist() == [k, 0, 2, k, 0]
    assert out.tokens[2].tolist() == [int(logits[2, 0].argmax())] + [NO_TOKEN] * k
    assert out.tokens[4].tolist() == drafts[4, :2].tolist() + [int(logits[4, 2].argmax())] + [NO_TOKEN] * 2
    assert out.tokens[5].tolist() == logits[5].argmax(-1).tolist()
    for b in (1, 3, 6):  # sampling rows: a prefix of drafts, one token, padding
        n = accepted[b]
        assert out.tokens[b, :n].tolist() == drafts[b, :n].tolist()
        assert out.tokens[b, n] != NO_TOKEN and np.all(np.asarray(out.tokens[b, n + 1 :]) == NO_TOKEN)

    order = np.array([3, 0, 5, 1, 7, 4, 2, 6])
    permuted = verify_jit(
        jnp.asarray(logits[order]), jnp.asarray(drafts[order]), rows([params[i] for i in order], vocab),
        num_draft_tokens=num_drafts[order],
    )
    assert np.array_equal(np.asarray(permuted.tokens), np.asarray(out.tokens)[order])
