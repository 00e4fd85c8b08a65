"""Several nodes (serving/multihost.py): the launch flags are validated before anything starts; rank
0's compiled calls replayed by a follower leave it in rank 0's state (in one process, with a
recorded broadcast); and `beam-serve` on two processes of 4 CPU devices (`jax.distributed` on
127.0.0.1, TP2 x EP4) answers a client with the greedy tokens of one device, its follower exiting
when rank 0 stops."""

from __future__ import annotations

import concurrent.futures
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import jax
import numpy as np
import pytest

from serving import multihost
from serving.cli import build_engine, main, parser
from serving.sampling import SamplingParams
from tests.beam_jax.test_sharding import ROOT, worker_env
from tests.serving.test_cli import SMALL

# SMALL with one penalty width (max-model-len 16: one program to compile; argparse keeps the last
# value), prompts prefilled in chunks of 4.
TWO_NODES = [*SMALL, "--max-model-len", "16", "--max-prefill-chunk", "4"]
PROMPT_LENGTHS = (3, 6, 8)
MAX_TOKENS = 8


def prompts(vocab_size: int) -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [rng.integers(16, vocab_size, n).tolist() for n in PROMPT_LENGTHS]


def greedy_texts(engine) -> list[str]:
    """The prompts' greedy completions, run together (stopping at EOS, as the API does)."""
    for i, prompt in enumerate(prompts(engine.vocab_size)):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    done = {}
    while engine.has_unfinished_requests():
        done.update((out.request_id, out.outputs[0].text) for out in engine.step() if out.finished)
    return [done[f"r{i}"] for i in range(len(PROMPT_LENGTHS))]


