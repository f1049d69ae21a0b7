"""Many engines behind SGLang's router (README, "Many engines behind SGLang's router"): data
parallelism as slime runs it. Two shoal servers, each its own process on the tiny model, and
SGLang's router (`sglang-router`, the test extra, its own process) in front of them with the
cache_aware policy, all on 127.0.0.1. The workers register as slime registers its engines
(`POST {router}/workers`), or, for the fail-over test, are named on the router's command line:

- prefix affinity: requests that share a prefix all go to one worker, whose prefix cache serves
  the shared part; a new prefix goes to the worker with fewer requests in flight;
- fail-over: a worker killed (SIGKILL) while it holds two requests: the plain one is retried on
  the survivor and answered as the survivor answers it, every later request is answered by the
  survivor, and the streamed one, whose 200 the router had passed on, is cut (the one loss the
  router's design has: it cannot replay a stream it started); the router then marks the worker
  unhealthy, and slime's removal (`DELETE /workers/{id}`) takes it out of the fan-out;
- fan-out: `POST {router}/flush_cache` empties every worker's prefix cache; a weight update sent
  to every worker `GET {router}/workers` lists (slime's way: the router forwards no update)
  reaches them all; `GET {router}/get_loads` reads each worker's `GET /get_load`;
- what reaches a worker: what the router's own types hold (a misspelt field is dropped).

What the router does is sglang-router 0.3.2's (pinned in pyproject.toml's test extra).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("sglang_router") is None,
    reason="needs sglang-router (the test extra: pip install -e '.[test]')",
)

MODEL = "tiny"
START_S = 120.0  # a server's or the router's start, on a loaded CI machine
WAIT_S = 20.0  # anything else the router or a server does on its own
# Prompts with no common start: the router's tree matches text from its first character.
SHARED = "The quick brown fox jumps over the lazy dog. " * 4
OTHER = "Once upon a time there was a little model that wanted to generate text. " * 2
UPDATED = "Weights can be updated from disk while the engine stays up."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Process:
    """A child process with its output in a log file, stopped (SIGKILL) at the end."""

    def __init__(self, argv: list[str], log_path: Path) -> None:
        self.log_path = log_path
        self.log: IO[bytes] = log_path.open("wb")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_until(self, url: str, ready: Any, what: str) -> None:
        """Poll GET url until ready(status, body) holds, within START_S; an exit fails at once."""
        deadline = time.monotonic() + START_S
        while True:
            assert self.proc.poll() is None, f"{what} exited: {self.log_tail()}"
            with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=5) as response:
                if ready(response.status, response.read()):
                    return
            assert time.monotonic() < deadline, f"{what} not ready in {START_S}s: {self.log_tail()}"
            time.sleep(0.1)

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-2000:]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self.log.close()


class Worker(Process):
    """`python -m shoal serve` on the tiny model."""

    def __init__(self, folder: Path, log_path: Path) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        argv = [
            sys.executable, "-m", "shoal", "serve", "--model", str(folder),
            "--host", "127.0.0.1", "--port", str(port), "--served-model-name", MODEL,
            "--num-threads", "1",
        ]  # fmt: skip
        super().__init__(argv, log_path)


class Router(Process):
    """The README's router command, given the workers on its command line (or none: they
    register by POST /workers), with health checks every second rather than every 5 s.
    --cb-failure-threshold 3, below the router's 5 attempts at a request: a dead worker's
    circuit breaker opens on a request's third failed attempt, and its fourth goes to another
    worker."""

    def __init__(self, listed: list[Worker], log_path: Path) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        argv = [
            sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
            "--port", str(port), "--policy", "cache_aware",
            "--cb-failure-threshold", "3",
            "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
            "--worker-startup-check-interval", "1",
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
        ]  # fmt: skip
        if listed:
            argv += ["--worker-urls", *(w.url for w in listed)]
        super().__init__(argv, log_path)

    def register(self, worker: Worker) -> None:
        """slime's registration of an engine: POST {router}/workers, answered 202 (queued)."""
        body = json.dumps({"url": worker.url, "worker_type": "regular"}).encode()
        headers = {"Content-Type": "application/json"}
        request = urllib.request.Request(self.url + "/workers", body, headers, method="POST")
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.status == 202, response.read()


