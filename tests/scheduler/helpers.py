"""Test helpers: requests, a worker stand-in that produces the worker's output data,
and the invariants of docs/scheduling.md checked after every step."""

from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Callable

from scheduler_svc.core import Request, Scheduler, SchedulerConfig
from shared.stop_rule import is_stop, stop_ids
from shared.token_checksum import token_checksum
from shared.types import ModelRunnerOutput, SamplingParams, SchedulerOutput

EOS = 2


def make_request(req_id: str, prompt: list[int] | int, max_tokens: int = 16, *,
                 arrival: float = 0.0, priority: int = 0, eos: int = EOS,
                 salt: str | None = None, **sampling) -> Request:
    if isinstance(prompt, int):  # n distinct tokens, different per request id
        base = 100 + 10_000 * (zlib.crc32(req_id.encode()) % 1000)
        prompt = list(range(base, base + prompt))
    params = SamplingParams(max_tokens=max_tokens, **sampling)
    return Request(req_id, prompt, params, [eos], arrival, priority, salt)


def make_door(max_model_len: int = 256, vocab_size: int = 2**31 - 1,
              num_blocks: int = 64):
    """The scheduler's door (Engine.check, scheduler_svc/engine.py) over a core of
    these limits; make_request's ids fit its default vocabulary."""
    from scheduler_svc.engine import Engine
    from shared.types import ModelInfo
    info = ModelInfo("m", vocab_size, max_model_len, [EOS], 1, 1, 1, "float32", num_blocks, 16)
    return Engine(make_scheduler(num_blocks, max_model_len=max_model_len), None, info,
                  max_model_len)


def make_scheduler(num_blocks: int = 64, **config) -> Scheduler:
    config.setdefault("max_model_len", 256)
    config.setdefault("max_num_seqs", 8)
    config.setdefault("hash_seed", "test-seed")
    config.setdefault("async_scheduling", False)  # drive() applies each step before the next
    return Scheduler(SchedulerConfig(**config), num_blocks)