# ---- the launch flags ----------------------------------------------------------------------------
def test_flags_and_their_alias():
    args = parser().parse_args(["--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "node0:29500"])
    assert (args.nnodes, args.node_rank, args.coordinator) == (2, 1, "node0:29500")
    args = parser().parse_args([])
    assert (args.nnodes, args.node_rank, args.coordinator) == (1, 0, None)
    launch = multihost.launch_settings(2, 1, "node0:29500")
    assert launch == multihost.Launch(2, 1, "node0:29500") and not launch.is_leader
    assert multihost.launch_settings().is_leader


def test_coordinator_from_jax_environment_variable():
    env = {multihost.COORDINATOR_ENV: "10.0.0.1:1234"}
    assert multihost.launch_settings(2, 0, None, environ=env).coordinator == "10.0.0.1:1234"
    assert multihost.launch_settings(2, 0, "node0:1", environ=env).coordinator == "node0:1"  # the flag wins
    assert multihost.launch_settings(1, 0, None, environ=env).coordinator is None  # one node: not used


@pytest.mark.parametrize(
    ("nnodes", "node_rank", "coordinator", "error"),
    [
        (2, 2, "h:1", r"--node-rank 2 is out of range for --nnodes 2 \(0\.\.1\)"),
        (2, -1, "h:1", r"--node-rank -1 is out of range"),
        (0, 0, None, r"--nnodes must be >= 1, got 0"),
        (2, 0, None, r"--nnodes 2 needs --coordinator HOST:PORT .*JAX_COORDINATOR_ADDRESS"),
        (2, 0, "node0", r"--coordinator must be HOST:PORT, got 'node0'"),
        (2, 0, "node0:http", r"--coordinator must be HOST:PORT"),
        (2, 0, ":29500", r"--coordinator must be HOST:PORT"),
        (1, 0, "node0:29500", r"--coordinator node0:29500 is for several nodes: add --nnodes N"),
        (1, 1, None, r"--node-rank 1 is out of range for --nnodes 1"),
    ],
)
def test_bad_launch_settings_are_named(nnodes, node_rank, coordinator, error):
    with pytest.raises(ValueError, match=error):
        multihost.launch_settings(nnodes, node_rank, coordinator, environ={})


def test_cli_exits_with_the_reason_before_touching_devices():
    with pytest.raises(SystemExit, match=r"^error: --node-rank 3 is out of range for --nnodes 2"):
        main([*SMALL, "--nnodes", "2", "--node-rank", "3", "--coordinator", "127.0.0.1:1"])
    assert not jax.distributed.is_initialized()


def test_the_mesh_must_span_every_node():
    launch = multihost.Launch(2, 0, "h:1")
    with pytest.raises(ValueError, match=r"tp x ep must be 8 \(2 nodes x 4 devices\), got tp=4 x ep=1 = 4"):
        multihost.check_mesh_spans_nodes(launch, 4, 1, num_devices=8, local_devices=4)
    multihost.check_mesh_spans_nodes(launch, 2, 4, num_devices=8, local_devices=4)
    multihost.check_mesh_spans_nodes(multihost.Launch(), 1, 1, num_devices=8, local_devices=8)  # one node: any


# ---- the protocol, in one process ----------------------------------------------------------------
class RecordedBroadcast:
    """Rank 0's broadcasts, recorded; a follower reads them back in order and checks that what it
    passes has the shape and dtype rank 0's message had (a real broadcast needs them equal)."""

    def __init__(self):
        self.messages: list[np.ndarray] = []
        self.read = 0

    def __call__(self, tree, is_source):
        if is_source:
            self.messages.append(np.array(tree))
            return tree
        sent = self.messages[self.read]
        self.read += 1
        assert (tree.shape, tree.dtype) == (sent.shape, sent.dtype)
        return sent


def test_a_follower_replaying_rank_0s_calls_ends_in_its_state():
    """Rank 0 warms up and serves greedy requests with a `Leader`; a second engine following its
    recorded messages compiles the same programs and ends with the same KV cache."""
    leading, following = (build_engine(parser().parse_args(TWO_NODES)) for _ in range(2))
    broadcast = RecordedBroadcast()
    leader = multihost.Leader(leading.runner, broadcast)
    leading.warmup()
    texts = greedy_texts(leading)
    assert len(set(texts)) == len(texts)
    leader.stop()
    leader.stop()  # once
    with pytest.raises(RuntimeError, match="followers were stopped"):
        leading.warmup()

    calls = multihost.follow(following.runner, broadcast)
    assert broadcast.read == len(broadcast.messages)
    assert calls == (len(broadcast.messages) - 1) // 2  # a header and a payload per call, then STOP
    assert calls > len(leading.runner.buckets)  # warm-up and the steps
    assert following.runner.compilations == leading.runner.compilations
    for got, want in zip(jax.tree.leaves(following.runner.cache), jax.tree.leaves(leading.runner.cache), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    sizes = {m.size for m in broadcast.messages[1::2] if m.dtype == np.uint8}
    assert all(s >= multihost.MIN_PAYLOAD_BYTES and s & (s - 1) == 0 for s in sizes)  # few programs


def test_messages_round_trip_any_pytree():
    broadcast = RecordedBroadcast()
    inputs = ({"a": np.arange(5, dtype=np.int32), "none": None}, [np.ones((2, 3), np.float32)], 7)
    multihost.send(broadcast, multihost.STEP, inputs)
    multihost.send(broadcast, multihost.STOP)
    command, got = multihost.receive(broadcast)
    assert command == multihost.STEP and repr(got) == repr(inputs)
    assert multihost.receive(broadcast) == (multihost.STOP, None)
    assert multihost.payload_size(1) == 4096 and multihost.payload_size(4097) == 8192


# ---- beam-serve on two processes -----------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_serving(url: str, procs, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for proc in procs:
            if proc.poll() is not None:
                raise AssertionError(
                    f"a beam-serve process exited early ({proc.returncode}):\n{proc.stderr.read()[-6000:]}"
                )
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError("beam-serve did not start")


def test_beam_serve_on_two_processes_answers_like_one_device():
    """Node 0 serves HTTP and drives every step; node 1 follows; the mesh (TP2 x EP4) spans both.
    Three concurrent greedy requests get one device's tokens; SIGTERM to node 0 ends both."""
    coordinator, port = f"127.0.0.1:{free_port()}", free_port()
    flags = [*TWO_NODES, "--tp", "2", "--ep", "4", "--nnodes", "2", "--coordinator", coordinator, "--port", str(port)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "serving.cli", *flags, "--node-rank", str(rank), "--log-level", "warning"],
            cwd=ROOT,
            env=worker_env(4),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        reference = build_engine(parser().parse_args(TWO_NODES))  # one device, in this process
        want = greedy_texts(reference)
        url = f"http://127.0.0.1:{port}"
        wait_until_serving(url, procs)

        def complete(prompt):
            body = {"model": "beam-tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
            reply = httpx.post(url + "/v1/completions", json=body, timeout=120)
            assert reply.status_code == 200, reply.text
            return reply.json()["choices"][0]["text"]

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            got = list(pool.map(complete, prompts(reference.vocab_size)))
        assert got == want and len(set(got)) == len(got)

        procs[0].send_signal(signal.SIGTERM)
        errors = [proc.communicate(timeout=120)[1] for proc in procs]
        assert [proc.returncode for proc in procs] == [0, 0], errors[0][-3000:] + errors[1][-3000:]
        calls = int(re.search(r"node 1: node 0 stopped after (\d+) compiled calls", errors[1])[1])
        assert calls >= 1 + 2 + MAX_TOKENS - 1  # warm-up, the longest prompt's 2 chunks, its decodes
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
