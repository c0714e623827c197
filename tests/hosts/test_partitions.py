"""pdserve over five hosts (network namespaces on one bridge), started as a user starts it:
`ray start` on each host, then `pdserve up --ray-address <head> --worker-host auto --redis-url
<r>` on the head.

Host a: the Ray head (no CPUs) and `pdserve up` (the router). Host p: the prefill worker. Hosts
d1 and d2: one decode worker each. Host r: Redis (sessions, the prefix index), outside the Ray
cluster, as a managed Redis would be. One cluster and one deployment for the module;
each case leaves it as it found it and ends with the same check: every request ended with the
tokens the offline engine generates greedily, or with a clean error status (its tokens so far
a prefix of those); then every worker is up and holds no KV block, one worker process per
worker host, and nothing is queued or in flight in the router.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import secrets
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import httpx
import psutil
import pytest
import redis

from pdserve.launch.redis_server import RedisServer
from pdserve.proto import pdserve_pb2
from pdserve.redis_keys import (
    DEFAULT_NAMESPACE,
    PUBLIC_TENANT,
    prefix_key,
    scoped_session_id,
    session_key,
)
from tests.e2e.harness import health, stats, token_prompts, wait_until
from tests.hosts.deployment import Deployment, actor_processes, pdserve_up, ray_cluster
from tests.hosts.deployment import settled as deployment_settled
from tests.hosts.netns import Network, hosts
from tests.hosts.traffic import (
    REQUEST_TIMEOUT_S,
    Greedy,
    Outcome,
    check_outcomes,
    generate,
    random_prompts,
    report,
)

NODES = {"p": (1, {"prefill": 1}), "d1": (1, {"decode": 1}), "d2": (1, {"decode": 1})}
HOSTS = ("a", *NODES, "r")
SILENCE_S = 3.0  # --worker-silence-s: a cut is seen within it
KV_TIMEOUT_S = 10.0  # --kv-transfer-timeout-s: a prompt's prefill and push end within it
ENV = {  # small and quick, as tests/e2e run the tiny model
    "PDSERVE_NUM_KV_BLOCKS": "128", "PDSERVE_MAX_MODEL_LEN": "512", "PDSERVE_MAX_NUM_SEQS": "8",
    "PDSERVE_PREFILL_THREADS": "1", "PDSERVE_DECODE_THREADS": "1",
    "PDSERVE_ROUTER_PROCESSES": "1",
    "PDSERVE_PREFILL_PLACEMENT": "fixed",  # every prompt on the prefill host
}
FLAGS = ["--decode-workers", "2", "--worker-silence-s", f"{SILENCE_S:g}",
         "--kv-transfer-timeout-s", f"{KV_TIMEOUT_S:g}"]
# the worker processes each host runs: one prefill or decode actor, none on the head
ACTORS = {"a": [], "p": ["ray::PrefillActor"], "d1": ["ray::DecodeRankActor"],
          "d2": ["ray::DecodeRankActor"], "r": []}
SETTLE_S = 90.0  # a worker relaunched after a cut loads its model again
MARGIN_S = 3.0
REDIS_PORT = 6379  # host r's own network namespace: nothing else binds there
REDIS_HEALTH = "pdserve.redis"  # the router's health service for its Redis
REDIS_HEALTH_S = 2.0  # "pdserve.redis" flips within it (a PING every 0.5 s, 50 ms budget)
FAIL_OPEN_E2E_S = 1.0  # a 16-token turn of a session, Redis cut off (0.15 s + 2 x 50 ms)


@dataclass
class Site:
    network: Network
    deployment: Deployment
    model_dir: str
    redis: RedisServer  # in host r
    greedy: Greedy

    def host_of(self, worker_id: str) -> str:
        """The host whose address the router dials `worker_id` at."""
        address = self.deployment.worker_addresses()[worker_id].rsplit(":", 1)[0]
        return next(name for name, h in self.network.hosts.items() if h.address == address)


@pytest.fixture(scope="module")
def site(tiny_llama_dir, request):
    failed = request.session.testsfailed
    with tempfile.TemporaryDirectory(prefix="pdh", dir="/tmp") as tmp, hosts(HOSTS) as network:
        # the redis-server pdserve bundles, configured as it configures it, in host r
        r = network.hosts["r"].address
        with RedisServer(REDIS_PORT, r, secrets.token_urlsafe(24),
                         launcher=network.command("r", [])) as redis:
            cluster = ray_cluster(network, "a", NODES, tmp)
            flags = [*FLAGS, "--redis-url", f"redis://{r}:{REDIS_PORT}/0"]
            env = {**ENV, "PDSERVE_REDIS_PASSWORD": redis.password}  # as docs/deploy.md says
            with pdserve_up(network, "a", cluster, str(tiny_llama_dir), flags,
                            env) as deployment:
                yield Site(network, deployment, str(tiny_llama_dir), redis,
                           Greedy(str(tiny_llama_dir)))
                if request.session.testsfailed > failed:  # what the service saw, for the report
                    print("pdserve up's log, last 300 lines:\n"
                          + "".join(deployment.lines[-300:]))


# ---- the deployment's state ----

def settled(site: Site, timeout: float = SETTLE_S) -> pdserve_pb2.Stats:
    """Every worker up and idle, one worker process per worker host (`deployment.settled`)."""
    return deployment_settled(site.network, site.deployment.address,
                              ["decode-0", "decode-1", "prefill-0"], ACTORS, timeout)


def replaced(site: Site, worker_id: str, old_address: str) -> bool:
    """The worker is up in the router at another address than `old_address` (its relaunch)."""
    up = {w.worker_id: w.up for w in stats(site.deployment.address).workers}.get(worker_id)
    return bool(up) and site.deployment.worker_addresses()[worker_id] != old_address


async def supervisor_found_dead(site: Site, worker_id: str, since: int) -> None:
    """Until the supervisor has taken the worker for dead (its ping unanswered for
    --worker-silence-s), so it is relaunched: a link back sooner could make either outcome,
    as the router's own silence timer (readmission on a fresh stream) runs as long."""
    line = f"pdserve.launch.supervisor: worker {worker_id} is down"
    end = time.monotonic() + SILENCE_S + 2 * MARGIN_S
    while line not in site.deployment.log_since(since):
        assert time.monotonic() < end, f"the supervisor did not take {worker_id} for dead"
        await asyncio.sleep(0.05)


