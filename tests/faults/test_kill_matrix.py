"""The process-fault matrix: kill or stall each worker process at each stage of a request.

One real service for the module (Ray on two raylets, the bundled redis-server, the router):
1 prefill worker and 1 decode worker of TP=2 (rank 0 serves, rank 1 follows), on a model
slow enough that a 3000-token prefill takes about a second. Each case SIGKILLs (or SIGSTOPs,
then SIGCONTs) one process while a request is (a) prefilling, its KV on the way to the decode
ranks, or (b) decoding; or stops Redis under running requests. Every case must end with a
clear status, OK or UNAVAILABLE and never a hang, within STATUS_BOUND_S of the fault; then,
once the supervisor has restarted what died, every worker holds 0 used KV blocks, the router
holds no flight, and a new request is served.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time
import zlib
from dataclasses import dataclass

import pytest

from pdserve.client import Client, PdserveError
from pdserve.engine.sampling_params import SamplingParams
from tests.e2e.harness import running, tiny_settings, wait_until

# The router takes a decode worker whose Outputs stream says nothing (not even its 1 s
# keepalive) this long for dead and fails its streams; the supervisor's ping timeout is the same
# (`--worker-silence-s`, 10 s by default: 5 here, so each stall case waits half as long). A
# killed process is seen at once (its sockets close), a stalled one within this bound.
WORKER_SILENCE_S = 5.0
# 2 CPU cores shared with the workers and other tests: scheduling, a gloo error surfacing,
# the router's retry and cleanup.
SLACK_S = 10.0
STATUS_BOUND_S = WORKER_SILENCE_S + SLACK_S
# A relaunch reloads the model on every rank of the group and re-forms gloo: ~10 s on an
# idle machine, several times that on 2 busy cores (as tests/e2e/test_failures.py allows).
RESTART_S = 120.0
# A stall below every liveness bound above: a busy or paused worker is not a dead one.
SHORT_STALL_S = 2.0
CLIENT_TIMEOUT_S = 120.0  # the RPC deadline: far beyond the bound, so a hang shows as one
LONG_PROMPT_LEN = 3000  # ~1 s of prefill on the slow model, 188 KV blocks
DECODE_LONG = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)  # 4000 in all
# ~1 s of decoding on TP=2: still running when a fault lands on it (the cases check so),
# done soon after
DECODE_SHORT = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
NUM_WORKERS = 2  # prefill-0 and decode-0 (a TP group is one worker)
PROCESSES = {"prefill": ("prefill-0", 0), "decode": ("decode-0", 0),
             "follower": ("decode-0", 1)}  # target -> (worker id, rank)


@pytest.fixture(scope="module")
def service(ray_cluster, slow_model_dir):
    settings = tiny_settings(slow_model_dir, ray_cluster.address, decode_tp=2,
                             max_model_len=4096, num_kv_blocks=512,
                             max_num_batched_tokens=512, worker_silence_s=WORKER_SILENCE_S)
    with running(settings) as service:
        yield service


@dataclass(frozen=True)
class Outcome:
    status: str  # "OK" or the gRPC status name
    num_tokens: int
    ended_at: float  # time.monotonic()


class Stream:
    """One Generate call read on a daemon thread (a hung call cannot hold the test up)."""

    def __init__(self, address: str, prompt: list[int], params: SamplingParams,
                 request_id: str, session_id: str = "") -> None:
        self.request_id, self.num_tokens = request_id, 0
        self._outcome: Outcome | None = None
        self._done = threading.Event()
        args = (address, prompt, params, session_id)
        threading.Thread(target=self._run, args=args, daemon=True).start()

    def _run(self, address: str, prompt: list[int], params: SamplingParams,
             session_id: str) -> None:
        status = "OK"
        try:
            with Client(address, timeout=CLIENT_TIMEOUT_S) as client:
                for chunk in client.generate(prompt, sampling=params, session_id=session_id,
                                             request_id=self.request_id):
                    self.num_tokens += len(chunk.token_ids)
        except PdserveError as exc:
            status = exc.code.name
        self._outcome = Outcome(status, self.num_tokens, time.monotonic())
        self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def outcome(self, by: float) -> Outcome:
        """The call's outcome once it ends, which it must by `by` (time.monotonic())."""
        if not self._done.wait(max(by - time.monotonic(), 0.0)):
            raise AssertionError(f"{self.request_id}: no status by the bound, a hang "
                                 f"({self.num_tokens} tokens streamed)")
        return self._outcome


