"""The engine on fp32 beam-tiny (random weights): concurrent requests give the same greedy tokens as
the same requests run one at a time, through chunked prefill, prefix hits and preemption; pages all
come back; steady state never recompiles; decodes keep going while a long prompt is prefilled."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import beam_jax
from serving import engine as engine_module
from serving import runner as runner_module
from serving.engine import LLM, EngineConfig, LLMEngine
from serving.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def beam():
    return beam_jax.load("beam-tiny", dtype=jnp.float32, seed=4)


def random_prompts(seed):
    """Lengths from 3 to 150 tokens (chunks of 16), and two pairs sharing long prefixes."""
    rng = np.random.default_rng(seed)
    ids = lambda n: rng.integers(16, 8192, n).tolist()  # no special tokens
    shared, shared2 = ids(70), ids(40)
    return [ids(3), shared + ids(9), ids(150), shared + ids(33), ids(41), shared2 + ids(5), shared2 + ids(20), ids(17)]


def run(engine: LLMEngine, prompts, params=GREEDY, ids=None) -> dict[str, list[int]]:
    ids = ids or [f"r{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return done


def test_concurrent_equals_one_at_a_time(beam):
    prompts = random_prompts(0)
    alone = LLMEngine(beam, config=EngineConfig(max_num_batched_tokens=256, enable_prefix_caching=False,
                                                max_model_len=256))
    expected = {}
    for i, prompt in enumerate(prompts):
        expected.update(run(alone, [prompt], ids=[f"r{i}"]))

    # A small pool (54 pages of 16 tokens, 3 cache groups) and a 64-token budget with 16-token chunks.
    busy = LLMEngine(beam, config=EngineConfig(max_num_seqs=6, max_num_batched_tokens=64, max_prefill_chunk=16,
                                               num_pages=54, max_model_len=256))
    got = run(busy, prompts)
    assert got == expected
    stats = busy.stats()
    assert stats["preemptions"] > 0, "the workload should force preemption"
    assert busy.prefix_cache.stats.hit_tokens > 0, "shared prefixes should hit the cache"
    assert len({tuple(v) for v in expected.values()}) == len(prompts)  # outputs are not trivially equal


def test_every_page_returns_after_aborts(beam):
    engine = LLMEngine(beam, config=EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, max_prefill_chunk=16,
                                                 num_pages=60, max_model_len=256))
    prompts = random_prompts(1)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.8, seed=i, max_tokens=20))
    engine.step()
    engine.abort_request("r2")  # 150-token prompt: mid-prefill
    for _ in range(8):
        engine.step()
    decoding = [r.request_id for r in engine.scheduler.running if r.output_ids]
    assert decoding, "some request should be decoding by now"
    engine.abort_request(decoding[0])  # mid-decode
    engine.abort_request("r7")  # possibly still waiting
    while engine.has_unfinished_requests():
        engine.step()
    engine.pool.check_invariants()
    engine.prefix_cache.reset()
    assert engine.pool.num_free == engine.pool.num_pages
    engine.pool.check_invariants()


def test_no_recompilation_after_warmup(beam):
    engine = LLMEngine(beam, config=EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, max_prefill_chunk=32,
                                                 max_model_len=256))
    rng = np.random.default_rng(3)

    def workload(seed):
        prompts = random_prompts(seed)
        params = [SamplingParams(temperature=float(rng.choice([0, 0.7])), top_p=float(rng.choice([1, 0.9])),
                                 top_k=int(rng.choice([0, 20])), seed=int(rng.integers(100)), logprobs=2,
                                 max_tokens=int(rng.integers(1, 30)), stop=["zz"]) for _ in prompts]
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            engine.add_request(f"{seed}-{i}", prompt, p)
        while engine.has_unfinished_requests():
            engine.step()

    engine.warmup()
    warm = engine.runner.compilations
    # token buckets 16, 32, 64, each with the narrow and the widest penalty width (max_model_len)
    assert (engine.runner.buckets, engine.runner.penalty_widths) == ([16, 32, 64], (16, 256))
    assert warm == 6
    workload(10)
    workload(11)
    assert engine.runner.compilations == warm


def test_wide_sampling_state_never_recompiles(beam):
    """What makes the sampling arrays wider is compiled at warm-up too: penalized requests whose
    prompt and output hold more distinct tokens than the narrow penalty width (up to the whole
    context), 20 top logprobs, and more eos and stop ids to suppress under min_tokens than fit a
    narrow array; beside plain requests in the same steps."""
    engine = LLMEngine(beam, config=EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128))
    assert engine.runner.penalty_widths == (16, 128)
    engine.warmup()
    warm = engine.runner.compilations
    rng = np.random.default_rng(8)
    penalized = {
        "repetition_penalty": 1.3,
        "frequency_penalty": 0.5,
        "presence_penalty": 0.2,
        "logprobs": 20,
        "seed": 1,
    }
    requests = [
        (rng.integers(16, 8192, 100).tolist(), SamplingParams(**penalized, max_tokens=27)),  # 100-127 distinct
        (rng.integers(16, 8192, 40).tolist(), SamplingParams(**penalized, max_tokens=12, temperature=0)),
        (
            rng.integers(16, 8192, 5).tolist(),
            SamplingParams(
                temperature=0.8, max_tokens=20, min_tokens=10, logprobs=20, stop_token_ids=list(range(100, 140))
            ),
        ),
        (rng.integers(16, 8192, 9).tolist(), SamplingParams(temperature=0, max_tokens=30)),
    ]
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"w{i}", prompt, params)
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({out.request_id: out.outputs[0] for out in engine.step() if out.finished})
    assert engine.runner.compilations == warm
    assert len(outputs["w0"].token_ids) == 27 and len(outputs["w2"].token_ids) >= 10
    assert all(len(top) == 20 for top in outputs["w0"].top_logprobs)


def test_decodes_continue_while_a_long_prompt_prefills(beam):
    """Every step of a 100-chunk prefill also gives each of 4 decoding requests its next token, so no
    decode waits more than one step (the time per step is measured by benchmarks/engine/mixed.py)."""
    chunk = 16
    engine = LLMEngine(beam, config=EngineConfig(max_num_seqs=8, max_num_batched_tokens=chunk + 4,
                                                 max_prefill_chunk=chunk, max_model_len=2048))
    rng = np.random.default_rng(5)
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"d{i}", rng.integers(16, 8192, 8).tolist(), params)
    for _ in range(3):  # all four are decoding
        engine.step()
    engine.add_request("long", rng.integers(16, 8192, 100 * chunk).tolist(), SamplingParams(max_tokens=1))
    steps = 0
    while "long" in engine._tracked:
        decoded = {out.request_id for out in engine.step() if out.request_id.startswith("d") and out.new_token_ids}
        assert decoded == {"d0", "d1", "d2", "d3"}, f"step {steps}: only {sorted(decoded)} decoded"
        steps += 1
    assert steps >= 100  # the prompt really ran in chunks beside the decodes


def test_same_seed_same_output_in_any_batch(beam):
    llm = LLM(beam, max_num_batched_tokens=64, max_model_len=256)
    prompt = random_prompts(6)[2]
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=10, ignore_eos=True)
    [alone] = llm.generate([prompt], seeded)
    others = [SamplingParams(temperature=1.0, max_tokens=7)] * 3
    outs = llm.generate(random_prompts(7)[:3] + [prompt], others + [seeded])
    assert outs[3].outputs[0].token_ids == alone.outputs[0].token_ids
    [other_seed] = llm.generate([prompt], SamplingParams(temperature=1.0, top_p=0.95, seed=99, max_tokens=10,
                                                          ignore_eos=True))
    assert other_seed.outputs[0].token_ids != alone.outputs[0].token_ids


def test_text_stop_strings_and_logprobs(beam):
    llm = LLM(beam, max_model_len=256)
    [full] = llm.generate("def fib(n):", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3))
    out = full.outputs[0]
    assert out.text == beam.decode(out.token_ids)
    assert len(out.logprobs) == len(out.top_logprobs) == 12 and all(len(t) == 3 for t in out.top_logprobs)
    assert all(lp <= 0 for lp in out.logprobs)
    # Greedy: the chosen token is the most likely one.
    assert [top[0][0] for top in out.top_logprobs] == out.token_ids
    stop = out.text[len(out.text) // 2 : len(out.text) // 2 + 3]
    [cut] = llm.generate("def fib(n):", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop]))
    assert cut.outputs[0].finish_reason == "stop" and cut.outputs[0].stop_reason == stop
    assert out.text.startswith(cut.outputs[0].text) and stop not in cut.outputs[0].text


def test_bad_requests_are_refused(beam):
    engine = LLMEngine(beam, config=EngineConfig(max_model_len=64))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("a", [])
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request("b", [1, 99999])
    with pytest.raises(ValueError, match="context"):
        engine.add_request("c", list(range(16, 80)))
    engine.add_request("d", [20, 21])
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("d", [20, 21])
    assert engine.abort_request("nope") is None
    assert engine.abort_request("d").finished


def test_page_size_defaults_to_the_platforms(beam, monkeypatch):
    """No page size given: 16 tokens here (CPU), 64 on a GPU (the decode kernels' pages); one given is kept."""
    assert LLMEngine(beam, config=EngineConfig(max_model_len=64)).pool.page_tokens == 16
    assert LLMEngine(beam, config=EngineConfig(max_model_len=64, page_tokens=32)).pool.page_tokens == 32
    monkeypatch.setattr(engine_module.jax, "default_backend", lambda: "gpu")
    assert engine_module.default_page_tokens() == 64


def test_small_token_buckets_give_the_same_tokens(beam, monkeypatch):
    """`min_token_bucket=1` (the GPU default): decode steps of 3, 2 and 1 sequences run in buckets of 4, 2
    and 1 tokens, steps that prefill in 16 and up, and the greedy tokens equal those of the default
    buckets (16 and up here)."""
    rng = np.random.default_rng(12)
    prompts = [rng.integers(16, 8192, n).tolist() for n in (5, 7, 9)]  # one prefill step, then decodes
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 6, 9)]
    outputs = {}
    for smallest in (None, 1):
        llm = LLM(beam, max_num_seqs=3, max_num_batched_tokens=32, max_model_len=256, min_token_bucket=smallest)
        sizes = []
        execute = llm.engine.runner.execute
        monkeypatch.setattr(llm.engine.runner, "execute", lambda scheduled, *a, **k: (
            sizes.append((llm.engine.runner.step_bucket(scheduled), sum(s.num_tokens for s in scheduled))),
            execute(scheduled, *a, **k))[1])
        outputs[smallest] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        if smallest == 1:
            assert llm.engine.runner.buckets == [1, 2, 4, 8, 16, 32]
            assert {(4, 3), (2, 2), (1, 1)} <= set(sizes)  # decodes of 3, 2 and 1 sequences
        else:
            assert min(size for size, _ in sizes) == 16
        # The prompts (21 tokens) in one step of 32; a step that prefills never takes a bucket below 16.
        assert (32, 21) in sizes
        runner = llm.engine.runner
        assert runner.bucket(5) == 16 and runner.bucket(5, decodes_only=True) == (8 if smallest else 16)
    assert outputs[1] == outputs[None] and [len(t) for t in outputs[1]] == [3, 6, 9]
    with pytest.raises(ValueError, match="power of two"):  # refused before anything loads
        LLMEngine("/no/such/checkpoint", config=EngineConfig(max_model_len=64, min_token_bucket=3))
    monkeypatch.setattr(engine_module.jax, "default_backend", lambda: "gpu")
    assert runner_module.default_min_token_bucket() == 1


