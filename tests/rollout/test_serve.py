"""The Ray Serve rollout app: two replicas roll math_tool tasks into the lake while weights change; a
replica builds each episode's environment, at its engine's version for step-dependent ones."""

import asyncio
import threading
import time

import pytest

from sao.envs.math_tool import MathToolConfig, generate_tasks
from sao.lake.config import LakeConfig, WriterConfig
from sao.lake.ledger import register_policy_version
from sao.lake.records import PolicyVersionRecord
from sao.lake.store import Lake
from sao.lake.writer import TrajectoryWriter
from sao.models.policy import build_policy
from sao.rollout.agent import AgentConfig
from sao.rollout.driver import DriverConfig, RolloutDriver
from sao.rollout.serve import RolloutConfig, start_rollout_app
from sao.rollout.weights import get_or_create_broker, publish_weights
from sao.train.checkpoint import weights_hash


@pytest.mark.ray
def test_two_replicas_roll_out_into_the_lake_across_a_weight_update(tmp_path, policy_dir, ray_session):
    from ray import serve

    lake = Lake.open(LakeConfig(root=str(tmp_path / "lake")))
    register_policy_version(lake, PolicyVersionRecord("serve-run", 0, str(policy_dir), "h0"))
    app = RolloutConfig(policy_path=str(policy_dir), app_name="rollout-test", num_replicas=2,
                        agent=AgentConfig(max_tokens=48, max_turns=2))
    handle = start_rollout_app(app)
    try:
        tasks = generate_tasks(MathToolConfig(num_train=40, num_heldout=0))
        writer = TrajectoryWriter(lake, WriterConfig(flush_rows=8, flush_seconds=0.2))
        driver = RolloutDriver(handle, writer, "serve-run", DriverConfig(max_in_flight=8, max_staleness=None))
        new_policy = build_policy(seed=7)
        register_policy_version(lake, PolicyVersionRecord("serve-run", 1, "mem://v1", weights_hash(new_policy),
                                                          parent_version=0, step=0))
        broker = get_or_create_broker("rollout-test")
        published = threading.Event()

        def publish_when_half_done(record):
            # Called on the driver's loop: launching waits until both replicas run version 1, while
            # the rollouts already in flight go on (some straddle the swap).
            if driver.stats.finished >= 16 and not published.is_set():
                published.set()
                publish_weights(broker, 1, new_policy.state_dict())
                deadline = time.monotonic() + 60
                while ray_get(broker.publish_latency.remote(1, 2)) is None:
                    assert time.monotonic() < deadline, "replicas did not acknowledge version 1"
                    time.sleep(0.02)

        driver.on_record = publish_when_half_done
        stats = asyncio.run(driver.run(tasks))
        writer.close()
        assert stats.finished == stats.launched == 40
        stored = lake.read("trajectories", predicate="run_id = 'serve-run'")
        assert stored.num_rows == 40
        assert lake.read("quarantine").num_rows == 0
        workers = set(stored.column("worker_id").to_pylist())
        assert len(workers) == 2  # both replicas served
        versions = set(stored.column("max_policy_version").to_pylist())
        assert versions == {0, 1}, versions  # the later rollouts ran on the published weights
        health = [handle.health.remote().result() for _ in range(6)]
        assert {h["version"] for h in health} == {1}
    finally:
        serve.delete("rollout-test")


def ray_get(ref):
    import ray

    return ray.get(ref)


def test_replica_resources_place_the_deployment_and_are_checked():
    from sao.rollout.serve import deployment_options

    config = RolloutConfig(policy_path="unused", resources_per_replica={"rollout": 1.0}, num_replicas=3)
    options = deployment_options(config)
    assert options["ray_actor_options"] == {"num_cpus": config.cpus_per_replica, "resources": {"rollout": 1.0}}
    assert options["num_replicas"] == 3 and options["max_ongoing_requests"] == config.max_ongoing_requests
    with pytest.raises(ValueError, match="resources_per_replica\\['CPU'\\]"):
        RolloutConfig(policy_path="unused", resources_per_replica={"CPU": 1.0})
    with pytest.raises(ValueError, match="resources_per_replica\\['rollout'\\]"):
        RolloutConfig(policy_path="unused", resources_per_replica={"rollout": 0.0})