def long_prompt(seed: int) -> list[int]:
    """A prompt no earlier case has cached (the prefill worker would skip a cached one)."""
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(LONG_PROMPT_LEN)]


def pid_of(service, target: str) -> int:
    worker_id, rank = PROCESSES[target]
    return service.service.pool.pids(worker_id)[rank]


def start_at_stage(service, stage: str, request_id: str, seed: int,
                   params: SamplingParams = DECODE_LONG) -> Stream:
    """A request that is, on return, prefilling (its KV on the way) or decoding."""
    if stage == "prefill":
        stream = Stream(service.address, long_prompt(seed), params, request_id)
        flights = service.router.flights
        wait_until(lambda: stream.done or (f := flights.get(request_id)) is not None
                   and f.prefill is not None, 30, f"{request_id}: the prefill RPC is under way")
        assert not stream.done, f"{request_id} ended before the fault: {stream.outcome(0)}"
        time.sleep(0.2)  # into the prompt: some layers' KV is on the wire already
        flight = flights.get(request_id)
        assert stream.num_tokens == 0 and flight is not None and flight.prefill is not None, (
            "the prefill finished before the fault: the model is too fast for this machine")
        return stream
    stream = Stream(service.address, [5, 6, 7, seed % 1000 + 8], params, request_id)
    wait_until(lambda: stream.num_tokens >= 4 or stream.done, 60, f"{request_id} decodes")
    assert not stream.done, f"{request_id} ended before the fault: {stream.outcome(0)}"
    return stream


def replaced(service, target: str, old_pid: int) -> bool:
    try:
        return pid_of(service, target) != old_pid
    except Exception:  # its actor is dead, or its replacement is still starting
        return False


def recovered(service, quiescent, old_pid: int | None = None, target: str = "") -> None:
    """Every worker back, holding nothing; the faulted one restarted if it was killed (until
    the supervisor sees a dead follower, rank 0 still answers the router: not a recovery)."""
    if old_pid is not None:
        wait_until(lambda: replaced(service, target, old_pid), RESTART_S, f"{target} restarted")
    quiescent(service, NUM_WORKERS, RESTART_S)
    with Client(service.address, timeout=60) as client:
        done = client.complete([9, 10, 11], sampling=SamplingParams(
            temperature=0, max_tokens=4, ignore_eos=True))
    assert done.usage.completion_tokens == 4
    quiescent(service, NUM_WORKERS, 10)


