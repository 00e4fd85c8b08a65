"""Speculative decoding in the engine (serving/speculative_step.py) on fp32 beam-tiny with a random
DFlash2 drafter: greedy outputs are token-identical to the plain engine, with the drafter's own
drafts (which a random drafter almost never gets right) and with oracle drafts (the plain engine's
continuation, corrupted at random points) that get whole blocks accepted and rolled back, through
chunked prefill, prompts past the sliding window, prefix hits, preemption, and max_tokens, stop
tokens and stop strings inside a block; the drafts the step proposes from its paged context equal
the drafter run on the contiguous context; simulated acceptance hits the set length and says it is
simulated; bad speculative settings are refused, by the engine and by `beam-serve`'s flags; the
server streams speculative output and reports acceptance in /metrics; the shipped drafter for
beam-tiny-code accepts >= 3 tokens per step on held-out code, losslessly."""

from __future__ import annotations

import httpx
import jax.numpy as jnp
import numpy as np
import openai
import pytest

import beam_jax
from beam_jax import drafter as D
from beam_jax.model import forward
from serving.cli import build_engine, parser
from serving.engine import EngineConfig, LLMEngine
from serving.sampling import SamplingParams
from serving.speculative_step import target_embedding_and_head
from tests.serving.live_server import live_server, pool_is_free
from tests.serving.test_cli import SMALL as CLI_SMALL
from tests.serving.test_cli import run_worker
from tests.serving.test_engine import random_prompts, run

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
DRAFTER = D.drafter_tiny()  # block 4: 3 drafts; window 24 (shorter than the prompts)
SMALL = {"max_num_seqs": 6, "max_num_batched_tokens": 64, "max_prefill_chunk": 16, "max_model_len": 256}


@pytest.fixture(scope="module")
def beam():
    return beam_jax.load("beam-tiny", dtype=jnp.float32, seed=4)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("drafter")
    D.save_drafter(path, DRAFTER, D.init_drafter_params(DRAFTER, seed=3, dtype=jnp.float32))
    return path


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(0)


@pytest.fixture(scope="module")
def plain(beam):
    return LLMEngine(beam, config=EngineConfig(**SMALL))


@pytest.fixture(scope="module")
def expected(plain, prompts):
    return run(plain, prompts)


def speculative_engine(beam, draft_dir, **overrides) -> LLMEngine:
    return LLMEngine(beam, config=EngineConfig(**(SMALL | overrides), speculative="dflash", draft_model=str(draft_dir)))


@pytest.fixture(scope="module")
def engine(beam, draft_dir):
    """One speculative engine for the tests that leave it idle (compiling is most of their time)."""
    return speculative_engine(beam, draft_dir)


def feed_oracle_drafts(engine: LLMEngine, continuations: dict[str, list[int]], seed: int) -> None:
    """Replace the drafter's proposals by the plain engine's continuation, each draft corrupted with
    probability 0.3 (so blocks are accepted whole, in part, or not at all). Undone by deleting
    `engine._next_drafts`."""
    rng = np.random.default_rng(seed)
    choose = type(engine)._next_drafts.__get__(engine)

    def oracle(tracked, drafts):
        done = len(tracked.request.output_ids)
        truth = continuations[tracked.request.request_id][done : done + len(drafts)]
        truth = truth + [7] * (len(drafts) - len(truth))
        noisy = [t if rng.random() > 0.3 else (t + 1) % engine.vocab_size for t in truth]
        return choose(tracked, np.asarray(noisy))

    engine._next_drafts = oracle


def test_random_drafter_is_lossless(engine, prompts, expected):
    assert run(engine, prompts) == expected
    stats = engine.stats()
    assert stats["spec_blocks"] > 0 and stats["spec_draft_tokens"] > 0
    assert not stats["spec_simulated"]


def test_accepted_blocks_are_lossless_through_preemption_and_prefix_hits(beam, draft_dir, prompts, expected):
    # 60 pages force preemption (test_engine: 54 for 3 cache groups; the drafter adds a fourth).
    engine = speculative_engine(beam, draft_dir, num_pages=60)
    feed_oracle_drafts(engine, expected, seed=0)
    assert run(engine, prompts) == expected
    stats = engine.stats()
    assert stats["spec_accepted_tokens"] > 0.4 * stats["spec_draft_tokens"], stats
    assert 0 < stats["spec_acceptance_by_position"][-1] < 1
    assert stats["preemptions"] > 0 and engine.prefix_cache.stats.hit_tokens > 0
    engine.pool.check_invariants()
    assert engine.pool.seq_ids == []  # every sequence's pages went back (cached prefixes aside)