def migrations(site: Site) -> float:
    text = httpx.get(site.deployment.metrics_url, timeout=10).text
    match = re.search(r'^pdserve_router_migrations_total\{outcome="ok"\} (\S+)$', text, re.M)
    return float(match[1]) if match else 0.0


def redis_client(site: Site) -> redis.Redis:
    """A client of host r's Redis from here (the root namespace reaches every host)."""
    return redis.Redis.from_url(site.redis.url, socket_timeout=2, socket_connect_timeout=2)


def redis_up_gauge(site: Site) -> float | None:
    text = httpx.get(site.deployment.metrics_url, timeout=10).text
    match = re.search(r"^pdserve_redis_up (\S+)$", text, re.M)
    return float(match[1]) if match else None


def redis_servers(site: Site) -> dict[str, int]:
    """How many redis-server processes each host runs."""
    found = {}
    for host in HOSTS:
        found[host] = 0
        for pid in site.network.pids(host):
            with contextlib.suppress(psutil.Error):  # its title is "<path> <address>:<port>"
                found[host] += psutil.Process(pid).name() == "redis-server"
    return found


def greedy_round(site: Site, case: str, tag: str, prompts: Sequence[Sequence[int]],
                 max_tokens: int) -> None:
    """The prompts at once, each to its undisturbed greedy tokens; their TTFT and E2E
    reported; the deployment left settled."""
    want = site.greedy(prompts, max_tokens)

    async def run():
        async with grpc.aio.insecure_channel(site.deployment.address) as channel:
            return await asyncio.gather(*(generate(channel, f"{tag}-{i}", p, max_tokens)
                                          for i, p in enumerate(prompts)))

    outcomes = asyncio.run(run())
    check_outcomes(outcomes, want)
    report(case, ttft_max_s=max(o.ttft_s for o in outcomes),
           e2e_max_s=max(o.ended - o.sent for o in outcomes))
    settled(site)


# ---- the cases ----

def test_prefill_and_decode_run_on_their_own_hosts(site):
    """The workers bind their hosts' addresses (what the router dials) and their processes
    live in their hosts; greedy streams across the hosts equal the offline engine's."""
    addresses = site.deployment.worker_addresses()
    assert sorted(addresses) == ["decode-0", "decode-1", "prefill-0"], addresses
    assert not any(a.startswith(("127.", "0.0.0.0", "localhost")) for a in addresses.values())
    assert site.host_of("prefill-0") == "p"
    assert {site.host_of("decode-0"), site.host_of("decode-1")} == {"d1", "d2"}
    assert actor_processes(site.network) == ACTORS

    greedy_round(site, "across hosts", "across", token_prompts(4, seed=1), 16)


