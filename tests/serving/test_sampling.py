"""Sampling: greedy is argmax (ties to the lowest id) also beside random rows; temperature draws follow
the softmax (chi-square); top-k / top-p / min-p keep exactly what a numpy reference keeps (and crafted
nuclei); penalties equal a numpy reference; seeds give the same tokens whatever the batch; logprobs are
the log-softmax; min_tokens suppresses eos; stop strings across tokens; validation; one compile."""

from __future__ import annotations

import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from serving.sampling import (
    MAX_LOGPROBS,
    MAX_REPETITION_PENALTY,
    MIN_REPETITION_PENALTY,
    MIN_TOP_P,
    SamplingBatch,
    SamplingParams,
    StopChecker,
    TokenHistory,
    apply_penalties,
    filter_mask,
    full_bitmask,
    request_key_data,
    sample,
    unpack_bitmask,
)

sample_jit = jax.jit(sample)
filter_mask_jit = jax.jit(filter_mask)

# Compiling a sampling program takes seconds on CPU, so the tests share a few shapes:
# (batch, vocab) SMALL and LARGE, DRAWS rows of one small distribution, and one penalty width.
SMALL, LARGE = (8, 64), (16, 1000)
DRAWS, DRAW_VOCAB = 4000, 6
PENALTY_WIDTH = 64

# Chi-square critical values at p = 0.001 by degrees of freedom: with fixed seeds the tests are
# deterministic, and a wrong distribution overshoots these by orders of magnitude at these draw counts.
CHI2_CRITICAL = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 7: 24.32}


def make_batch(params, vocab, *, request_ids=None, num_output_tokens=None, **kwargs) -> SamplingBatch:
    n = len(params)
    kwargs.setdefault("penalty_width", PENALTY_WIDTH)
    return SamplingBatch.build(
        params,
        request_ids=list(range(n)) if request_ids is None else request_ids,
        num_output_tokens=[0] * n if num_output_tokens is None else num_output_tokens,
        vocab_size=vocab,
        **kwargs,
    )


def random_logits(rng: np.random.Generator, batch: int, vocab: int, scale: float = 3.0) -> np.ndarray:
    return (rng.standard_normal((batch, vocab)) * scale).astype(np.float32)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def chi_square(samples: np.ndarray, probs: np.ndarray) -> float:
    observed = np.bincount(samples, minlength=len(probs))
    expected = probs * len(samples)
    assert observed[expected == 0].sum() == 0, "sampled a token of probability 0"
    nonzero = expected > 0
    return float((((observed - expected) ** 2)[nonzero] / expected[nonzero]).sum())


def draw(logits_row: np.ndarray, params: SamplingParams) -> np.ndarray:
    """DRAWS independent samples of one distribution: one row per unseeded request id."""
    assert logits_row.shape == (DRAW_VOCAB,)
    logits = np.tile(logits_row.astype(np.float32), (DRAWS, 1))
    batch = make_batch([params] * DRAWS, DRAW_VOCAB, request_ids=list(range(1000, 1000 + DRAWS)))
    return np.asarray(sample_jit(logits, batch).tokens)


# ---- greedy -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("batch, vocab", [SMALL, LARGE])
def test_greedy_is_argmax_with_ties_to_lowest_id(batch: int, vocab: int):
    rng = np.random.default_rng(batch * vocab)
    rows = batch - 3  # and 3 padding rows, which are greedy too
    logits = random_logits(rng, batch, vocab)
    expected = []
    for row in range(batch):  # tie 1 to 3 ids at a new maximum
        tied = rng.choice(vocab, size=min(vocab, int(rng.integers(1, 4))), replace=False)
        logits[row, tied] = logits[row].max() + 1.0
        expected.append(tied.min())
    # Filters and a tiny temperature do not make a row random.
    params = [SamplingParams(temperature=t, top_k=3, top_p=0.5, seed=row)
              for row, t in enumerate(rng.choice([0.0, 1e-6], size=rows))]
    out = sample_jit(logits, make_batch(params, vocab, pad_to=batch))
    np.testing.assert_array_equal(np.asarray(out.tokens), expected)
    assert out.tokens.shape == (batch,) and out.tokens.dtype == jnp.int32