def test_stop_token_stop_string_and_max_tokens_inside_a_block(engine, plain, prompts, expected):
    long = {rid: expected[rid] for rid in ("r0", "r2", "r4")}
    stop_at = long["r2"][6]  # r2 stops at the first occurrence of its 7th token
    cut = long["r2"].index(stop_at) + 1
    accepted_before = engine.stats()["spec_accepted_tokens"]
    feed_oracle_drafts(engine, long, seed=1)
    engine.add_request("r0", prompts[0], SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))
    engine.add_request("r2", prompts[2], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                         stop_token_ids=(stop_at,)))
    # r4 stops at a string that starts inside its 6th token's text (three characters of it and after).
    text = engine.tokenizer.decode(long["r4"], skip_special_tokens=False)
    start = len(engine.tokenizer.decode(long["r4"][:5], skip_special_tokens=False))
    stop_string = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[text[start : start + 3]])
    engine.add_request("r4", prompts[4], stop_string)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({out.request_id: out.outputs[0] for out in engine.step() if out.finished})
    assert finished["r0"].token_ids == long["r0"][:7] and finished["r0"].finish_reason == "length"
    assert finished["r2"].token_ids == long["r2"][:cut] and finished["r2"].finish_reason == "stop"
    [plain_r4] = list(_finished(plain, "r4", prompts[4], stop_string))
    assert (finished["r4"].token_ids, finished["r4"].text) == (plain_r4.token_ids, plain_r4.text)
    assert finished["r4"].finish_reason == "stop" and len(finished["r4"].token_ids) < 12
    assert engine.stats()["spec_accepted_tokens"] > accepted_before
    del engine._next_drafts


def _finished(engine: LLMEngine, request_id: str, prompt, params: SamplingParams):
    engine.add_request(request_id, prompt, params)
    while engine.has_unfinished_requests():
        yield from (out.outputs[0] for out in engine.step() if out.finished)


def test_proposed_drafts_equal_the_drafter_on_the_contiguous_context(engine, beam, draft_dir, prompts):
    """After a prompt's last chunk, the drafts the step stored come from the paged drafter context
    (partly written by earlier requests: the prompt hits the prefix cache): the same as `propose`
    over `context_kv` of a plain forward of the whole prompt."""
    prompt = prompts[2]  # 150 tokens: 3 chunks of up to 64, well past the drafter's window of 24
    engine.add_request("p", prompt, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    while not engine.scheduler.running or engine.scheduler.running[0].output_ids == []:
        engine.step()
    request = engine.scheduler.running[0]
    [anchor] = request.output_ids

    config, params = D.load_drafter(draft_dir, dtype=jnp.float32)
    tokens = jnp.asarray(prompt)[None]
    positions = jnp.arange(len(prompt))[None]
    hidden = forward(beam.params, tokens, positions, config=beam.config, hidden_layers=config.target_layer_ids)
    context = D.context_kv(params, jnp.concatenate(hidden.hidden_states, -1), positions, config=config)
    embed, head = target_embedding_and_head(beam.params, beam.config)
    proposal = D.propose(
        params, jnp.asarray([anchor]), jnp.asarray([len(prompt)]), context,
        embed_weight=embed, lm_head_weight=head, config=config,
    )
    assert request.draft_tokens == proposal.tokens[0].tolist()
    engine.abort_request("p")


def test_simulated_acceptance_hits_the_set_length(beam, draft_dir, prompts):
    engine = LLMEngine(beam, config=EngineConfig(**SMALL, speculative="dflash", draft_model=str(draft_dir),
                                                 simulated_accept_length=2.5))
    run(engine, prompts[:4], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    stats = engine.stats()
    assert stats["spec_simulated"]
    assert stats["spec_blocks"] > 40
    assert abs(stats["spec_mean_accept_length"] - 2.5) < 0.25, stats


def test_sampling_requests_speculate_and_are_reproducible(engine, prompts):
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, ignore_eos=True, seed=11)
    blocks_before = engine.stats()["spec_blocks"]
    first = run(engine, prompts[:3], params, ids=["s0", "s1", "s2"])
    assert engine.stats()["spec_blocks"] > blocks_before
    again = run(engine, prompts[:3], params, ids=["s0", "s1", "s2"])  # seeded: the same draws
    assert first == again
    assert all(len(tokens) == 16 for tokens in first.values())


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"speculative": "medusa", "draft_model": "x"}, "unknown speculative method 'medusa'"),
        ({"speculative": "dflash"}, "needs a draft_model"),
        ({"draft_model": "x"}, "draft_model is set but speculative decoding is not"),
        ({"speculative": "dflash", "draft_model": "/nonexistent/drafter"}, "is neither a shipped drafter"),
    ],
)
def test_bad_speculative_settings_are_refused(beam, settings, message):
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        LLMEngine(beam, config=EngineConfig(**SMALL, **settings))