def test_decode_host_cut_mid_stream_migrates_and_is_readmitted(site):
    """A decode host cut off mid-stream: its streams move to the other decode host and end as
    undisturbed. The supervisor took the worker for dead and relaunches it once the link is
    back: requests sent every 0.5 s from the restore on all succeed, none migrates, and the
    old process, answering again until the supervisor's kill reaches it, is never back in
    rotation; only its replacement is. (The link comes back as soon as the streams have moved
    and the supervisor has spoken: a cut much longer than Ray's node health checks, ~15 s,
    would have Ray drop the node.)"""
    prompts, max_tokens = token_prompts(4, seed=2), 480
    want = site.greedy(prompts, max_tokens)

    async def run():
        async with grpc.aio.insecure_channel(site.deployment.address) as channel:
            victim, host, cut, tasks, moved = await cut_while_streaming(
                site, channel, prompts, max_tokens)
            recovered = await requests_until_replaced(site, channel, victim)
            outcomes = await asyncio.wait_for(asyncio.gather(*tasks), REQUEST_TIMEOUT_S)
            return victim, host, cut, outcomes, moved, recovered

    victim, host, cut, outcomes, moved, (recovered_s, later, moved_later, readmitted_old) = (
        asyncio.run(run()))
    check_outcomes(outcomes, want)
    assert moved >= 1, "no stream was migrated"
    resumed = [s for s in (o.stall(cut) for o in outcomes) if s > SILENCE_S / 2]
    assert resumed and max(resumed) <= SILENCE_S + MARGIN_S, resumed  # the ones that stalled
    check_outcomes(later, site.greedy([after_prompt(i) for i in range(len(later))], 8))
    assert moved_later == 0, "a request placed after the restore had to migrate"
    assert not readmitted_old, f"{victim}'s old process, reported dead, was back in rotation"
    report(f"decode host {host} ({victim}) cut", streams_migrated=moved,
           time_to_migrate_max_s=max(resumed), time_to_replacement_up_s=recovered_s,
           stall_after_restore_max_s=max(o.stall(o.sent) for o in later),
           requests_after_restore=len(later))
    settled(site)


async def cut_while_streaming(site: Site, channel, prompts, max_tokens: int):
    """Streams started, the host of the busiest decode worker cut until they have moved and
    the supervisor has taken the worker for dead, then restored: (the worker, its host, the
    time of the cut, the streams' tasks, the migrations counted meanwhile)."""
    started = [asyncio.Event() for _ in prompts]
    outcomes = [Outcome() for _ in prompts]
    tasks = [asyncio.create_task(generate(channel, f"cut-{i}", p, max_tokens, e, out))
             for i, (p, e, out) in enumerate(zip(prompts, started, outcomes))]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
    now = await asyncio.to_thread(stats, site.deployment.address)
    held = {w.worker_id: (w.num_running + w.num_waiting, w.num_used_blocks)
            for w in now.workers if w.role == "decode"}
    victim = max(held, key=held.get)
    host, before, log_start = site.host_of(victim), migrations(site), len(site.deployment.lines)
    cut = time.monotonic()
    site.network.cut(host)
    try:  # every stream ended, or delivering again after the silence that cut the others
        while not all(t.done() or (o.arrivals and o.arrivals[-1] > cut + SILENCE_S)
                      for t, o in zip(tasks, outcomes)):
            assert time.monotonic() < cut + SILENCE_S + REQUEST_TIMEOUT_S, "no migration"
            await asyncio.sleep(0.05)
        moved = migrations(site) - before
        await supervisor_found_dead(site, victim, log_start)
    finally:
        site.network.restore(host)
    return victim, host, cut, tasks, moved


async def requests_until_replaced(site: Site, channel, victim: str):
    """A request every 0.5 s from now until the victim's replacement has been up for 2 s:
    (seconds to the replacement up, the requests' outcomes, the migrations counted meanwhile,
    whether the old process was back in rotation)."""
    old_address = site.deployment.worker_addresses()[victim]
    before, log_start = migrations(site), len(site.deployment.lines)
    restored, back, tasks = time.monotonic(), None, []
    while back is None or time.monotonic() < back + 2.0:
        assert time.monotonic() < restored + SETTLE_S, f"{victim} not replaced"
        tasks.append(asyncio.create_task(
            generate(channel, f"after-{len(tasks)}", after_prompt(len(tasks)), 8)))
        await asyncio.sleep(0.5)
        if back is None and await asyncio.to_thread(replaced, site, victim, old_address):
            back = time.monotonic()
    outcomes = await asyncio.gather(*tasks)
    # the old process answers again once the link is back, until the supervisor's kill (sent
    # during the cut) reaches it: it must not be back in rotation meanwhile
    readmitted_old = f"worker {victim} is up at {old_address}" in site.deployment.log_since(
        log_start)
    return back - restored, outcomes, migrations(site) - before, readmitted_old