def test_token_span_is_a_slice_of_the_tokens():
    """`Request.token_span` (what a step reads) equals slicing `token_ids`, across the prompt/output edge."""
    from serving.scheduler import Request

    request = Request("a", [5, 6, 7], SamplingParams(), arrival=0, seq_id=0, output_ids=[8, 9])
    for start in range(6):
        for stop in range(start, 7):
            assert request.token_span(start, stop) == request.token_ids[start:stop], (start, stop)


def test_warmup_compiles_small_buckets_for_decodes_only(beam, monkeypatch):
    """With buckets from 1, warm-up runs the buckets below 16 as decode-only steps alone (the only steps
    that take them) and the others as both kinds where there are decode-only programs."""
    engine = LLMEngine(beam, config=EngineConfig(max_num_batched_tokens=32, max_model_len=64, min_token_bucket=1))
    runner = engine.runner
    calls = []
    monkeypatch.setattr(runner, "execute", lambda scheduled, sampling, *, num_tokens, decode_only: calls.append(
        (runner.bucket(num_tokens, decodes_only=decode_only), decode_only)))
    for decode_programs in (False, True):
        calls.clear()
        runner.decode_only_programs = decode_programs
        runner.warmup()
        kinds = [(size, True) for size in (1, 2, 4, 8)] + [
            (size, d) for size in (16, 32) for d in ((False, True) if decode_programs else (False,))]
        assert sorted(set(calls)) == sorted(kinds) and len(calls) == len(kinds) * len(runner.penalty_widths)
