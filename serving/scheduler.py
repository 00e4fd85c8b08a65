"""Continuous batching with chunked prefill: which tokens of which requests run in the next step.

Each step has a token budget (`max_num_batched_tokens`) and a sequence limit (`max_num_seqs`).
Running requests go first, oldest first: a decoding request takes its one new token, a request
still in its prompt takes the next chunk (at most `max_prefill_chunk` tokens). Waiting requests are
then admitted first come, first served while budget, sequence slots and pool pages last. So a long
prompt never stalls decoding: it advances one chunk per step beside the decodes (the mixed batch).

Pages: before a request's tokens are scheduled, the pool is grown to hold them. When the pool runs
out, the newest running request is preempted: its pages go back (after its full pages are offered
to the prefix cache) and it waits again at the front, to be recomputed from its prompt and the
tokens it has produced. Nothing is lost and nothing crashes; a request that cannot fit even alone
is finished with reason "length" (its prompt plus output exceed the pool).

Prefix cache: on admission the request starts on the longest cached prefix of its tokens
(`PrefixCache.match`); its computed full pages are offered back when its prompt is done, when it is
preempted and when it finishes.

All of this is host-side numpy/Python, O(scheduled requests) per step.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
from collections.abc import Iterable, Sequence

from serving.kv_cache import KVPool, PoolExhausted
from serving.prefix_cache import PrefixCache
from serving.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Request:
    """One generation request. `num_computed` tokens of `token_ids` have their KV in the cache;
    the next step computes from there. `seq_id` is the request's sequence in the pool."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: int
    seq_id: int
    output_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    num_cached_prompt_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    # Speculative decoding: tokens the drafter proposed after the last output token, verified by the
    # request's next decode step (the engine sets them; they are never part of `token_ids`).
    draft_tokens: list[int] = dataclasses.field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_span(self, start: int, stop: int) -> list[int]:
        """`token_ids[start:stop]` without building `token_ids` (a step reads a few tokens of a long
        context)."""
        prompt = len(self.prompt_ids)
        if start >= prompt:
            return self.output_ids[start - prompt : stop - prompt]
        if stop <= prompt:
            return self.prompt_ids[start:stop]
        return self.prompt_ids[start:] + self.output_ids[: stop - prompt]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


@dataclasses.dataclass(frozen=True)
class ScheduledRequest:
    request: Request
    start: int  # first position computed this step (= num_computed before the step)
    num_tokens: int  # tokens computed this step, the drafts included
    num_drafts: int = 0  # the last `num_drafts` of them are drafts being verified (request.draft_tokens)

    @property
    def samples(self) -> bool:
        """Whether this step reaches the request's last known token, so its sample is the next token."""
        return self.start + self.num_tokens - self.num_drafts == self.request.num_tokens