def signal_if_alive(pid: int, sig: int) -> None:
    """The supervisor may have killed (and replaced) a stalled process already."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


@pytest.mark.parametrize("stage", ["prefill", "decode"])
@pytest.mark.parametrize("target", ["prefill", "decode", "follower"])
def test_sigkill_ends_the_request_and_frees_every_block(service, quiescent, target, stage):
    quiescent(service, NUM_WORKERS, RESTART_S)  # the previous case's restart is done
    pid = pid_of(service, target)
    expect_ok = target == "prefill" and stage == "decode"  # nothing of it is left there
    stream = start_at_stage(service, stage, f"kill-{target}-{stage}",
                            seed=zlib.crc32(f"{target}-{stage}".encode()),
                            params=DECODE_SHORT if expect_ok else DECODE_LONG)
    os.kill(pid, signal.SIGKILL)
    outcome = stream.outcome(by=time.monotonic() + STATUS_BOUND_S)
    assert outcome.status in ("OK", "UNAVAILABLE"), outcome
    if expect_ok:
        assert outcome == Outcome("OK", DECODE_SHORT.max_tokens, outcome.ended_at)
    recovered(service, quiescent, pid, target)


@pytest.mark.parametrize("target,stage", [("prefill", "prefill"), ("decode", "decode")])
def test_short_stall_is_not_a_death(service, quiescent, target, stage):
    quiescent(service, NUM_WORKERS, RESTART_S)
    pid = pid_of(service, target)
    stream = start_at_stage(service, stage, f"stall-{target}", seed=20 + len(target),
                            params=DECODE_SHORT)
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(SHORT_STALL_S)
        assert not stream.done, f"the request ended before the stall: {stream.outcome(0)}"
    finally:
        os.kill(pid, signal.SIGCONT)
    outcome = stream.outcome(by=time.monotonic() + STATUS_BOUND_S)
    assert (outcome.status, outcome.num_tokens) == ("OK", DECODE_SHORT.max_tokens), outcome
    recovered(service, quiescent)
    assert pid_of(service, target) == pid, f"a {SHORT_STALL_S} s stall got {target} restarted"


@pytest.mark.parametrize("target,stage", [("prefill", "prefill"), ("decode", "decode"),
                                          ("follower", "decode")])
def test_long_stall_fails_the_request_within_the_bound(service, quiescent, target, stage):
    quiescent(service, NUM_WORKERS, RESTART_S)
    pid = pid_of(service, target)
    stream = start_at_stage(service, stage, f"hang-{target}", seed=40 + len(target))
    os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    try:  # stopped until the supervisor replaces it: only a timeout can end the request
        outcome = stream.outcome(by=stopped + STATUS_BOUND_S)
        wait_until(lambda: replaced(service, target, pid), RESTART_S, f"{target} restarted")
    finally:
        signal_if_alive(pid, signal.SIGCONT)
    assert outcome.status == "UNAVAILABLE", outcome
    recovered(service, quiescent)


@contextlib.contextmanager
def supervisor_blind(service, ping_timeout_s: float = 600.0):
    """The supervisor, for the block, waits `ping_timeout_s` for a ping (it reads the value at
    each ping): a stopped process then stands for one it cannot see is stuck (a wedged engine
    loop whose actor still answers pings, a half-open connection), which only the router's
    own watch on the Outputs stream can find."""
    supervisor = service.service.pool._supervisor
    saved, supervisor.ping_timeout_s = supervisor.ping_timeout_s, ping_timeout_s
    try:
        yield
    finally:
        supervisor.ping_timeout_s = saved


def test_silent_decode_worker_fails_its_streams_without_the_supervisor(service, quiescent):
    quiescent(service, NUM_WORKERS, RESTART_S)
    pid = pid_of(service, "decode")
    with supervisor_blind(service):
        stream = start_at_stage(service, "decode", "silent-decode", seed=80)
        os.kill(pid, signal.SIGSTOP)
        try:
            outcome = stream.outcome(by=time.monotonic() + STATUS_BOUND_S)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert outcome.status == "UNAVAILABLE", outcome
        recovered(service, quiescent)  # resumed: the router's aborts freed its blocks
    assert pid_of(service, "decode") == pid  # nobody restarted it: the router found it


def test_redis_stopped_under_load_fails_open(service, quiescent):
    quiescent(service, NUM_WORKERS, RESTART_S)
    redis_server = service.service.redis
    streams = [Stream(service.address, [7, 8, i], DECODE_SHORT, f"redis-{i}", f"sess-{i}")
               for i in range(3)]
    wait_until(lambda: all(s.num_tokens >= 2 for s in streams), 60, "every stream decodes")
    assert not any(s.done for s in streams), "a stream ended before Redis stopped"
    redis_server.stop()
    try:
        stopped = time.monotonic()
        outcomes = [s.outcome(by=stopped + STATUS_BOUND_S) for s in streams]
        served = ("OK", DECODE_SHORT.max_tokens)
        assert [(o.status, o.num_tokens) for o in outcomes] == [served] * 3, outcomes
        # new requests, sessions and a long prompt (prefix routing) included, still served
        late = [Stream(service.address, long_prompt(60), DECODE_SHORT, "redis-late",
                       "sess-0"),
                Stream(service.address, [7, 8, 0, 9], DECODE_SHORT, "redis-late-2", "sess-1")]
        outcomes = [s.outcome(by=time.monotonic() + STATUS_BOUND_S) for s in late]
        assert [(o.status, o.num_tokens) for o in outcomes] == [served] * 2, outcomes
        quiescent(service, NUM_WORKERS, 10)
    finally:
        redis_server.start()  # same port, empty: later tests get their Redis back
    recovered(service, quiescent)