def test_vllm_replicas_run_in_the_python_given_and_record_the_agents_kind():
    from sao.rollout.serve import deployment_options
    from sao.rollout.vllm_engine import VLLMEngineConfig

    assert "runtime_env" not in deployment_options(RolloutConfig(policy_path="unused"))["ray_actor_options"]
    config = RolloutConfig(policy_path="unused", engine=VLLMEngineConfig(), python="/envs/vllm/bin/python")
    assert deployment_options(config)["ray_actor_options"]["runtime_env"] == {"py_executable": "/envs/vllm/bin/python"}
    assert "num_gpus" not in deployment_options(config)["ray_actor_options"]
    shared = RolloutConfig(policy_path="unused", engine=VLLMEngineConfig(), gpus_per_replica=0.5)
    assert deployment_options(shared)["ray_actor_options"]["num_gpus"] == 0.5
    with pytest.raises(ValueError, match="the vLLM engine records 'raw' log-probabilities and the agent asks for 'sampling'"):
        RolloutConfig(policy_path="unused", engine=VLLMEngineConfig(logprob_kind="raw"))


class _LocalSubscriber:
    """Stands in for the weight subscriber (no Ray): the test hands the replica weights through it."""

    def __init__(self, broker, replica_id, current_version, apply, wait_s=1.0, apply_timeout_s=60.0) -> None:
        self.apply = apply

    def close(self) -> None:
        pass


def test_replica_builds_step_dependent_environments_at_its_engine_version(policy_dir, monkeypatch):
    """style_preference rewards by the trainer's step: each episode's environment gets the version the
    replica's engine runs when it starts (one version per trainer step); other environments get none."""
    from sao.envs.math_tool import MathToolEnv
    from sao.envs.style_preference import StylePreferenceConfig
    from sao.envs.style_preference import generate_tasks as style_tasks
    from sao.models.policy import load_policy
    from sao.rollout import serve as serve_module

    monkeypatch.setattr(serve_module, "get_or_create_broker", lambda name: None)
    monkeypatch.setattr(serve_module, "WeightSubscriber", _LocalSubscriber)
    shift = {"judge": {"schedule": {"styles": ["academic", "cute"], "shift_steps": [3]}}}
    replica = serve_module.RolloutReplica(RolloutConfig(policy_path=str(policy_dir), engine_process=False,
                                                        env_options={"style_preference": shift}))
    style_task = style_tasks(StylePreferenceConfig())[0]
    cute = "Hehe, the moon is so cute and fluffy, yay!"
    try:
        env = replica._new_env(style_task)  # what the replica builds at each episode's start
        env.reset(style_task)
        assert env.trainer_step == 0 and env.step(cute).reward == 0.0  # academic is preferred before step 3
        replica.subscriber.apply(3, load_policy(policy_dir).state_dict())
        replica.engine.wait_for_version(3)
        env = replica._new_env(style_task)
        env.reset(style_task)
        assert env.trainer_step == 3 and env.step(cute).reward == 1.0
        math = replica._new_env(generate_tasks(MathToolConfig(num_train=1, num_heldout=0))[0])
        assert isinstance(math, MathToolEnv)
    finally:
        replica.engine.close()
        replica._tools.shutdown()


