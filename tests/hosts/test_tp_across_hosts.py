"""A decode TP group whose two ranks run on two hosts (`--decode-tp 2 --decode-tp-placement
PACK`, each rank asking for more CPUs than one decode host has left), and its follower's host
cut off mid-stream.

Host a: the Ray head and `pdserve up` (the router, the bundled Redis). Host p: the prefill
worker. Hosts d1 and d2: rank 0 (with the `decode` resource) and rank 1 of the one decode
worker: every layer's all-reduce, and the prefill worker's KV push to each rank, cross hosts.
Each case ends as tests/hosts/test_partitions.py's do: every request ended with the offline
engine's greedy tokens or a clean error after a prefix of them; every worker up holding no KV
block, one worker process per worker host, nothing queued or in flight in the router.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from dataclasses import dataclass

import grpc
import pytest

from pdserve.proto import pdserve_pb2
from tests.e2e.harness import stats, token_prompts, wait_until
from tests.hosts.deployment import Deployment, actor_processes, pdserve_up, ray_cluster
from tests.hosts.deployment import settled as deployment_settled
from tests.hosts.netns import Network, hosts
from tests.hosts.traffic import (
    REQUEST_TIMEOUT_S,
    Greedy,
    Outcome,
    check_outcomes,
    generate,
    report,
)

# a decode rank takes 2 CPUs (its threads): d1 holds rank 0 alone, p (1 CPU) none, so rank 1
# can only go to d2
NODES = {"p": (1, {"prefill": 1}), "d1": (2, {"decode": 1}), "d2": (2, {})}
HOSTS = ("a", *NODES)
SILENCE_S = 3.0  # --worker-silence-s
ENV = {
    "PDSERVE_NUM_KV_BLOCKS": "128", "PDSERVE_MAX_MODEL_LEN": "512", "PDSERVE_MAX_NUM_SEQS": "8",
    "PDSERVE_PREFILL_THREADS": "1", "PDSERVE_DECODE_THREADS": "2",
    "PDSERVE_ROUTER_PROCESSES": "1", "PDSERVE_PREFILL_PLACEMENT": "fixed",
}
FLAGS = ["--decode-workers", "1", "--decode-tp", "2", "--decode-tp-placement", "PACK",
         "--worker-silence-s", f"{SILENCE_S:g}", "--kv-transfer-timeout-s", "10"]
ACTORS = {"a": [], "p": ["ray::PrefillActor"], "d1": ["ray::DecodeRankActor"],
          "d2": ["ray::DecodeRankActor"]}
SETTLE_S = 90.0  # a relaunched group loads its model again
MARGIN_S = 3.0


@dataclass
class Site:
    network: Network
    deployment: Deployment
    greedy: Greedy

    def settled(self) -> pdserve_pb2.Stats:
        return deployment_settled(self.network, self.deployment.address,
                                  ["decode-0", "prefill-0"], ACTORS, SETTLE_S)

    def decode_up(self) -> bool:
        return any(w.worker_id == "decode-0" and w.up
                   for w in stats(self.deployment.address).workers)


@pytest.fixture(scope="module")
def site(tiny_llama_dir, request):
    failed = request.session.testsfailed
    with tempfile.TemporaryDirectory(prefix="pdt", dir="/tmp") as tmp, hosts(HOSTS) as network:
        cluster = ray_cluster(network, "a", NODES, tmp)
        with pdserve_up(network, "a", cluster, str(tiny_llama_dir), FLAGS, ENV) as deployment:
            yield Site(network, deployment, Greedy(str(tiny_llama_dir)))
            if request.session.testsfailed > failed:
                print("pdserve up's log, last 300 lines:\n" + "".join(deployment.lines[-300:]))


async def streams(address: str, tag: str, prompts, max_tokens: int):
    async with grpc.aio.insecure_channel(address) as channel:
        return await asyncio.gather(*(generate(channel, f"{tag}-{i}", p, max_tokens)
                                      for i, p in enumerate(prompts)))


def test_tp_group_ranks_on_two_hosts(site):
    """Rank 0 binds d1's address (the router dials it), rank 1 runs in d2; greedy streams
    equal the offline engine's."""
    address = site.deployment.worker_addresses()["decode-0"].rsplit(":", 1)[0]
    assert address == site.network.hosts["d1"].address
    assert actor_processes(site.network) == ACTORS
    prompts = token_prompts(4, seed=11)
    outcomes = asyncio.run(streams(site.deployment.address, "tp", prompts, 16))
    check_outcomes(outcomes, site.greedy(prompts, 16))
    report("decode TP-2 over d1 and d2", ttft_max_s=max(o.ttft_s for o in outcomes),
           e2e_max_s=max(o.ended - o.sent for o in outcomes))
    site.settled()


def test_follower_host_cut_marks_the_group_down_and_it_rejoins(site):
    """d2 (rank 1) cut off mid-stream: rank 0's all-reduce stalls, so the streams end with a
    clean error (no other decode worker to move to) and the whole group is out of rotation
    within the silence bound; after the heal the group is relaunched, both ranks, serving
    greedy output again, and no block is held anywhere."""
    prompts, max_tokens = token_prompts(3, seed=12), 480
    want = site.greedy(prompts, max_tokens)
    old = site.deployment.worker_addresses()["decode-0"]

    async def run():
        async with grpc.aio.insecure_channel(site.deployment.address) as channel:
            started = [asyncio.Event() for _ in prompts]
            outs = [Outcome() for _ in prompts]
            tasks = [asyncio.create_task(generate(channel, f"cut-{i}", p, max_tokens, e, o))
                     for i, (p, e, o) in enumerate(zip(prompts, started, outs))]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
            cut = time.monotonic()
            site.network.cut("d2")
            try:
                await asyncio.to_thread(wait_until, lambda: not site.decode_up(),
                                        SILENCE_S + 2 * MARGIN_S, "decode-0 out of rotation")
                down = time.monotonic()
                outcomes = await asyncio.wait_for(asyncio.gather(*tasks), REQUEST_TIMEOUT_S)
            finally:
                site.network.restore("d2")
            return cut, down, outcomes, time.monotonic()

    cut, down, outcomes, healed = asyncio.run(run())
    check_outcomes(outcomes, want, errors=True)
    to_error = [o.ended - cut for o in outcomes]
    assert max(to_error) <= SILENCE_S + MARGIN_S, to_error
    wait_until(lambda: site.decode_up()
               and site.deployment.worker_addresses()["decode-0"] != old, SETTLE_S,
               "decode-0 relaunched")
    back = time.monotonic()
    site.settled()  # both ranks again, one process each on d1 and d2, no block held
    prompts = token_prompts(2, seed=13)
    served = asyncio.run(streams(site.deployment.address, "healed", prompts, 16))
    check_outcomes(served, site.greedy(prompts, 16))
    report("decode TP follower host d2 cut", time_to_out_of_rotation_s=down - cut,
           time_to_error_max_s=max(to_error), time_to_group_back_s=back - healed)
    site.settled()