def test_greedy_rows_stay_argmax_beside_random_rows():
    rng = np.random.default_rng(1)
    batch, vocab = LARGE
    logits = random_logits(rng, batch, vocab, scale=0.3)  # flat: random rows rarely hit the argmax
    greedy = np.arange(batch) % 2 == 0
    params = [SamplingParams(temperature=0.0 if g else 1.5) for g in greedy]
    tokens = np.asarray(sample_jit(logits, make_batch(params, vocab)).tokens)
    argmax = logits.argmax(-1)
    np.testing.assert_array_equal(tokens[greedy], argmax[greedy])
    assert (tokens[~greedy] != argmax[~greedy]).all()  # 1000 flat logits: the argmax is a 1-in-~700 draw


# ---- temperature --------------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_samples_follow_the_softmax(temperature: float):
    rng = np.random.default_rng(7)
    logits = (2 * rng.standard_normal(6)).astype(np.float32)
    samples = draw(logits, SamplingParams(temperature=temperature))
    probs = np.exp(log_softmax(logits / temperature))
    assert chi_square(samples, probs) < CHI2_CRITICAL[5]
    # The same samples against the distribution of another temperature are far off: the test can fail.
    other = np.exp(log_softmax(logits / (temperature * 1.5)))
    assert chi_square(samples, other) > 3 * CHI2_CRITICAL[5]