def after_prompt(i: int) -> list[int]:
    return token_prompts(1, seed=100 + i)[0]


def test_prefill_host_cut_mid_prefill(site):
    """The prefill host cut off while a burst of prompts is being prefilled and pushed, and
    requests keep coming: each ends with the undisturbed tokens or a clean error within the KV
    deadline; after the heal the prefill worker (relaunched) serves again."""
    burst, later = random_prompts(8, 240, seed=3), random_prompts(4, 240, seed=4)
    want = site.greedy(burst + later, 8)
    network = site.network
    old_address = site.deployment.worker_addresses()["prefill-0"]
    log_start = len(site.deployment.lines)

    async def run():
        async with grpc.aio.insecure_channel(site.deployment.address) as channel:
            first = asyncio.Event()
            tasks = [asyncio.create_task(generate(channel, f"burst-{i}", p, 8, first))
                     for i, p in enumerate(burst)]
            await asyncio.wait_for(first.wait(), 60)  # one prompt through: the rest on the way
            cut = time.monotonic()
            network.cut("p")
            try:
                for i, prompt in enumerate(later):  # and new requests while it is cut off
                    tasks.append(asyncio.create_task(generate(channel, f"later-{i}", prompt, 8)))
                    await asyncio.sleep(0.25)
                outcomes = await asyncio.wait_for(asyncio.gather(*tasks), REQUEST_TIMEOUT_S)
                await supervisor_found_dead(site, "prefill-0", log_start)
            finally:
                network.restore("p")
            healed = time.monotonic()
            await asyncio.to_thread(wait_until, lambda: replaced(site, "prefill-0", old_address),
                                    SETTLE_S, "the prefill worker's replacement up")
            back_s = time.monotonic() - healed
            served = await asyncio.gather(*(generate(channel, f"healed-{i}", p, 8)
                                            for i, p in enumerate(burst[:3])))
            return cut, outcomes, back_s, served

    cut, outcomes, back_s, served = asyncio.run(run())
    check_outcomes(outcomes, want, errors=True)
    check_outcomes(served, want[:3])
    assert f"worker prefill-0 is up at {old_address}" not in site.deployment.log_since(
        log_start), "prefill-0's old process, reported dead, was back in rotation"
    failed = [o for o in outcomes if o.status != "length"]
    to_error = [o.ended - max(o.sent, cut) for o in failed]
    assert all(t <= KV_TIMEOUT_S + MARGIN_S for t in to_error), to_error
    report("prefill host cut", requests=len(outcomes),
           prefilling_at_cut=sum(o.sent < cut and not any(a <= cut for a in o.arrivals)
                                 for o in outcomes), failed=len(failed),
           time_to_error_max_s=max(to_error, default=0.0), time_to_replacement_up_s=back_s,
           ttft_after_heal_max_s=max(o.ttft_s for o in served))
    settled(site)


def test_kv_pushes_over_a_slow_lossy_link(site):
    """50 ms ± 10 ms and 2% loss between the prefill host and both decode hosts (netem): the KV
    pushes are slower, the tokens the same. Skipped where the kernel has no sch_netem."""
    with site.network.netem("p", ["d1", "d2"], delay_ms=50, jitter_ms=10, loss_pct=2):
        greedy_round(site, "netem 50±10 ms, 2% loss p<->d", "slow",
                     random_prompts(4, 240, seed=5), 8)