class Cluster:
    def __init__(self, workers: list[Worker], router: Router) -> None:
        self.workers, self.router, self.url = workers, router, router.url


@contextlib.contextmanager
def running_cluster(folder: Path, logs: Path, *, posted: bool, count: int = 2) -> Iterator[Cluster]:
    """`count` shoal servers and the router in front of them, all answering: the workers named
    on the router's command line, or (`posted`) registered by POST /workers once the router is
    up, as slime registers its engines. Every process is killed on the way out."""
    started: list[Process] = []
    try:
        workers = [Worker(folder, logs / f"worker{i}.log") for i in range(count)]
        started += workers
        for worker in workers:
            worker.wait_until(worker.url + "/health", lambda status, _: status == 200, "a worker")
        router = Router([] if posted else workers, logs / "router.log")
        started.append(router)
        if posted:
            router.wait_until(router.url + "/health", lambda status, _: status == 200, "router")
            for worker in workers:
                router.register(worker)

        def all_healthy(status: int, body: bytes) -> bool:
            return status == 200 and json.loads(body)["healthy_workers"] == count

        router.wait_until(router.url + "/readiness", all_healthy, "the router's workers")
        yield Cluster(workers, router)
    finally:
        for process in started:
            process.kill()


@pytest.fixture(scope="module")
def cluster(
    tiny_folder: Path, prebuilt_cpu_kernels: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    """One cluster for the tests that kill nothing (each sends prompts the others do not), its
    workers registered as slime registers them."""
    logs = tmp_path_factory.mktemp("router")
    with running_cluster(tiny_folder, logs, posted=True) as started:
        yield started


# ---- what the tests ask ----------------------------------------------------------------------


async def generate(http: aiohttp.ClientSession, url: str, text: str) -> dict[str, Any]:
    body = {"text": text, "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}
    async with http.post(url + "/generate", json=body) as response:
        assert response.status == 200, await response.text()
        answer: dict[str, Any] = await response.json()
        return answer


async def get_json(http: aiohttp.ClientSession, url: str) -> Any:
    async with http.get(url) as response:
        assert response.status == 200, await response.text()
        return await response.json()


async def post_json(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], status: int = 200
) -> Any:
    async with http.post(url, json=body) as response:
        assert response.status == status, await response.text()
        return await response.json()


async def served(http: aiohttp.ClientSession, worker: Worker) -> int:
    """The /generate requests the worker answered 200 (its /metrics)."""
    async with http.get(worker.url + "/metrics") as response:
        text = await response.text()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "shoal_http_requests_total" and sample.labels == {
                "route": "/generate",
                "status": "200",
            }:
                return int(sample.value)
    return 0


async def route(
    http: aiohttp.ClientSession, cluster: Cluster, text: str, watched: list[Worker]
) -> tuple[Worker, dict[str, Any]]:
    """One /generate through the router, alone in flight among the watched workers' answers:
    the worker that answered it (its count went up by one, no other's did) and the answer."""
    before = [await served(http, w) for w in watched]
    answer = await generate(http, cluster.url, text)
    after = [await served(http, w) for w in watched]
    rises = [b - a for a, b in zip(before, after, strict=True)]
    assert sorted(rises) == [0] * (len(watched) - 1) + [1], rises
    return watched[rises.index(1)], answer


async def wait_holding(http: aiohttp.ClientSession, worker: Worker, count: int) -> None:
    """Until the worker holds `count` open requests (its /get_server_info), within WAIT_S."""
    deadline = time.monotonic() + WAIT_S
    while (await get_json(http, worker.url + "/get_server_info"))["open_http_requests"] != count:
        assert time.monotonic() < deadline, f"the worker never held {count} requests"
        await asyncio.sleep(0.02)


async def router_workers(http: aiohttp.ClientSession, cluster: Cluster) -> list[dict[str, Any]]:
    workers: list[dict[str, Any]] = (await get_json(http, cluster.url + "/workers"))["workers"]
    return workers


async def listed(http: aiohttp.ClientSession, cluster: Cluster, worker: Worker) -> dict[str, Any]:
    """The router's entry for the worker (GET {router}/workers)."""
    (entry,) = (w for w in await router_workers(http, cluster) if w["url"] == worker.url)
    return entry


# ---- the tests -------------------------------------------------------------------------------


async def test_a_prefix_stays_on_one_worker_and_a_new_one_goes_to_the_less_busy(
    cluster: Cluster,
) -> None:
    """cache_aware, as 0.3.2 decides when loads are balanced: a request whose text matches
    more than --cache-threshold (0.3) of what the router sent one worker goes to that worker;
    any other goes to the worker with the fewest requests in flight through the router, on a
    tie always the same one. Sent one at a time to an idle pair, every new prefix would go to
    that one worker, so spread is shown with the loads made unequal on purpose: the owner of
    the first prefix is paused with one of its requests waiting there, and the new prefix goes
    to the other worker, then stays there. Which worker owns the first prefix is the router's
    choice; the test asserts only that it is one worker throughout."""
    async with aiohttp.ClientSession() as http:
        first = [await route(http, cluster, SHARED + f" Q{i}?", cluster.workers) for i in range(3)]
        owner = first[0][0]
        assert [w for w, _ in first] == [owner] * 3
        (other,) = (w for w in cluster.workers if w is not owner)
        # the owner's prefix cache holds the shared prefix: every later request reuses it
        cached = [answer["meta_info"]["cached_tokens"] for _, answer in first]
        assert cached[0] == 0 and all(c > 0 for c in cached[1:]), cached

        before = await served(http, owner)
        await post_json(http, owner.url + "/pause_generation", {"mode": "in_place"})
        try:
            held = asyncio.create_task(generate(http, cluster.url, SHARED + " Held?"))
            await wait_holding(http, owner, 1)
            pair = [owner, other]
            moved = [await route(http, cluster, OTHER + f" Part {i}.", pair) for i in range(3)]
        finally:
            await post_json(http, owner.url + "/continue_generation", {})
        assert [w for w, _ in moved] == [other] * 3
        assert [a["meta_info"]["cached_tokens"] > 0 for _, a in moved] == [False, True, True]
        await asyncio.wait_for(held, WAIT_S)
        assert await served(http, owner) == before + 1  # the held one, on the prefix's owner


async def test_flush_cache_through_the_router_empties_every_worker(cluster: Cluster) -> None:
    async with aiohttp.ClientSession() as http:
        for i, worker in enumerate(cluster.workers):  # each worker caches a prompt of its own
            await generate(http, worker.url, f"Every request keeps its slot, worker {i}.")
        for worker in cluster.workers:
            info = await get_json(http, worker.url + "/get_server_info")
            assert info["cached_tokens"] > 0
        flushed = await post_json(http, cluster.url + "/flush_cache", {})
        assert flushed["workers_flushed"] == flushed["total_http_workers"] == 2, flushed
        for worker in cluster.workers:
            info = await get_json(http, worker.url + "/get_server_info")
            assert info["cached_tokens"] == 0


async def test_an_update_sent_to_every_listed_worker_reaches_them_all(
    cluster: Cluster, tiny_folder: Path
) -> None:
    """slime's way: the router forwards no weight update; the trainer lists the workers (GET
    {router}/workers, each entry's url) and sends each one the update."""
    async with aiohttp.ClientSession() as http:
        urls = [w["url"] for w in await router_workers(http, cluster)]
        assert sorted(urls) == sorted(w.url for w in cluster.workers)
        update = {"model_path": str(tiny_folder), "weight_version": "2"}
        for url in urls:
            answer = await post_json(http, url + "/update_weights_from_disk", update)
            assert answer["success"], answer
        for url in urls:
            info = await get_json(http, url + "/get_model_info")
            assert str(info["weight_version"]) == "2"
            version = await get_json(http, url + "/get_weight_version")  # what slime reads
            assert str(version["weight_version"]) == "2"
        answer = await generate(http, cluster.url, UPDATED)
        assert str(answer["meta_info"]["weight_version"]) == "2"


async def test_the_router_reads_each_workers_load(cluster: Cluster) -> None:
    """GET {router}/get_loads asks each worker's GET /get_load and sums its ranks' num_tokens;
    a worker without the route reads -1. Idle, each holds no KV."""
    async with aiohttp.ClientSession() as http:
        for worker in cluster.workers:
            loads = await get_json(http, worker.url + "/get_load")
            assert loads == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
        answer = await get_json(http, cluster.url + "/get_loads")
        got = {entry["worker"]: entry["load"] for entry in answer["workers"]}
        assert got == {w.url: 0 for w in cluster.workers}


async def test_the_router_sends_only_the_fields_its_types_hold(cluster: Cluster) -> None:
    """The router parses /generate into its own type: a misspelt sampling field, a 400 from a
    worker alone, is dropped on the way (200), and SGLang's sampling_seed arrives (the seeded
    sample is the one a worker alone draws)."""
    text = "Sampling draws the next token at random from the softened distribution."
    sampling = {"max_new_tokens": 8, "temperature": 1.0, "sampling_seed": 7}
    body = {"text": text, "sampling_params": sampling}
    misspelt = {"text": text, "sampling_params": {**sampling, "temprature": 1.0}}
    async with aiohttp.ClientSession() as http:
        alone = await post_json(http, cluster.workers[0].url + "/generate", body)
        await post_json(http, cluster.workers[0].url + "/generate", misspelt, status=400)
        routed = await post_json(http, cluster.url + "/generate", misspelt)
        assert routed["output_ids"] == alone["output_ids"]


async def test_a_killed_worker_fails_over(
    tiny_folder: Path, prebuilt_cpu_kernels: Path, tmp_path: Path
) -> None:
    with running_cluster(tiny_folder, tmp_path, posted=False) as cluster:
        async with aiohttp.ClientSession() as http:
            owner, _ = await route(http, cluster, SHARED + " Question 0?", cluster.workers)
            (survivor,) = (w for w in cluster.workers if w is not owner)
            # what the survivor answers (greedy, the same weights): a retry must answer it
            alone = await generate(http, survivor.url, SHARED + " Held?")
            before = await served(http, survivor)

            # the owner holds two requests of the prefix, paused: a plain one, and a streamed
            # one whose 200 the router has passed on
            await post_json(http, owner.url + "/pause_generation", {"mode": "in_place"})
            held = asyncio.create_task(generate(http, cluster.url, SHARED + " Held?"))
            await wait_holding(http, owner, 1)
            streamed = {"text": SHARED + " Streamed?", "stream": True}
            sent = http.post(cluster.url + "/generate", json=streamed)
            stream = await asyncio.wait_for(sent, WAIT_S)
            assert stream.status == 200
            await wait_holding(http, owner, 2)

            owner.kill()
            answer = await asyncio.wait_for(held, WAIT_S)  # the router's retry, on the survivor
            assert answer["output_ids"] == alone["output_ids"]
            assert await served(http, survivor) == before + 1
            with pytest.raises(aiohttp.ClientPayloadError):
                await asyncio.wait_for(stream.read(), WAIT_S)  # cut: not replayed
            stream.release()
            for i in range(4):  # the prefix's owner is gone: its requests go to the survivor
                await route(http, cluster, SHARED + f" After {i}?", [survivor])

            # the health checks mark the dead worker, which stays listed (and in the fan-out)
            deadline = time.monotonic() + WAIT_S
            while (await listed(http, cluster, owner))["is_healthy"]:
                assert time.monotonic() < deadline, "the router never marked the worker"
                await asyncio.sleep(0.1)
            readiness = await get_json(http, cluster.url + "/readiness")
            assert readiness["healthy_workers"] == 1
            flushed = await post_json(http, cluster.url + "/flush_cache", {}, status=206)
            assert flushed["successful"] == [survivor.url]
            assert [f["worker"] for f in flushed["failed"]] == [owner.url]

            # slime's removal of an engine: find its id by url, DELETE it
            dead = await listed(http, cluster, owner)
            async with http.delete(cluster.url + "/workers/" + dead["id"]) as response:
                assert response.status == 202, await response.text()  # queued
            deadline = time.monotonic() + WAIT_S
            while len(await router_workers(http, cluster)) != 1:
                assert time.monotonic() < deadline, "the router never removed the worker"
                await asyncio.sleep(0.1)
            flushed = await post_json(http, cluster.url + "/flush_cache", {})
            assert flushed["workers_flushed"] == flushed["total_http_workers"] == 1, flushed
