"""``serve -dp 2 --data-parallel-backend ray``: the replicas are Ray actors placed by a
placement group (on a Ray instance the server starts on this machine); greedy tokens equal
transformers', requests reach both replicas, a replica whose actor dies stops the server,
and nothing of Ray is left behind."""

from __future__ import annotations

import asyncio
import time

import httpx
import psutil
import pytest
from conftest import run_cli
from openai_server import RemoteServer, start_servers, tiny_llama
from tiny_models import load_reference, reference_greedy

NEW_TOKENS = 6
PROMPTS = [[17, 301, 45, 9], [88, 12, 7, 400, 31, 5, 66, 230, 19], [3, 141, 59, 26, 53]]

pytest.importorskip("ray")


def _actors() -> list[psutil.Process]:
    """The replicas' actor processes (Ray titles a worker by its actor's running task)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if "ray::RayReplicaActor" in " ".join(proc.info["cmdline"] or ()):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_llama(tmp_path_factory)


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    log = tmp_path_factory.mktemp("dp_ray") / "server.log"
    remote = RemoteServer(model, "-dp", "2", "--data-parallel-backend", "ray", log_path=log)
    start_servers(remote)
    yield remote
    remote.stop()


def test_replicas_are_ray_actors_with_transformers_tokens(server, model):
    assert "2 engine replicas (Ray actors)" in server.log_text()
    assert len(_actors()) == 2
    reference = load_reference(model)
    client = server.client()
    for prompt in PROMPTS:
        expected = reference_greedy(reference, prompt, NEW_TOKENS)[0]
        completion = client.completions.create(
            model=str(model), prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
            logprobs=1, extra_body={"return_tokens_as_token_ids": True},
        )  # fmt: skip
        ids = [int(t.removeprefix("token_id:")) for t in completion.choices[0].logprobs.tokens]
        assert ids == expected


def test_requests_reach_both_replicas(server, model):
    def done(index: int) -> float:
        try:
            return server.metric("pagedllm:request_success_total", engine=str(index))
        except AssertionError:  # (no request finished there yet)
            return 0.0

    before = [done(i) for i in (0, 1)]

    async def send() -> None:
        client = server.async_client()
        await asyncio.gather(
            *(
                client.completions.create(model=str(model), prompt=p, max_tokens=NEW_TOKENS)
                for p in PROMPTS * 2
            )
        )

    asyncio.run(send())
    grew = [done(i) - b for i, b in zip((0, 1), before, strict=True)]
    assert sum(grew) == 6 and min(grew) >= 1, grew


def test_a_dead_replica_actor_stops_the_server(server):
    """(Last: it ends the server.) The server exits non-zero and no actor is left."""
    actors = _actors()
    assert len(actors) == 2
    actors[1].kill()
    deadline = time.monotonic() + 90
    statuses = set()
    while server.proc.poll() is None and time.monotonic() < deadline:
        try:
            statuses.add(httpx.get(server.url + "/health", timeout=5).status_code)
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    assert server.proc.returncode not in (None, 0), server.log_text()
    assert "exited" in server.log_text()
    deadline = time.monotonic() + 60
    while _actors() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _actors()


def test_ray_placement_refusals_name_the_flag(model):
    commands = {
        ("serve", str(model), "-dpb", "ray"): (
            "--data-parallel-backend ray applies with --data-parallel-size above 1"
        ),
        ("serve", str(model), "-dp", "2", "-dpb", "ray", "-dpl", "1"): (
            "--data-parallel-size-local: with --data-parallel-backend ray"
        ),
        ("serve", str(model), "-dp", "2", "-dpb", "mpi"): "--data-parallel-backend",
    }
    for command, message in commands.items():
        result = run_cli(*command)
        assert result.returncode == 2 and message in result.stderr, (command, result.stderr)