class FakeWorker:
    """Keeps each request's token ids like a real worker (including tokens it sampled
    itself) and samples `next_token(req_id, position)` when a step reaches the end.
    Like a real worker it stops a request on a stop token (EOS unless ignore_eos, or
    a stop token id, once min_tokens are out): no more passes for it in that
    multi-step, and a step scheduled behind that skips it (no tokens)."""

    def __init__(self, next_token: Callable[[str, int], int] | None = None) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.next_token = next_token or (lambda req_id, pos: 1000 + pos)
        self.params: dict[str, tuple[SamplingParams, int]] = {}  # and its prompt length
        self.stopped: set[str] = set()
        self.passes: dict[str, int] = {}  # of the last step: passes run per request

    def _stops(self, req_id: str, token: int) -> bool:
        params, num_prompt = self.params[req_id]  # the services' own rule, as a worker's
        return is_stop(token, len(self.tokens[req_id]) - num_prompt,
                       stop_ids(params, {EOS}), params.min_tokens)

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in so.finished_req_ids:
            self.tokens.pop(req_id, None)
            self.params.pop(req_id, None)
            self.stopped.discard(req_id)
        computed = {}
        for new in so.scheduled_new_reqs:
            self.tokens[new.req_id] = [*new.prompt_token_ids, *new.output_token_ids]
            self.params[new.req_id] = (new.sampling_params, len(new.prompt_token_ids))
            computed[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for req_id, resumed, num in zip(cached.req_ids, cached.resumed_from_preemption,
                                        cached.num_computed_tokens):
            computed[req_id] = num
            if resumed:  # as a real worker checks: the scheduler's tokens are ours
                tokens = self.tokens[req_id]
                assert cached.resumed_token_checks[req_id] == (len(tokens),
                                                               token_checksum(tokens))
        out = ModelRunnerOutput(step_id=so.step_id)
        self.passes = {}
        for req_id, n in so.num_scheduled_tokens.items():
            tokens = self.tokens[req_id]
            sampled = []
            self.passes[req_id] = 0 if req_id in self.stopped else 1
            if req_id not in self.stopped and computed[req_id] + n >= len(tokens):
                for k in range(so.num_steps):  # multi-step: each pass feeds the next
                    token = self.next_token(req_id, len(tokens))
                    tokens.append(token)
                    sampled.append(token)
                    self.passes[req_id] = k + 1
                    if self._stops(req_id, token):
                        self.stopped.add(req_id)
                        break
            out.req_ids.append(req_id)
            out.sampled_token_ids.append(sampled)
        return out


class KVWorker(FakeWorker):
    """A FakeWorker that also keeps a paged KV cache: each slot written by a step holds
    (cache salt, token ids up to and including its position), which is what real KV at
    that slot depends on. Block tables follow the step's increments as a worker's do."""

    def __init__(self, next_token=None, salts: dict[str, str | None] | None = None) -> None:
        super().__init__(next_token)
        self.block_size = 0
        # keys a computed position reads (0: all before it), as a windowed model's
        # attention does: each must hold exactly its tokens' KV when read, so a block
        # freed behind a window is never one a step still needs
        self.window = 0
        self.salts = salts if salts is not None else {}
        self.block_tables: dict[str, list[int]] = {}
        self.kv: dict[tuple[int, int], tuple[str | None, tuple[int, ...]]] = {}

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in so.finished_req_ids:
            self.block_tables.pop(req_id, None)
        for req_id in so.preempted_req_ids:
            self.block_tables[req_id] = []
        computed = {}
        for new in so.scheduled_new_reqs:
            self.block_tables[new.req_id] = list(new.block_ids)
            computed[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for req_id, resumed, blocks, num in zip(cached.req_ids, cached.resumed_from_preemption,
                                                cached.new_block_ids, cached.num_computed_tokens):
            table = self.block_tables.setdefault(req_id, [])
            if resumed:
                table.clear()
            table.extend(blocks)
            computed[req_id] = num
        out = super().execute(so)  # token ids first: a step may compute a just-sampled token
        size = self.block_size
        for req_id, n in so.num_scheduled_tokens.items():
            tokens = self.tokens[req_id]
            table = self.block_tables[req_id]
            passes = self.passes[req_id]  # multi-step: a token a pass; 0 if skipped
            written = n * passes if so.num_steps == 1 else passes
            for pos in range(computed[req_id], computed[req_id] + written):
                self.kv[(table[pos // size], pos % size)] = (self.salts.get(req_id),
                                                             tuple(tokens[:pos + 1]))
        for req_id, n in so.num_scheduled_tokens.items():  # every write first, as a layer
            tokens = self.tokens[req_id]
            table = self.block_tables[req_id]
            written = n * self.passes[req_id] if so.num_steps == 1 else self.passes[req_id]
            for pos in range(computed[req_id], computed[req_id] + written):
                for key in range(max(0, pos - self.window + 1) if self.window else 0, pos):
                    assert table[key // size] != 0 and self.kv.get(
                        (table[key // size], key % size)) == (
                            self.salts.get(req_id), tuple(tokens[:key + 1])), \
                        f"{req_id} position {pos} reads a key at {key} it does not hold"
        return out


def check_prefix_cache_holds_written_kv(sched: Scheduler, worker: KVWorker) -> None:
    """Every cached hash points at a block whose every slot holds the KV of exactly the
    tokens that hash names: a prefix hit never serves KV that was not written."""
    size = sched.config.block_size
    for block_hash, block in sched.kv.pool.cached.items():
        last = worker.kv.get((block.block_id, size - 1))
        assert last is not None, f"cached block {block.block_id} was never written"
        salt, prefix = last
        probe = Request("probe", list(prefix), SamplingParams(max_tokens=1), cache_salt=salt)
        sched.hasher(probe)
        assert len(prefix) % size == 0 and probe.block_hashes[-1] == block_hash, \
            f"cached block {block.block_id} holds KV of other tokens than its hash names"
        for j in range(size - 1):
            assert worker.kv.get((block.block_id, j)) == (salt, prefix[:len(prefix) - size + j + 1])


def check_invariants(sched: Scheduler, so: SchedulerOutput | None = None) -> None:
    cfg = sched.config
    if so is not None:
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        assert so.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
    assert len(sched.running) <= cfg.max_num_seqs
    kv = sched.kv
    pool = kv.pool
    # a window's freed entries stand as the null block (0), held by the pool alone
    holders = Counter(b.block_id for blocks in kv.req_to_blocks.values() for b in blocks
                      if b is not pool.null_block)
    for block in pool.blocks[1:]:
        assert block.ref_cnt == holders.get(block.block_id, 0), block
    free = list(pool.free_queue)
    assert len(free) == pool.num_free_blocks
    assert all(b.ref_cnt == 0 for b in free)
    assert pool.num_free_blocks + len(holders) == pool.num_blocks - 1
    for block_hash, block in pool.cached.items():
        assert block.block_hash == block_hash
    for req_id in kv.req_to_blocks:
        assert req_id in sched.requests


def drive(sched: Scheduler, worker: FakeWorker, max_steps: int = 10_000,
          check: bool = True) -> dict[str, list]:
    """Run synchronous steps until every request finished; returns outputs per request."""
    outputs: dict[str, list] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        so = sched.schedule()
        if check:
            check_invariants(sched, so)
        for out in sched.update_from_output(so, worker.execute(so)):
            outputs.setdefault(out.req_id, []).append(out)
        if check:
            check_invariants(sched)
    else:
        raise AssertionError("requests did not finish")
    return outputs


def drive_async(sched: Scheduler, worker: FakeWorker, max_steps: int = 10_000,
                check: bool = True) -> dict[str, list]:
    """Keep two steps in flight: step N+1 is scheduled before step N's result is applied."""
    outputs: dict[str, list] = {}
    in_flight: list[tuple[SchedulerOutput, ModelRunnerOutput]] = []
    for _ in range(max_steps):
        if not in_flight and not sched.has_unfinished_requests():
            break
        if len(in_flight) < 2 and sched.has_unfinished_requests():
            so = sched.schedule()
            if check:
                check_invariants(sched, so)
            in_flight.append((so, worker.execute(so)))  # the worker runs steps in order
            if len(in_flight) < 2:
                continue
        so, mro = in_flight.pop(0)
        for out in sched.update_from_output(so, mro):
            outputs.setdefault(out.req_id, []).append(out)
        if check:
            check_invariants(sched)
    else:
        raise AssertionError("requests did not finish")
    return outputs


def serve_five_in_a_small_pool(driver, **config):
    """Five requests of 20-48 prompt tokens in 11 usable blocks, so they preempt one
    another; returns (each request's tokens, the scheduler's stats), the pool checked
    fully free at the end."""
    s = make_scheduler(num_blocks=12, max_num_batched_tokens=32, max_model_len=128, **config)
    for i in range(5):
        s.add_request(make_request(f"r{i}", 20 + 7 * i, max_tokens=15 + i))
    outs = driver(s, FakeWorker(lambda rid, pos: 500 + (pos * 7 + len(rid)) % 97))
    assert s.num_free_blocks == s.num_total_blocks - 1
    return joined(outs), s.stats()


def joined(outputs: dict[str, list]) -> dict[str, list[int]]:
    return {k: [t for o in v for t in o.new_token_ids] for k, v in outputs.items()}