def test_incompatible_drafter_is_refused(beam, tmp_path):
    wrong = DRAFTER.replace(num_key_value_heads=4, num_attention_heads=4, head_dim=8, target_layer_ids=(1, 9))
    D.save_drafter(tmp_path, wrong, D.init_drafter_params(wrong, dtype=jnp.float32))
    with pytest.raises(ValueError, match=r"target_layer_ids \[9\] are not layers.*KV heads x head_dim 4x8 != the target.s 2x16"):
        LLMEngine(beam, config=EngineConfig(**SMALL, speculative="dflash", draft_model=str(tmp_path)))


def test_num_speculative_tokens_beyond_the_block_is_refused(beam, draft_dir):
    with pytest.raises(ValueError, match=r"num_speculative_tokens must be in \[1, 3\]"):
        LLMEngine(beam, config=EngineConfig(**SMALL, speculative="dflash", draft_model=str(draft_dir),
                                            num_speculative_tokens=4))


def test_beam_serve_flags_build_a_speculative_engine(draft_dir):
    args = parser().parse_args(
        CLI_SMALL + ["--speculative", "dflash", "--draft-model", str(draft_dir), "--num-speculative-tokens", "2"]
    )
    engine = build_engine(args)
    assert engine.runner.speculation.num_drafts == 2
    assert engine.stats()["spec_blocks"] == 0 and not engine.stats()["spec_simulated"]
    with pytest.raises(SystemExit, match="unknown speculative method 'eagle'"):
        build_engine(parser().parse_args(CLI_SMALL + ["--speculative", "eagle", "--draft-model", str(draft_dir)]))
    with pytest.raises(SystemExit, match="draft_model is set but speculative decoding is not"):
        build_engine(parser().parse_args(CLI_SMALL + ["--draft-model", str(draft_dir)]))


def test_server_streams_speculative_output_and_reports_acceptance(draft_dir):
    # One token bucket (16 = 4 rows of a 4-token block): warm-up compiles little.
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=256, speculative="dflash",
                          draft_model=str(draft_dir))
    messages = [{"role": "user", "content": "def fib(n):"}]
    with live_server(config, seed=2, model="beam-tiny", api_key="k") as (base, async_engine):
        client = openai.OpenAI(base_url=base + "/v1", api_key="k")
        full = client.chat.completions.create(model="beam-tiny", messages=messages, temperature=0, max_tokens=20)
        streamed = "".join(
            chunk.choices[0].delta.content or ""
            for chunk in client.chat.completions.create(
                model="beam-tiny", messages=messages, temperature=0, max_tokens=20, stream=True
            )
            if chunk.choices
        )
        assert streamed == (full.choices[0].message.content or "")
        metrics = httpx.get(base + "/metrics", headers={"Authorization": "Bearer k"}).text
        assert 'beam_spec_decode_acceptance_by_position{position="2"}' in metrics
        assert "beam_spec_decode_simulated 0" in metrics
        assert async_engine.engine.stats()["spec_blocks"] > 0
        assert pool_is_free(async_engine)


def test_shipped_drafter_accepts_three_tokens_per_step_and_stays_lossless():
    """The distilled drafter for beam-tiny-code, by name, on held-out code: a mean accept length of
    at least 3 in the engine (the acceptance item; the offline figure is in benchmarks/train), and
    the same greedy tokens as the engine without it."""
    from beam_jax.train import data

    beam = beam_jax.load("beam-tiny-code", dtype=jnp.float32)
    heldout = data.load_heldout_tokens(beam.tokenizer)
    starts = np.random.default_rng(1).integers(0, len(heldout) - 128, 8)
    prompts = [heldout[s : s + 128].tolist() for s in starts]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    config = {"max_num_seqs": 8, "max_num_batched_tokens": 128, "max_model_len": 256}
    engine = LLMEngine(beam, config=EngineConfig(**config, speculative="dflash", draft_model="beam-tiny-code-dflash"))
    assert run(engine, prompts, params) == run(LLMEngine(beam, config=EngineConfig(**config)), prompts, params)
    assert engine.stats()["spec_mean_accept_length"] >= 3, engine.stats()


def test_speculative_engine_on_a_tp2_mesh_gives_the_tokens_of_one_device(draft_dir):
    """The drafter's parameters replicated and its K/V in the KV-head-split pages (8 CPU devices in a
    subprocess, as beam-serve --tp 2 --speculative dflash builds it)."""
    out = run_worker("1,2", *CLI_SMALL, "--speculative", "dflash", "--draft-model", str(draft_dir))
    assert out["2"]["tokens"] == out["1"]["tokens"]
    assert (out["2"]["param_devices"], out["2"]["cache_devices"]) == (2, 2)