def test_redis_host_cut_fails_open(site):
    """Redis's host cut off while 4 streams run, and 4 requests sent during the cut, each of a
    session (its lookup and its store time out): Redis is an optimisation (sessions, prefix
    routing), so every one ends with the undisturbed tokens, none slowed past its budget. The
    router's "pdserve.redis" health reads NOT_SERVING (and pdserve_redis_up 0) within
    REDIS_HEALTH_S of the cut, while the streams still run, and SERVING (1) again within
    REDIS_HEALTH_S of the restore; then requests succeed as before, their sessions stored."""
    # the deployment's Redis is r's: the one redis-server, where the prefill worker publishes
    assert redis_servers(site) == {h: int(h == "r") for h in HOSTS}, redis_servers(site)
    prompts, max_tokens = random_prompts(4, 64, seed=6), 400
    during, after = random_prompts(4, 64, seed=7), random_prompts(2, 64, seed=8)
    want = site.greedy(prompts, max_tokens)
    want_during, want_after = site.greedy(during, 16), site.greedy(after, 16)
    address, network = site.deployment.address, site.network
    assert health(address, REDIS_HEALTH) == "SERVING" and redis_up_gauge(site) == 1.0

    def health_reads(status: str) -> float:
        wait_until(lambda: health(address, REDIS_HEALTH) == status, REDIS_HEALTH_S + MARGIN_S,
                   f"{REDIS_HEALTH} {status}")
        return time.monotonic()

    def gauge_reads(value: float) -> float:  # set just after the health, in the same tick
        with contextlib.suppress(AssertionError):
            wait_until(lambda: redis_up_gauge(site) == value, 1.0, "pdserve_redis_up")
        return redis_up_gauge(site)

    async def run():
        async with grpc.aio.insecure_channel(address) as channel:
            started = [asyncio.Event() for _ in prompts]
            streams = [asyncio.create_task(generate(channel, f"redis-{i}", p, max_tokens, e,
                                                    session_id=f"redis-{i}"))
                       for i, (p, e) in enumerate(zip(prompts, started))]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
            with redis_client(site) as client:  # their prompts' blocks, published in r
                await asyncio.to_thread(wait_until, lambda: client.scard(
                    prefix_key(DEFAULT_NAMESPACE, "prefill-0")), 10, "the prefix index in r")
            cut = time.monotonic()
            network.cut("r")
            try:
                degraded = await asyncio.to_thread(health_reads, "NOT_SERVING")
                gauge_cut = await asyncio.to_thread(gauge_reads, 0.0)
                sent = await asyncio.gather(*(generate(channel, f"redis-cut-{i}", p, 16,
                                                       session_id=f"redis-cut-{i}")
                                              for i, p in enumerate(during)))
                outcomes = await asyncio.wait_for(asyncio.gather(*streams), REQUEST_TIMEOUT_S)
                cut_s = time.monotonic() - cut
            finally:
                network.restore("r")
            restored = time.monotonic()
            back = await asyncio.to_thread(health_reads, "SERVING")
            gauge_back = await asyncio.to_thread(gauge_reads, 1.0)
            later = await asyncio.gather(*(generate(channel, f"redis-after-{i}", p, 16,
                                                    session_id=f"redis-after-{i}")
                                           for i, p in enumerate(after)))
            return (degraded - cut, back - restored, cut_s, outcomes, sent, later, gauge_cut,
                    gauge_back, sum(o.ended > degraded for o in outcomes))

    (to_degraded_s, to_serving_s, cut_s, outcomes, sent, later, gauge_cut, gauge_back,
     streaming_when_degraded) = asyncio.run(run())
    check_outcomes(outcomes, want)
    check_outcomes(sent, want_during)
    check_outcomes(later, want_after)
    assert to_degraded_s <= REDIS_HEALTH_S and to_serving_s <= REDIS_HEALTH_S, (
        to_degraded_s, to_serving_s)
    assert (gauge_cut, gauge_back) == (0.0, 1.0), (gauge_cut, gauge_back)
    assert streaming_when_degraded == len(outcomes), "streams ended before the router noticed"
    e2e_cut = max(o.ended - o.sent for o in sent)
    assert e2e_cut <= FAIL_OPEN_E2E_S, f"a request during the cut took {e2e_cut:.2f} s"
    with redis_client(site) as client:  # sessions are on again: the later turns are stored
        stored = [client.exists(session_key(DEFAULT_NAMESPACE, scoped_session_id(
            PUBLIC_TENANT, f"redis-after-{i}"))) for i in range(len(after))]
    assert stored == [1] * len(after), stored
    report("redis host r cut", time_to_not_serving_s=to_degraded_s,
           time_back_to_serving_s=to_serving_s, cut_s=cut_s,
           ttft_max_during_cut_s=max(o.ttft_s for o in sent), e2e_max_during_cut_s=e2e_cut,
           e2e_max_after_restore_s=max(o.ended - o.sent for o in later),
           stream_stall_max_s=max(o.stall(o.sent) for o in outcomes))
    settled(site)