# ---- top-k, top-p, min-p -------------------------------------------------------------------------------
def reference_keep(scaled: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """The filters by their definitions, in float64, one row."""
    vocab = len(scaled)
    order = np.argsort(-scaled, kind="stable")  # best first, ties to the lower id
    ranked = scaled[order].astype(np.float64)
    keep = np.arange(vocab) < (vocab if top_k <= 0 else min(top_k, vocab))
    ratio = np.exp(ranked - ranked[0])  # p_i / p_max
    keep &= ratio >= min_p
    probs = np.where(keep, ratio, 0.0)
    probs /= probs.sum()
    if top_p < 1:
        keep &= np.cumsum(probs) - probs < top_p
    out = np.zeros(vocab, bool)
    out[order[keep]] = True
    return out


@pytest.mark.parametrize("vocab", [7, 200])
def test_filter_mask_matches_reference(vocab: int):
    rng = np.random.default_rng(vocab)
    batch = 64
    scaled = random_logits(rng, batch, vocab, scale=2.0)
    scaled[: batch // 2] = np.round(scaled[: batch // 2])  # many ties
    top_k = rng.integers(-1, vocab + 3, size=batch).astype(np.int32)
    top_p = np.where(rng.random(batch) < 0.3, 1.0, rng.uniform(0.05, 1.0, batch)).astype(np.float32)
    min_p = np.where(rng.random(batch) < 0.3, 0.0, rng.uniform(0.0, 0.6, batch)).astype(np.float32)
    mask = np.asarray(filter_mask_jit(scaled, np.maximum(top_k, 0), top_p, min_p))
    expected = np.stack([reference_keep(scaled[b], top_k[b], top_p[b], min_p[b]) for b in range(batch)])
    np.testing.assert_array_equal(mask, expected)
    assert mask.any(-1).all()  # the best token always survives
    assert 0 < expected.sum() < expected.size  # the filters did cut something


def test_top_k_samples_only_top_k_ids():
    rng = np.random.default_rng(3)
    batch, vocab = LARGE
    ranks, top_ks = [], []
    for step in range(30):  # 480 draws with fresh logits and top_k
        logits = random_logits(rng, batch, vocab, scale=0.5)
        top_k = rng.integers(1, 8, size=batch)
        params = [SamplingParams(temperature=2.0, top_k=int(k)) for k in top_k]
        tokens = np.asarray(sample_jit(logits, make_batch(params, vocab, num_output_tokens=[step] * batch)).tokens)
        ranks.append((logits > logits[np.arange(batch), tokens][:, None]).sum(-1))  # ids better than the draw
        top_ks.append(top_k)
    ranks, top_ks = np.concatenate(ranks), np.concatenate(top_ks)
    assert (ranks < top_ks).all()
    # Within the top k, every rank is drawn (it is neither greedy nor cut too short).
    for k in range(1, 8):
        assert set(ranks[top_ks == k].tolist()) == set(range(k))
    # top_k >= vocab and -1 are off: all ids show up.
    for k in (DRAW_VOCAB, 50, -1):
        assert set(draw(np.zeros(DRAW_VOCAB), SamplingParams(top_k=k)).tolist()) == set(range(DRAW_VOCAB))


# Four tokens with probabilities 0.5, 0.25, 0.15, 0.1 at shuffled ids (plus two of probability ~0).
CRAFTED_PROBS = np.array([0.15, 0.0, 0.5, 0.1, 0.0, 0.25])
CRAFTED_LOGITS = np.log(np.maximum(CRAFTED_PROBS, 1e-30)).astype(np.float32)


@pytest.mark.parametrize(
    "params, nucleus",
    [
        (SamplingParams(top_p=0.45), {2}),
        (SamplingParams(top_p=0.7), {2, 5}),
        (SamplingParams(top_p=0.8), {2, 5, 0}),
        (SamplingParams(top_p=0.95), {2, 5, 0, 3}),
        # top-p over the top-k renormalized (4/7, 3/7 of 0.5, 0.25 → mass before 5 is 0.57 ≥ 0.5);
        # without the renormalization 5 would stay (0.5 < 0.55 would keep it only at top_p > 0.5).
        (SamplingParams(top_k=2, top_p=0.55), {2}),
        (SamplingParams(top_k=2, top_p=0.7), {2, 5}),
        (SamplingParams(min_p=0.25), {2, 5, 0}),  # threshold 0.125
        (SamplingParams(min_p=0.4), {2, 5}),
        (SamplingParams(min_p=0.6), {2}),
        (SamplingParams(min_p=0.25, temperature=2.0), {2, 5, 0, 3}),  # after temperature: ratios sqrt
        (SamplingParams(min_p=0.25, top_p=0.6), {2, 5}),  # top-p renormalized after min-p: 0.5/0.9 < 0.6
    ],
)
def test_crafted_nucleus_is_sampled_exactly(params: SamplingParams, nucleus: set[int]):
    samples = draw(CRAFTED_LOGITS, params)
    assert set(samples.tolist()) == nucleus
    # Within the nucleus, the renormalized (temperature-scaled) distribution.
    probs = np.zeros_like(CRAFTED_PROBS)
    kept = sorted(nucleus)
    probs[kept] = CRAFTED_PROBS[kept] ** (1 / params.temperature)
    probs /= probs.sum()
    assert chi_square(samples, probs) < CHI2_CRITICAL.get(len(kept) - 1, 30)


# ---- penalties ----------------------------------------------------------------------------------------
def reference_penalties(logits: np.ndarray, params: SamplingParams, prompt: list[int], output: list[int]) -> np.ndarray:
    out = logits.astype(np.float32).copy()
    for token in set(prompt) | set(output):
        x = out[token]
        out[token] = x / np.float32(params.repetition_penalty) if x > 0 else x * np.float32(params.repetition_penalty)
    for token, count in collections.Counter(output).items():
        out[token] -= np.float32(params.frequency_penalty) * count + np.float32(params.presence_penalty)
    return out


@pytest.mark.parametrize("batch, vocab", [SMALL, LARGE])
def test_penalties_match_reference(batch: int, vocab: int):
    rng = np.random.default_rng(vocab)
    rows = batch - 1
    logits = random_logits(rng, batch, vocab)  # one padding row
    logits[:, :3] = 0.0  # zero logits are neither divided nor multiplied
    params, prompts, outputs, histories = [], [], [], []
    for row in range(rows):
        p = SamplingParams(
            temperature=0.0,
            repetition_penalty=float(rng.choice([1.0, 0.8, 1.3, 2.0])),
            presence_penalty=float(rng.choice([0.0, 0.5, -1.0])),
            frequency_penalty=float(rng.choice([0.0, 0.3, -0.7])),
        )
        if row == 0:
            p = SamplingParams(temperature=0.0)  # no penalties: logits untouched, no history needed
        prompt = rng.integers(0, vocab, size=int(rng.integers(0, 30))).tolist()
        output = rng.integers(0, 20, size=int(rng.integers(0, 25))).tolist()  # repeats
        history = TokenHistory(np.array(prompt, dtype=np.int64))
        for token in output[:3]:
            history.append(token)  # one at a time, then the rest at once
        history.append(output[3:])
        params.append(p), prompts.append(prompt), outputs.append(output)
        histories.append(history if p.has_penalties else None)
    batch = make_batch(params, vocab, histories=histories, num_output_tokens=[len(o) for o in outputs], pad_to=rows + 1)
    expected = np.stack(
        [reference_penalties(logits[r], params[r], prompts[r], outputs[r]) for r in range(rows)] + [logits[rows]]
    )
    penalized = np.asarray(jax.jit(apply_penalties)(logits, batch))
    np.testing.assert_allclose(penalized, expected, rtol=1e-6, atol=1e-6)
    assert not np.allclose(penalized, logits)  # the rows did change
    np.testing.assert_array_equal(penalized[0], logits[0])
    # sample() uses them: greedy picks the penalized argmax; logprobs are its log-softmax.
    out = sample_jit(logits, batch)
    np.testing.assert_array_equal(np.asarray(out.tokens), expected.argmax(-1))
    np.testing.assert_allclose(np.asarray(out.logprobs), log_softmax(expected).max(-1), atol=1e-5)


def test_token_history_counts_output_tokens():
    history = TokenHistory([4, 4, 9])
    history.append(9)
    history.append([2, 2, np.int64(2)])
    ids, counts = history.arrays()
    assert dict(zip(ids.tolist(), counts.tolist())) == {4: 0, 9: 1, 2: 3}
    assert ids.dtype == counts.dtype == np.int32 and len(history) == 3


# ---- seeds ---------------------------------------------------------------------------------------------
def trajectory(
    target: SamplingParams, request_id: int, row: int, others: list[SamplingParams], steps_logits: np.ndarray
) -> list[int]:
    """Tokens of `target` over the steps, with `others` around it (it sits at `row`)."""
    params = others[:row] + [target] + others[row:]
    request_ids = [500 + i for i in range(len(params))]
    request_ids[row] = request_id
    tokens = []
    for step, step_logits in enumerate(steps_logits):
        logits = np.tile(step_logits, (SMALL[0], 1))
        logits[np.arange(SMALL[0]) != row] += 1.0  # other rows see other logits
        batch = make_batch(params, logits.shape[1], request_ids=request_ids, num_output_tokens=[step] * len(params),
                           pad_to=SMALL[0])
        tokens.append(int(sample_jit(logits, batch).tokens[row]))
    return tokens


def test_same_seed_same_tokens_in_any_batch():
    rng = np.random.default_rng(11)
    steps_logits = random_logits(rng, 12, SMALL[1], scale=0.5)
    others = [SamplingParams(seed=1), SamplingParams(temperature=0.0), SamplingParams(top_p=0.9, seed=1234),
              SamplingParams(), SamplingParams(top_k=5), SamplingParams(temperature=0.3)]
    target = SamplingParams(seed=1234, temperature=1.2, top_k=40, top_p=0.95)
    alone = trajectory(target, 1, 0, [], steps_logits)
    assert trajectory(target, 2, 3, others, steps_logits) == alone  # another request id: the seed decides
    assert trajectory(target, 3, 6, others[::-1], steps_logits) == alone
    assert trajectory(dataclasses.replace(target, seed=1235), 1, 0, [], steps_logits) != alone
    # Without a seed the request id decides.
    unseeded = dataclasses.replace(target, seed=None)
    by_id = trajectory(unseeded, 77, 0, [], steps_logits)
    assert trajectory(unseeded, 77, 5, others, steps_logits) == by_id
    assert trajectory(unseeded, 78, 0, [], steps_logits) != by_id
    # Steps matter: the tokens are not one repeated draw.
    assert len(set(alone)) > 6


def test_seed_key_data_is_jax_prng_key():
    for seed in (0, 5, 2**32 - 1):
        jax_key = np.asarray(jax.random.key_data(jax.random.PRNGKey(seed)))
        np.testing.assert_array_equal(request_key_data(seed, 0), jax_key)
    assert (request_key_data(None, 1) != request_key_data(None, 2)).any()
    np.testing.assert_array_equal(request_key_data(None, 9), request_key_data(None, 9))


# ---- logprobs ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("batch, vocab, num_top", [(*SMALL, MAX_LOGPROBS), (*LARGE, MAX_LOGPROBS)])
def test_logprobs_are_the_log_softmax(batch: int, vocab: int, num_top: int):
    rng = np.random.default_rng(vocab + num_top)
    logits = random_logits(rng, batch, vocab)
    temperatures = rng.choice([0.0, 0.5, 1.0, 2.0, 3.0], size=batch)
    params = [SamplingParams(temperature=t, top_k=10, logprobs=min(num_top, 3)) for t in temperatures]
    out = sample_jit(logits, make_batch(params, vocab, num_top_logprobs=num_top))
    expected = log_softmax(logits)  # before temperature and the filters
    tokens = np.asarray(out.tokens)
    np.testing.assert_allclose(np.asarray(out.logprobs), expected[np.arange(batch), tokens], atol=1e-5)
    k = min(num_top, vocab)
    assert out.top_token_ids.shape == out.top_logprobs.shape == (batch, k)
    top_ids = np.argsort(-expected, axis=-1, kind="stable")[:, :k]
    np.testing.assert_array_equal(np.asarray(out.top_token_ids), top_ids)
    np.testing.assert_allclose(np.asarray(out.top_logprobs), np.take_along_axis(expected, top_ids, -1), atol=1e-5)


def test_top_logprobs_are_left_out_when_no_row_asks():
    """The top-k (a sort of the vocabulary) runs only when a row asks for top logprobs (`logprobs` >= 1;
    0 asks for the chosen token's only); the tokens and their logprobs do not depend on it."""
    rng = np.random.default_rng(17)
    batch, vocab = 5, 300
    logits = random_logits(rng, batch, vocab)
    base = [SamplingParams(temperature=t, seed=i, logprobs=lp)
            for i, (t, lp) in enumerate(zip([0.0, 0.8, 1.0, 0.0, 1.5], [None, 0, None, 0, None]))]
    none = sample_jit(logits, make_batch(base, vocab))
    np.testing.assert_array_equal(np.asarray(none.top_token_ids), -1)
    assert np.all(np.asarray(none.top_logprobs) == -np.inf)
    asked = sample_jit(logits, make_batch(base[:4] + [dataclasses.replace(base[4], logprobs=2)], vocab))
    np.testing.assert_array_equal(np.asarray(asked.tokens), np.asarray(none.tokens))
    np.testing.assert_array_equal(np.asarray(asked.logprobs), np.asarray(none.logprobs))
    top_ids = np.argsort(-log_softmax(logits), axis=-1, kind="stable")[:, :MAX_LOGPROBS]
    np.testing.assert_array_equal(np.asarray(asked.top_token_ids)[:batch], top_ids)  # every row, once one asks


# ---- min_tokens ----------------------------------------------------------------------------------------
def test_min_tokens_suppresses_eos_and_stop_ids():
    eos, stop_id, min_tokens = 3, 7, 4
    rng = np.random.default_rng(5)
    params, produced = [], []
    for n in (0, 3, 4, 6):
        for temperature in (0.0, 1.0):
            for ignore_eos in (False, True):
                params.append(SamplingParams(temperature=temperature, min_tokens=min_tokens,
                                             stop_token_ids=[stop_id], ignore_eos=ignore_eos, logprobs=2))
                produced.append(n)
    batch, vocab = LARGE
    assert len(params) == batch
    logits = random_logits(rng, batch, vocab, scale=0.5)
    logits[:, eos] = 10.0  # eos is by far the best, then the stop id
    logits[:, stop_id] = 9.0
    out = sample_jit(logits, make_batch(params, vocab, num_output_tokens=produced, eos_token_ids=[eos]))
    tokens, logprobs = np.asarray(out.tokens), np.asarray(out.logprobs)
    below = np.array(produced) < min_tokens
    ignore = np.array([p.ignore_eos for p in params])
    greedy = np.array([p.temperature == 0 for p in params])
    assert not np.isin(tokens[below & ~ignore], [eos, stop_id]).any()
    # ignore_eos does not suppress eos (it never ends the request anyway), only the stop id.
    np.testing.assert_array_equal(tokens[below & ignore & greedy], eos)
    np.testing.assert_array_equal(tokens[~below & greedy], eos)
    # The logprobs see the suppression (the ids drop out of the top), the rows that may stop do not.
    top_ids = np.asarray(out.top_token_ids)
    assert not np.isin(top_ids[below & ~ignore], [eos, stop_id]).any()
    np.testing.assert_array_equal(top_ids[~below, :2], [[eos, stop_id]] * (~below).sum())
    assert np.isfinite(logprobs).all()


def test_min_tokens_clears_mask_bits_of_any_many_ids():
    """Suppressed ids are cleared in (a copy of) the token mask, however many (no width to outgrow),
    bit 31 of a word included; grammar rows and rows past min_tokens keep their masks."""
    vocab, eos = 100, (31, 63)
    stops = tuple(range(64, 100))  # 36 stop ids
    params = [SamplingParams(min_tokens=2, stop_token_ids=stops), SamplingParams(min_tokens=2, stop_token_ids=stops)]
    given = full_bitmask(3, vocab)
    batch = make_batch(params, vocab, num_output_tokens=[0, 2], eos_token_ids=eos, pad_to=3, token_bitmask=given)
    np.testing.assert_array_equal(given, full_bitmask(3, vocab))  # the caller's mask is left alone
    allowed = np.asarray(unpack_bitmask(jnp.asarray(batch.token_bitmask), vocab))
    np.testing.assert_array_equal(~allowed[0], np.isin(np.arange(vocab), eos + stops))
    assert allowed[1:].all()


# ---- stopping ------------------------------------------------------------------------------------------
def feed(checker: StopChecker, pieces: list[tuple[int, str]]) -> list[str]:
    deltas = []
    for token, text in pieces:
        deltas.append(checker.append(token, text))
        if checker.finished:
            break
    else:
        deltas.append(checker.finish("length"))  # e.g. the context limit: the held text comes out
    assert "".join(deltas) == checker.text  # what was streamed is exactly the final text
    return deltas


def test_stop_string_across_tokens_is_cut_and_held_back():
    checker = StopChecker(SamplingParams(stop=["</end>", "STOP"]))
    deltas = feed(checker, [(1, "Hello"), (2, " wor"), (3, "ld</"), (4, "en"), (5, "d> tail"), (6, "more")])
    assert deltas == ["Hello", " wor", "ld", "", ""]
    assert checker.text == "Hello world" and checker.finish_reason == "stop" and checker.stop_reason == "</end>"
    # Held-back text that does not complete a stop string is released.
    checker = StopChecker(SamplingParams(stop="<c"))
    assert feed(checker, [(1, "a<"), (2, "b"), (3, "<")]) == ["a", "<b", "", "<"]
    assert (checker.text, checker.finish_reason) == ("a<b<", "length")
    # The earliest stop string in the text wins, whatever the list order.
    checker = StopChecker(SamplingParams(stop=["cd", "abc"]))
    feed(checker, [(1, "xab"), (2, "cde")])
    assert checker.text == "x" and checker.stop_reason == "abc"


def test_stop_ids_eos_max_tokens_min_tokens():
    params = SamplingParams(stop_token_ids=[7], max_tokens=4, stop=["zz"])
    checker = StopChecker(params, eos_token_ids=[2])
    assert feed(checker, [(1, "a"), (7, "<s>")]) == ["a", ""]
    assert (checker.text, checker.finish_reason, checker.stop_reason) == ("a", "stop", 7)
    checker = StopChecker(params, eos_token_ids=[2])
    feed(checker, [(1, "a"), (2, "</s>")])
    assert (checker.text, checker.finish_reason, checker.stop_reason) == ("a", "stop", None)
    # ignore_eos: eos is just a token; max_tokens ends it with "length" and flushes held-back text.
    checker = StopChecker(dataclasses.replace(params, ignore_eos=True), eos_token_ids=[2])
    assert feed(checker, [(1, "a"), (2, "b"), (3, "c"), (4, "z"), (5, "never")]) == ["a", "b", "c", "z"]
    assert (checker.text, checker.finish_reason, checker.num_tokens) == ("abcz", "length", 4)
    with pytest.raises(RuntimeError, match="finished"):
        checker.append(1, "x")
    # Below min_tokens nothing but max_tokens stops it; the min_tokens-th token may.
    checker = StopChecker(SamplingParams(min_tokens=3, stop=["zz"], stop_token_ids=[7]), eos_token_ids=[2])
    feed(checker, [(2, ""), (7, "q"), (1, "zz"), (2, "")])
    assert (checker.text, checker.finish_reason, checker.num_tokens) == ("q", "stop", 3)
    assert checker.stop_reason == "zz"


def test_stop_strings_random_against_reference():
    """Random token texts over a small alphabet: the checker stops at the first token after which
    the text contains a stop string, cut at the earliest one; the stream equals the text."""
    rng = np.random.default_rng(2)
    alphabet = list("ab<>")
    for _ in range(300):
        stops = ["".join(rng.choice(alphabet, size=int(rng.integers(1, 5)))) for _ in range(int(rng.integers(1, 3)))]
        pieces = ["".join(rng.choice(alphabet, size=int(rng.integers(0, 4)))) for _ in range(12)]
        checker = StopChecker(SamplingParams(stop=stops))
        feed(checker, [(1, piece) for piece in pieces])
        expected, text, hits = "".join(pieces), "", []
        for piece in pieces:
            text += piece
            hits = [text.find(s) for s in stops if s in text]
            if hits:
                expected = text[: min(hits)]
                break
        assert checker.text == expected, (stops, pieces)
        assert checker.finish_reason == ("stop" if hits else "length")


# ---- validation ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "field, kwargs",
    [
        ("temperature", dict(temperature=-0.1)),
        ("temperature", dict(temperature=float("nan"))),
        ("temperature", {"temperature": float("inf")}),
        ("temperature", {"temperature": 1e39}),  # finite in Python, inf in float32
        ("temperature", {"temperature": True}),
        ("top_k", dict(top_k=-2)),
        ("top_k", dict(top_k=1.5)),
        ("top_p", dict(top_p=0.0)),
        ("top_p", dict(top_p=1.1)),
        ("top_p", {"top_p": -1e-30}),
        ("top_p", {"top_p": float("nan")}),
        ("min_p", dict(min_p=-0.1)),
        ("min_p", dict(min_p=1.5)),
        ("repetition_penalty", dict(repetition_penalty=0.0)),
        ("repetition_penalty", {"repetition_penalty": 1e-40}),  # subnormal in float32: NaN logits
        ("repetition_penalty", {"repetition_penalty": 0.009}),
        ("repetition_penalty", {"repetition_penalty": 100.5}),
        ("repetition_penalty", {"repetition_penalty": float("inf")}),
        ("presence_penalty", {"presence_penalty": float("nan")}),
        ("presence_penalty", dict(presence_penalty=2.5)),
        ("frequency_penalty", dict(frequency_penalty=-3.0)),
        ("seed", dict(seed=1.5)),
        ("max_tokens", dict(max_tokens=0)),
        ("min_tokens", dict(min_tokens=-1)),
        ("min_tokens", dict(min_tokens=5, max_tokens=3)),
        ("stop", dict(stop=["ok", ""])),
        ("stop_token_ids", dict(stop_token_ids=[-1])),
        ("ignore_eos", dict(ignore_eos="yes")),
        ("logprobs", dict(logprobs=21)),
        ("logprobs", dict(logprobs=-1)),
    ],
)
def test_invalid_params_name_the_field(field: str, kwargs: dict):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} "):
        SamplingParams(**kwargs)