def test_requests_waiting_for_a_version_share_one_wait_and_fail_together_when_it_never_comes(monkeypatch):
    """A synchronous batch's rollouts all wait for the trainer's version: one wait per version, however
    many requests; a request cancelled meanwhile leaves it to the others; past version_wait_s all fail."""
    import types

    from sao.rollout import serve as serve_module

    replica = object.__new__(serve_module.RolloutReplica)  # the waiting part only: no engine, no Serve
    replica.engine = types.SimpleNamespace(version=0, close=lambda: None)
    replica.config = types.SimpleNamespace(version_wait_s=5.0)
    replica.replica_id = "r0"
    replica._version_waits = {}
    polls = []
    poll = serve_module.RolloutReplica._poll_version

    async def counted(self, min_version):
        polls.append(min_version)
        await poll(self, min_version)

    monkeypatch.setattr(serve_module.RolloutReplica, "_poll_version", counted)

    async def batch():
        waiting = [asyncio.ensure_future(replica._reach_version(1)) for _ in range(64)]
        await asyncio.sleep(0.05)
        waiting[0].cancel()
        await asyncio.sleep(0.05)
        assert not any(w.done() for w in waiting[1:])
        replica.engine.version = 1
        await asyncio.wait_for(asyncio.gather(*waiting[1:]), timeout=5)
        assert waiting[0].cancelled() and replica._version_waits == {}
        replica.config.version_wait_s = 0.1
        late = [asyncio.ensure_future(replica._reach_version(2)) for _ in range(3)]
        return await asyncio.gather(*late, return_exceptions=True)

    failures = asyncio.run(batch())
    assert polls == [1, 2]
    assert all(isinstance(f, TimeoutError) and "runs version 1, not 2" in str(f) for f in failures)


class _FakeStream:
    """A streaming ``DeploymentResponseGenerator`` stand-in: yields what the test puts in, raises what
    it is told to, records a cancel."""

    def __init__(self, requests, min_version):
        self.requests, self.min_version = requests, min_version
        self.items: asyncio.Queue = asyncio.Queue()
        self.cancelled = False

    def cancel(self):
        self.cancelled = True
        self.items.put_nowait(asyncio.CancelledError())

    def __aiter__(self):
        return self

    async def __anext__(self):
        item = await self.items.get()
        if item is StopAsyncIteration or isinstance(item, BaseException):
            raise item if isinstance(item, BaseException) else StopAsyncIteration
        return item


class _FakeHandle:
    """``handle.options(stream=True).rollout_stream.remote(requests, min_version=...)``, kept per call."""

    def __init__(self):
        self.streams: list[_FakeStream] = []
        self.rollout_stream = self

    def options(self, stream=False):
        assert stream
        return self

    def remote(self, requests, min_version=None):
        self.streams.append(_FakeStream(requests, min_version))
        return self.streams[-1]


def _batch(min_versions):
    """Rollouts started in one turn of the loop, through a RolloutBatcher of 2 replicas."""
    from sao.rollout.serve import RolloutBatcher

    handle = _FakeHandle()
    batcher = RolloutBatcher(handle, replicas=2)
    futures = [batcher.remote(f"task{i}", "run", f"t{i}", i, min_version=v) for i, v in enumerate(min_versions)]
    return handle, futures


def test_rollouts_started_together_go_as_one_request_per_replica_and_come_back_one_by_one():
    async def scenario():
        handle, futures = _batch([3] * 5)
        await asyncio.sleep(0.01)
        assert [s.requests for s in handle.streams] == [
            [(f"task{i}", "run", f"t{i}", i) for i in (0, 2, 4)], [(f"task{i}", "run", f"t{i}", i) for i in (1, 3)]]
        assert {s.min_version for s in handle.streams} == {3}
        first, second = handle.streams
        first.items.put_nowait([(1, ["records of t2"], None)])  # index within the request
        await asyncio.sleep(0.01)
        assert futures[2].result() == ["records of t2"] and not futures[0].done()
        first.items.put_nowait([(0, ["records of t0"], None), (2, None, TimeoutError("no version 3"))])
        first.items.put_nowait(StopAsyncIteration)
        second.items.put_nowait([(1, ["records of t3"], None)])
        second.items.put_nowait(ConnectionError("the replica died"))  # t1 was still running there
        results = await asyncio.gather(*futures, return_exceptions=True)
        assert results[0] == ["records of t0"] and results[2] == ["records of t2"] and results[3] == ["records of t3"]
        assert isinstance(results[4], TimeoutError) and isinstance(results[1], ConnectionError)

    asyncio.run(scenario())


