"""Several processes (hosts), one engine: rank 0 serves HTTP and schedules; every rank runs the same
compiled step.

    beam-serve --nnodes 2 --node-rank 0 --coordinator node0:29500 --tp 8   # node 0: HTTP, scheduler
    beam-serve --nnodes 2 --node-rank 1 --coordinator node0:29500 --tp 8   # node 1: follows node 0

`jax.distributed` joins the processes and the mesh spans every device of every process. A program
on that mesh runs only when every process calls it, with the same inputs; only rank 0 has the
requests, so only rank 0 can build a step's inputs. `Leader` therefore sends each compiled call's
inputs (`ModelRunner.call_step`) to the other ranks before running it, and `follow` (all a rank > 0
does once the model is loaded) receives them and makes the same call. Warm-up is made of such
calls too, so every rank compiles the same programs.

The protocol, per compiled call, over `broadcast_one_to_all` (a psum over every device: a message
must have the same shape on every process, so its size goes first, in a fixed-size header):
  1. header: int32 [command, payload bytes], command STEP or STOP;
  2. after STEP: the pickled inputs (a pytree of host numpy arrays; static fields such as
     `decode_only` travel in its structure), zero-padded to a power of two of at least 4 KiB, so
     the broadcast compiles once per size class, not once per step.
Being generic over the pytree, it carries whatever inputs the runner's programs take. STOP ends the
followers: rank 0 sends it when the server stops. A rank 0 that dies without sending it leaves
them waiting until jax.distributed's heartbeat timeout ends them.
Unpickling is safe here: the bytes come from rank 0's copy of this code, never from a client.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import threading
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

log = logging.getLogger(__name__)

STOP, STEP = 0, 1
MIN_PAYLOAD_BYTES = 4096
COORDINATOR_ENV = "JAX_COORDINATOR_ADDRESS"  # jax.distributed's own variable

# (tree, is_source) -> the source's tree, as numpy, on every process.
Broadcast = Callable[[Any, bool], Any]


def broadcast_one_to_all(tree: Any, is_source: bool) -> Any:
    from jax.experimental import multihost_utils

    return multihost_utils.broadcast_one_to_all(tree, is_source=is_source)


# ---- launch settings -----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Launch:
    """Where this process stands in a multi-process run: `nnodes` processes (one per node, or per
    tray), this one `node_rank`, joined through the coordinator (node 0's HOST:PORT)."""

    nnodes: int = 1
    node_rank: int = 0
    coordinator: str | None = None

    @property
    def is_leader(self) -> bool:
        return self.node_rank == 0


def launch_settings(nnodes: int = 1, node_rank: int = 0, coordinator: str | None = None, environ=os.environ) -> Launch:
    """The validated settings; every problem in one ValueError. Without `coordinator`, jax's own
    JAX_COORDINATOR_ADDRESS is used (for more than one node)."""
    problems = []
    if nnodes < 1:
        problems.append(f"--nnodes must be >= 1, got {nnodes}")
    elif not 0 <= node_rank < nnodes:
        problems.append(f"--node-rank {node_rank} is out of range for --nnodes {nnodes} (0..{nnodes - 1})")
    if nnodes == 1 and coordinator is not None:
        problems.append(f"--coordinator {coordinator} is for several nodes: add --nnodes N")
    coordinator = coordinator or (environ.get(COORDINATOR_ENV) if nnodes > 1 else None)
    if nnodes > 1:
        if not coordinator:
            problems.append(
                f"--nnodes {nnodes} needs --coordinator HOST:PORT (node 0's address, the same on every node; "
                f"or {COORDINATOR_ENV})"
            )
        else:
            host, _, port = coordinator.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                problems.append(f"--coordinator must be HOST:PORT, got {coordinator!r}")
    if problems:
        raise ValueError("; ".join(problems))
    return Launch(nnodes, node_rank, coordinator)


def check_mesh_spans_nodes(launch: Launch, tp: int, ep: int, num_devices: int, local_devices: int) -> None:
    """Several nodes serve one mesh of all their devices: a smaller one would leave some ranks
    without a device in the program that they still have to run."""
    if launch.nnodes > 1 and tp * ep != num_devices:
        raise ValueError(
            f"--nnodes {launch.nnodes} serves on every device of every node: tp x ep must be {num_devices} "
            f"({launch.nnodes} nodes x {local_devices} devices), got tp={tp} x ep={ep} = {tp * ep}"
        )


def initialize(launch: Launch, *, tp: int, ep: int) -> None:
    """Joins the processes (before anything touches a device) and checks the mesh covers them all."""
    if launch.nnodes == 1:
        return
    jax.distributed.initialize(launch.coordinator, num_processes=launch.nnodes, process_id=launch.node_rank)
    check_mesh_spans_nodes(launch, tp, ep, jax.device_count(), jax.local_device_count())


# ---- the messages --------------------------------------------------------------------------------
def payload_size(num_bytes: int) -> int:
    """The padded payload size: a power of two, at least MIN_PAYLOAD_BYTES."""
    size = MIN_PAYLOAD_BYTES
    while size < num_bytes:
        size *= 2
    return size


def send(broadcast: Broadcast, command: int, inputs: Any = None) -> None:
    payload = pickle.dumps(inputs, protocol=pickle.HIGHEST_PROTOCOL) if command == STEP else b""
    broadcast(np.array([command, len(payload)], np.int32), True)
    if command == STEP:
        padded = np.zeros(payload_size(len(payload)), np.uint8)
        padded[: len(payload)] = np.frombuffer(payload, np.uint8)
        broadcast(padded, True)


def receive(broadcast: Broadcast) -> tuple[int, Any]:
    command, num_bytes = (int(v) for v in broadcast(np.zeros(2, np.int32), False))
    if command == STOP:
        return STOP, None
    padded = np.asarray(broadcast(np.zeros(payload_size(num_bytes), np.uint8), False))
    return STEP, pickle.loads(padded[:num_bytes].tobytes())


# ---- rank 0 and the others -----------------------------------------------------------------------
class Leader:
    """Rank 0's side: from now on every compiled call of `runner` first sends its inputs to the
    followers. `stop()` releases them (once; later calls are refused)."""

    def __init__(self, runner, broadcast: Broadcast = broadcast_one_to_all):
        self._run = runner.call_step
        self._broadcast = broadcast
        self._lock = threading.Lock()  # a STOP never lands between a step's header and payload
        self.stopped = False
        runner.call_step = self.call_step  # the instance attribute shadows the method

    def call_step(self, inputs):
        inputs = jax.tree.map(np.asarray, inputs)  # host arrays, and the same kind every rank passes
        with self._lock:
            if self.stopped:
                raise RuntimeError("the followers were stopped: no more steps can run")
            try:
                send(self._broadcast, STEP, inputs)
            except BaseException:
                # Interrupted mid-message (a signal): the followers' next read may be half a step, so
                # nothing more is sent, not even STOP; they end at jax.distributed's heartbeat timeout.
                self.stopped = True
                raise
            return self._run(inputs)

    def stop(self) -> None:
        with self._lock:
            if not self.stopped:
                self.stopped = True
                send(self._broadcast, STOP)


def follow(runner, broadcast: Broadcast = broadcast_one_to_all) -> int:
    """A rank > 0's life after loading: run each compiled call rank 0 sends, until STOP. Returns
    the number of calls."""
    calls = 0
    while True:
        command, inputs = receive(broadcast)
        if command == STOP:
            return calls
        runner.call_step(inputs)
        calls += 1