def test_float32_limits_at_the_edges():
    """The limits themselves are valid; a top_p that float32 flushes to 0 (1e-40 is subnormal) is
    raised to MIN_TOP_P, which keeps exactly the most likely token (a top_p of 0 keeps none, and the
    step then returned token 0)."""
    SamplingParams(repetition_penalty=MIN_REPETITION_PENALTY)
    SamplingParams(repetition_penalty=MAX_REPETITION_PENALTY)
    SamplingParams(temperature=1e38)
    assert SamplingParams(top_p=1e-40).top_p == MIN_TOP_P == SamplingParams(top_p=MIN_TOP_P).top_p
    assert SamplingParams(top_p=0.5).top_p == 0.5
    rng = np.random.default_rng(5)
    batch_size, vocab = SMALL
    logits = random_logits(rng, batch_size, vocab)
    logits[:, 0] = -1e3  # token 0 is the least likely
    params = [SamplingParams(temperature=1.0, top_p=1e-40, seed=i) for i in range(batch_size)]
    out = sample_jit(logits, make_batch(params, vocab))
    np.testing.assert_array_equal(np.asarray(out.tokens), logits.argmax(-1))


def test_valid_params_and_builder_errors():
    params = SamplingParams(top_k=-1, stop="x", stop_token_ids=[3], logprobs=20, max_tokens=1, seed=-5)
    assert params.stop == ("x",) and params.stop_token_ids == (3,) and not params.greedy
    with pytest.raises(ValueError, match="TokenHistory"):
        make_batch([SamplingParams(presence_penalty=1.0)], 10)
    with pytest.raises(ValueError, match="pad_to"):
        make_batch([SamplingParams()] * 3, 10, pad_to=2)
    with pytest.raises(ValueError, match="penalty_width"):
        make_batch([SamplingParams(repetition_penalty=2.0)], 10, histories=[TokenHistory(range(5))], penalty_width=4)
    with pytest.raises(ValueError, match="num_top_logprobs"):
        make_batch([SamplingParams(logprobs=5)], 10, num_top_logprobs=2)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        make_batch([SamplingParams()], 10, eos_token_ids=[10])