def test_rollouts_of_different_minimum_versions_go_in_separate_requests():
    async def scenario():
        handle, futures = _batch([None, 1, None])
        await asyncio.sleep(0.01)
        sent = sorted((str(s.min_version), [r[2] for r in s.requests]) for s in handle.streams)
        assert sent == [("1", ["t1"]), ("None", ["t0"]), ("None", ["t2"])]  # t0 and t2 split over the 2 replicas
        for stream in handle.streams:
            stream.items.put_nowait([(i, [r[2]], None) for i, r in enumerate(stream.requests)])
            stream.items.put_nowait(StopAsyncIteration)
        assert await asyncio.gather(*futures) == [["t0"], ["t1"], ["t2"]]

    asyncio.run(scenario())


def test_a_request_is_cancelled_once_every_rollout_of_it_is_and_a_request_that_ends_short_fails_the_rest():
    async def scenario():
        handle, futures = _batch([None] * 4)
        await asyncio.sleep(0.01)
        first, second = handle.streams  # t0, t2 and t1, t3
        futures[0].cancel()
        await asyncio.sleep(0.01)
        assert not first.cancelled  # t2 still runs
        futures[2].cancel()
        await asyncio.sleep(0.01)
        assert first.cancelled and not second.cancelled
        second.items.put_nowait([(0, ["t1"], None)])
        second.items.put_nowait(StopAsyncIteration)  # t3 never reported
        results = await asyncio.gather(futures[1], futures[3], return_exceptions=True)
        assert results[0] == ["t1"] and "ended without this rollout's records" in str(results[1])

    asyncio.run(scenario())


def test_a_request_whose_other_rollouts_finished_is_cancelled_when_its_last_one_is():
    # A Ctrl-C (or a stale cancel) after part of a request has finished: the rest must stop on the
    # replica too. Before, only a request whose every rollout was cancelled was.
    async def scenario():
        handle, futures = _batch([None] * 4)
        await asyncio.sleep(0.01)
        first, _ = handle.streams  # t0, t2
        first.items.put_nowait([(0, ["t0"], None)])
        await asyncio.sleep(0.01)
        assert futures[0].result() == ["t0"] and not first.cancelled
        futures[2].cancel()
        await asyncio.sleep(0.01)
        assert first.cancelled

    asyncio.run(scenario())


def test_a_replica_streams_each_rollout_as_it_finishes_and_sends_failures_as_values():
    import types

    from sao.rollout import serve as serve_module

    replica = object.__new__(serve_module.RolloutReplica)
    delays = {"a": 0.05, "b": 0.0, "c": 0.02}
    seen_versions = []

    async def rollout(task, run_id, trajectory_id, seed=None, min_version=None):
        seen_versions.append(min_version)
        await asyncio.sleep(delays[task])
        if task == "c":
            raise ValueError("bad task")
        return [f"{task}:{run_id}:{trajectory_id}:{seed}"]

    replica.rollout = rollout
    replica.config = types.SimpleNamespace()

    async def scenario():
        out = []
        async for finished in replica.rollout_stream([("a", "r", "ta", 0), ("b", "r", "tb", 1), ("c", "r", "tc", 2)],
                                                     min_version=4):
            out += finished
        return out

    out = asyncio.run(scenario())
    assert [index for index, _, _ in out] == [1, 2, 0] and seen_versions == [4, 4, 4]
    assert out[0][1] == ["b:r:tb:1"] and out[2][1] == ["a:r:ta:0"]
    assert out[1][1] is None and isinstance(out[1][2], ValueError)