@dataclasses.dataclass(frozen=True)
class SchedulerOutput:
    scheduled: tuple[ScheduledRequest, ...]
    preempted: tuple[Request, ...]
    finished: tuple[Request, ...]  # finished by the scheduler itself (too long for the pool)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    def __init__(
        self,
        pool: KVPool,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_prefill_chunk: int | None = None,
        prefix_cache: PrefixCache | None = None,
    ):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prefill_chunk = max_prefill_chunk or max_num_batched_tokens
        self.prefix_cache = prefix_cache
        self.waiting: list[Request] = []  # kept in arrival order
        self.running: list[Request] = []  # kept in arrival order
        self._arrivals = itertools.count()
        self._seq_ids = itertools.count()
        self.num_preemptions = 0

    # -- requests --------------------------------------------------------------------------------

    def add(self, request_id: str, prompt_ids: Iterable[int], params: SamplingParams) -> Request:
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("a request needs at least one prompt token")
        request = Request(request_id, prompt, params, next(self._arrivals), next(self._seq_ids))
        self.waiting.append(request)
        return request

    def abort(self, request: Request) -> None:
        """Drops a waiting or running request and frees its pages (mid-prefill or mid-decode)."""
        if request.finished:
            return
        if request in self.waiting:
            self.waiting.remove(request)
        if request in self.running:
            self.running.remove(request)
        self._release(request, offer=False)
        request.status, request.finish_reason = Status.FINISHED, "abort"

    def finish(self, request: Request, reason: str) -> None:
        """A running request is done (stop, length): its pages go to the prefix cache and the pool."""
        self.running.remove(request)
        self._release(request, offer=True)
        request.status, request.finish_reason = Status.FINISHED, reason

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # -- one step --------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        finished: list[Request] = []

        for request in list(self.running):
            if request not in self.running:  # preempted by an earlier request of this loop
                continue
            if budget == 0 or len(scheduled) == self.max_num_seqs:
                break
            count = self._chunk(request, budget)
            drafts = self._drafts(request, budget - count)
            count += drafts
            while not self._grow(request, count):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            else:
                scheduled.append(ScheduledRequest(request, request.num_computed, count, drafts))
                budget -= count

        # New requests only when nothing had to give way this step (it would just thrash). A request
        # whose prompt shares whole pages with a prompt still being prefilled waits for those pages
        # to be cached instead of computing them a second time (as SGLang's in-batch prefix check).
        for request in list(self.waiting):
            if preempted or budget == 0 or len(self.running) >= self.max_num_seqs:
                break
            if self._shares_pending_prefill(request):
                continue
            if not self._admit(request):
                break
            count = self._chunk(request, budget)
            if not self._grow(request, count):
                self._release(request, offer=False)
                request.num_computed = 0
                if self.running:
                    break
                # Alone in the pool (cache evicted as needed) and still too long: it can never run.
                self.waiting.remove(request)
                request.status, request.finish_reason = Status.FINISHED, "length"
                finished.append(request)
                continue
            self.waiting.remove(request)
            request.status = Status.RUNNING
            self.running.append(request)
            self.running.sort(key=lambda r: r.arrival)
            scheduled.append(ScheduledRequest(request, request.num_computed, count))
            budget -= count
        return SchedulerOutput(tuple(scheduled), tuple(preempted), tuple(finished))

    def update(self, output: SchedulerOutput, num_accepted: Sequence[int] | None = None) -> None:
        """After the step ran: the scheduled tokens now have their KV in the cache, except rejected
        drafts: item i kept `num_accepted[i]` of its drafts, and the sequence is cut after them
        (their pages go back; the rest of the last page is overwritten before it is read)."""
        for i, item in enumerate(output.scheduled):
            request = item.request
            kept = item.num_tokens - item.num_drafts + (num_accepted[i] if item.num_drafts else 0)
            request.num_computed = item.start + kept
            if kept < item.num_tokens:
                self.pool.truncate(request.seq_id, request.num_computed)
            if self.prefix_cache is not None and request.num_computed == len(request.prompt_ids):
                self.prefix_cache.insert(request.seq_id, request.prompt_ids)

    # -- helpers ---------------------------------------------------------------------------------

    def _chunk(self, request: Request, budget: int) -> int:
        remaining = request.num_tokens - request.num_computed
        return min(remaining, budget, self.max_prefill_chunk)

    def _drafts(self, request: Request, budget: int) -> int:
        """How many of its drafts a decoding request verifies this step (what the budget leaves)."""
        if request.num_computed != request.num_tokens - 1:
            return 0
        return min(len(request.draft_tokens), budget)

    def _grow(self, request: Request, count: int) -> bool:
        try:
            self.pool.allocate(request.seq_id, request.num_computed + count)
        except PoolExhausted:
            return False
        return True

    def _shares_pending_prefill(self, request: Request) -> bool:
        """Whether a running request still in its prompt (admitted earlier or this step) will cache
        whole pages of this request's prefix that the cache does not hold yet."""
        if self.prefix_cache is None:
            return False
        page = self.pool.page_tokens
        tokens = request.token_ids
        cached = None
        for other in self.running:
            if other.num_computed >= len(other.prompt_ids):
                continue
            shared = _common_prefix(tokens, other.prompt_ids) // page * page
            if shared < page or shared >= len(tokens):
                continue
            if cached is None:
                cached = self.prefix_cache.match(tokens, touch=False).num_tokens
            if shared > cached:
                return True
        return False

    def _admit(self, request: Request) -> bool:
        """Starts a waiting request's sequence, on a cached prefix when there is one."""
        if self.prefix_cache is not None:
            match = self.prefix_cache.match(request.token_ids)
            if match.num_tokens:
                self.pool.share_prefix(request.seq_id, match.pages_per_group, match.num_tokens)
                request.num_computed = match.num_tokens
                if request.num_preemptions == 0:
                    request.num_cached_prompt_tokens = min(match.num_tokens, len(request.prompt_ids))
                return True
        request.num_computed = 0
        return True

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._release(request, offer=True)
        request.num_computed = 0
        request.draft_tokens = []  # recomputed from its tokens, it drafts again after its prompt
        request.status = Status.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(request)
        self.waiting.sort(key=lambda r: r.arrival)

    def _release(self, request: Request, *, offer: bool) -> None:
        if request.seq_id not in self.pool:
            return
        if offer and self.prefix_cache is not None and request.num_computed:
            self.prefix_cache.insert(request.seq_id, request.token_ids[: request.num_computed])
        self.pool.free(request.seq_id)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