# ---- compilation ---------------------------------------------------------------------------------------
def test_sample_compiles_once_per_batch_size():
    rng = np.random.default_rng(0)
    batch_size, vocab = SMALL
    step = jax.jit(lambda logits, batch: sample(logits, batch))  # its own cache, not sample_jit's
    mixes = [
        [SamplingParams(temperature=0.0)] * 5,
        [SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=0.0), SamplingParams(top_p=0.5)],
        [SamplingParams(repetition_penalty=1.5, min_tokens=3, stop_token_ids=[1, 2]), SamplingParams(min_p=0.1)] * 4,
        [SamplingParams(frequency_penalty=1.0, seed=3, logprobs=4)] * 8,
    ]
    for mix in mixes:
        histories = [TokenHistory(rng.integers(0, vocab, 10)) if p.has_penalties else None for p in mix]
        # Default (bucketed) widths: histories of 10 tokens all fall in the smallest bucket.
        batch = SamplingBatch.build(mix, request_ids=range(len(mix)), num_output_tokens=rng.integers(0, 5, len(mix)),
                                    histories=histories, vocab_size=vocab, eos_token_ids=[0], pad_to=batch_size)
        assert len(jax.tree_util.tree_leaves(batch)) == 13
        out = step(random_logits(rng, batch_size, vocab), batch)
        assert out.tokens.shape == out.logprobs.shape == (batch_size,)
    assert step._cache_size() == 1
    # The counter does see a new program: fewer top logprobs (a static field). They are the first
    # ones of the full list.
    logits = random_logits(rng, batch_size, vocab)
    full = step(logits, batch)
    five = step(logits, dataclasses.replace(batch, num_top_logprobs=5))
    assert step._cache_size() == 2
    assert five.top_token_ids.shape == five.top_logprobs.shape == (batch_size, 5)
    np.testing.assert_array_equal(np.asarray(five.top_token_ids), np.asarray(full.top_token_ids)[:, :5])
    np.testing.assert_array_equal(np.asarray(five.tokens), np.asarray(full.tokens))
