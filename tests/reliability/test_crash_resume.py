"""The crash harness: ``sao train`` started as a user starts it, killed (SIGKILL to its whole process
group) at seeded moments in every stage, resumed with the same command, until the run finishes.

Each chain is one run id; each moment is a kill in a stage of the run:

* from outside, a seeded delay after a line of the run's own output marks the stage (the SFT warm
  start, collecting value pretraining's version-0 rollouts, fitting the critic, the start of training,
  a step in progress, the final evaluation);
* from inside, at a named crash point (:mod:`sao.faults`) for the moments too short to hit from outside:
  a step's update computed but not saved (``mid-step``), between a step's ``train_steps`` row and its
  ``policy_versions`` row (``after-commit``), before the step's weights are published
  (``before-publish``), and just after launches were logged in ``rollout_tasks``, before any of their
  records (``after-issue``: rollouts a resume must close out and launch again, which a kill from
  outside hits only when it lands while rollouts run). The run then kills its own process group, as
  ``kill -9 -PGID`` would.

After every chain: the run has exactly its steps; no trajectory was consumed twice; every step replays
bit for bit (``sao replay``). A step of the two-worker chain summed its gradients across two processes,
which a one-process replay cannot reproduce bit for bit (``sao.train.replay`` says so): there, replay
must read every step's recorded rows from its snapshot, load a start checkpoint whose hash matches, and
agree on the losses within 1e-4;
``sao lake check`` exits 0 for the run and for its value-pretraining data run; the rollouts a kill left
in flight were closed out on resume; the same command once more says the run has finished (exit 0).

The Ctrl-C test stops a run with one SIGINT to its process group (what a terminal's Ctrl-C sends): it
exits 130 with the resume command after committing what finished, leaving no process behind; then
with two (the second exits at once); each time the same command resumes it.

On 2 cores (2026-12-02) the every-stage chain took 19 minutes, the S3 chain 7, the two-worker chain 6
and the Ctrl-C test 7: each start of ``sao train`` starts Ray, Serve, Ray Train and a Prefect flow
again (about 100 s). The ``slow`` tier (``make test-slow``, run by ``.ci/run``) runs the local chain
with one kill per stage; the every-stage chain and the other three are marked ``crash``
(``make test-crash``), because CI's 90 minutes cannot hold them beside the two tiers (docs/TESTING.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from sao.lake.config import LakeConfig
from sao.lake.store import Lake
from sao.prefect_server import LocalPrefectServer, free_port
from tests.lake.conftest import moto_bucket

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

SAO = str(Path(sys.executable).with_name("sao"))
BUCKET = "sao-crash-tests"


@dataclasses.dataclass(frozen=True)
class Moment:
    """Where to kill a run: ``after`` a line of its output (a regular expression) plus a seeded delay
    drawn from ``delay_s``, or at the crash point ``crash_at`` (``name:step``)."""

    name: str
    after: str | None = None
    delay_s: tuple[float, float] = (0.0, 0.0)
    crash_at: str | None = None


SFT = r"Beginning flow run"
COLLECT = r"Application 'rollout-collect' is ready"
FIT_CRITIC = r"Deleting app \['rollout-collect'\]"
TRAINING = r"Application 'rollout' is ready"
TRAINED = r"Task run 'train-async-\w+' - Finished in state Completed"
ANY_STEP = r"step \d+ -> version \d+:"


def step_done(step: int) -> str:
    return rf"step {step} -> version {step + 1}:"


TRAINING_MOMENTS = [
    Moment("before-first-step", TRAINING, (0.0, 10.0)),  # Ray Train takes about 16 s to start
    Moment("mid-step", crash_at="mid-step:0"),
    Moment("after-commit", crash_at="after-commit:1"),
    Moment("before-publish", crash_at="before-publish:2"),
    Moment("mid-run", step_done(3), (0.0, 0.8)),
    Moment("final-evaluation", TRAINED, (0.0, 1.0)),
]
"""The moments of the training stage, in order (the chains' runs have at least 5 steps)."""


@pytest.fixture(scope="module")
def prefect_api(tmp_path_factory):
    """One Prefect server for the harness's runs (a user with a server sets ``PREFECT_API_URL``); the
    Ctrl-C test uses the temporary server ``sao train`` starts by itself."""
    home = tmp_path_factory.mktemp("prefect-home")
    with LocalPrefectServer(port=free_port(), home=home, log_path=home / "server.log", ui=False) as server:
        yield server.env()


def session_processes(sid: int) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["pid"]):
        # A process may exit between the listing and the lookup: psutil raises its own error, the
        # ``os`` call ProcessLookupError.
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getsid(process.pid) == sid:
                found.append(process)
    return found


def processes_with_env(name: str, value: str) -> list[psutil.Process]:
    """Processes (other than this one) whose environment has ``name=value``: what a run started
    inherits the run's environment, in whatever session it put them (the temporary Prefect server)."""
    found = []
    for process in psutil.process_iter(["pid"]):
        with contextlib.suppress(psutil.Error):
            if process.pid != os.getpid() and process.environ().get(name) == value:
                found.append(process)
    return found


class UserRun:
    """``sao train ARGS`` in ``cwd`` with ``env``, as a user starts it in a terminal (a session and
    process group of its own); every start appends its output to ``log``."""

    def __init__(self, cwd: Path, args: list[str], env: dict[str, str]) -> None:
        self.cwd, self.args, self.env = cwd, args, env
        self.log = cwd / "sao-train.log"
        self.process: subprocess.Popen | None = None
        self._offset = 0
        self.starts = 0

    def start(self, crash_at: str | None = None) -> None:
        env = dict(self.env)
        if crash_at is not None:
            env |= {"SAO_CRASH_AT": crash_at, "SAO_CRASH_PGID": "session"}
        self._offset = self.log.stat().st_size if self.log.exists() else 0
        with open(self.log, "ab") as out:
            out.write(f"\n===== start {self.starts} (crash_at={crash_at}) =====\n".encode())
            self._offset = out.tell()
            self.process = subprocess.Popen([SAO, "train", *self.args], cwd=self.cwd, env=env,
                                            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        self.starts += 1

    def output(self) -> str:
        with open(self.log, "rb") as log:
            log.seek(self._offset)
            return log.read().decode(errors="replace")

    def tail(self, chars: int = 6000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def wait_for(self, pattern: str, timeout_s: float = 600) -> bool:
        """Until ``pattern`` shows in this start's output (True) or the process ended (False)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if re.search(pattern, self.output()):
                return True
            if self.process.poll() is not None:
                return bool(re.search(pattern, self.output()))
            time.sleep(0.1)
        raise AssertionError(f"{pattern!r} did not show within {timeout_s} s:\n{self.tail()}")

    def kill_group(self) -> None:
        """SIGKILL the run's process group (``kill -9 -PGID``), then wait for what it started to go."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=60)
        self._reap_session()

    def _reap_session(self, timeout_s: float = 30.0) -> None:
        """Ray's processes die with the driver they share their fate with, and its workers when their
        raylet goes; give them ``timeout_s``, then kill what is left, so the next start is clean."""
        deadline = time.monotonic() + timeout_s
        while session_processes(self.process.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        for leftover in session_processes(self.process.pid):
            with contextlib.suppress(psutil.Error):
                leftover.kill()

    def wait(self, timeout_s: float = 900) -> int:
        try:
            code = self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill_group()
            raise AssertionError(f"the run did not end within {timeout_s} s:\n{self.tail()}") from None
        self._reap_session()
        return code


def kill_at(run: UserRun, moment: Moment, rng: random.Random) -> bool:
    """Start ``run`` and kill it at ``moment``; False when it finished before the moment came."""
    run.start(crash_at=moment.crash_at)
    if moment.crash_at is not None:
        code = run.wait()
        assert code in (-signal.SIGKILL, 137), f"{moment.name}: expected the crash point to kill the run, " \
                                                f"exit {code}:\n{run.tail()}"
        return True
    if not run.wait_for(moment.after):
        code = run.wait()
        assert code == 0, f"{moment.name}: the run failed before the moment (exit {code}):\n{run.tail()}"
        return False
    time.sleep(rng.uniform(*moment.delay_s))
    finished = run.process.poll() is not None
    run.kill_group()
    return not finished


def crash_chain(run: UserRun, moments: list[Moment], seed: int) -> list[str]:
    """Kill ``run`` at each moment in turn (each start resumes the last), then let it finish."""
    rng = random.Random(seed)
    killed = []
    for moment in moments:
        if kill_at(run, moment, rng):
            killed.append(moment.name)
    run.start()
    code = run.wait()
    assert code == 0, f"the final resume failed (exit {code}):\n{run.tail()}"
    return killed


def sao(*args: str, env: dict[str, str], cwd: Path, timeout_s: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([SAO, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout_s)


LOSSES = ("actor/loss", "critic/loss")


def assert_replays(run: UserRun, lake_root: str, run_id: str, steps: int, *, workers: int) -> None:
    replay = sao("replay", "--lake", lake_root, "--run", run_id, "--steps", f"0:{steps - 1}", "--json",
                 env=run.env, cwd=run.cwd, timeout_s=900)
    if workers == 1:
        assert replay.returncode == 0, replay.stdout[-4000:] + replay.stderr[-2000:]
        return
    report = json.loads(replay.stdout)
    assert report["start_ok"] and len(report["steps"]) == steps, replay.stdout[-4000:]
    for step in report["steps"]:
        assert step["recorded_world_size"] == workers
        for mismatch in step["metric_mismatches"]:
            if mismatch["name"] in LOSSES:
                assert abs(mismatch["recorded"] - mismatch["replayed"]) <= 1e-4, (step["step"], mismatch)


def assert_run_accounted_for(run: UserRun, run_id: str, steps: int, lake: Lake, lake_root: str, *,
                             data_run: bool, workers: int = 1) -> dict:
    """The checks every chain ends with (see the module docstring)."""
    rows = lake.read("train_steps", predicate=f"run_id = '{run_id}'").to_pylist()
    assert sorted(r["step"] for r in rows) == list(range(steps)), [r["step"] for r in rows]
    consumed = [i for r in rows for i in r["trajectory_ids"]]
    assert len(consumed) == len(set(consumed)), "a trajectory was consumed twice"
    for checked in [run_id] + ([f"{run_id}-v0"] if data_run else []):
        check = sao("lake", "check", "--lake", lake_root, "--run", checked, env=run.env, cwd=run.cwd)
        assert check.returncode == 0, check.stdout[-4000:] + check.stderr[-2000:]
    assert_replays(run, lake_root, run_id, steps, workers=workers)
    again = subprocess.run([SAO, "train", *run.args], env=run.env, cwd=run.cwd, capture_output=True, text=True,
                           timeout=120)
    assert again.returncode == 0 and "finished already" in again.stdout, again.stdout + again.stderr
    events = lake.read("rollout_tasks", predicate=f"run_id = '{run_id}'").to_pylist()
    abandoned = {e["trajectory_id"] for e in events if e["event"] == "abandoned"}
    retried = {e["retry_of"] for e in events if e["event"] == "issued" and e["retry_of"]}
    return {"abandoned": len(abandoned), "relaunched": len(abandoned & retried), "steps": steps}


def train_args(run_id: str, workdir: Path, lake_root: str, steps: int, *extra: str) -> list[str]:
    """A small run: 8 trajectories a step, 96-token budgets (the random policy runs to its budget)."""
    return ["--run-id", run_id, "--steps", str(steps), "--batch-size", "8", "--eval-tasks", "8",
            "--max-staleness", "2", "--set", "rollout.max_tokens=96",
            "--workdir", str(workdir), "--lake", lake_root, *extra]


def copy_warm_start(policy_dir: Path, workdir: Path, run_id: str) -> None:
    """A run whose warm start is done (the chains that do not kill the SFT stage start after it)."""
    shutil.copytree(policy_dir, workdir / run_id / "sft")


EVERY_STAGE = [
    Moment("sft-early", SFT, (3.0, 10.0)),
    Moment("sft-late", SFT, (12.0, 24.0)),
    Moment("value-collect", COLLECT, (0.0, 0.5)),
    Moment("value-fit", FIT_CRITIC, (4.0, 20.0)),
    *TRAINING_MOMENTS,
]
"""The local chain's kills: twice in the SFT warm start, while collecting version-0 rollouts, while
fitting the critic, then every moment of training."""

CI_STAGES = ("sft-late", "value-fit", "mid-step", "after-commit", "mid-run")
"""The kills of the chain CI runs (one per stage, and the two crash points between a step's update and
its commits): half the starts of the every-stage chain."""


@pytest.mark.parametrize("moments", [
    pytest.param([m for m in EVERY_STAGE if m.name in CI_STAGES], id="one-per-stage"),
    pytest.param(EVERY_STAGE, id="every-moment", marks=pytest.mark.crash),
])
def test_killed_in_every_stage_a_run_resumes_to_its_steps_with_every_row_accounted_for(tmp_path, prefect_api,
                                                                                        moments):
    """A local lake, one trainer worker, value pretraining: kills in the SFT warm start, while
    collecting version-0 rollouts or fitting the critic, and in training (:data:`EVERY_STAGE`, or one
    kill per stage: :data:`CI_STAGES`)."""
    run_id, steps = "crash-local", 6
    run = UserRun(tmp_path, train_args(run_id, tmp_path / "runs", "lake", steps, "--value-samples", "8",
                                       "--num-replicas", "1"), os.environ | prefect_api)
    killed = crash_chain(run, moments, seed=19)
    assert len(killed) >= len(moments) - 1, killed  # a late moment may pass before its kill lands
    stats = assert_run_accounted_for(run, run_id, steps, Lake.open(LakeConfig(root=str(tmp_path / "lake"))),
                                     "lake", data_run=True)
    print(json.dumps({"chain": "local", "killed": killed, **stats}))


S3_MOMENTS = [Moment("after-commit", crash_at="after-commit:1"), Moment("mid-run", step_done(2), (0.0, 0.8))]
"""The S3 chain's kills: the moments at which the lake's own writes are cut (between a step's two
commits, and with rollouts being stored); the local chain kills every stage with the same code."""


@pytest.mark.crash
def test_killed_with_an_s3_lake_a_run_resumes(tmp_path, prefect_api, policy_dir):
    run_id, steps = "crash-s3", 5
    with moto_bucket(BUCKET) as endpoint:
        aws = {"AWS_ENDPOINT_URL": endpoint, "AWS_ALLOW_HTTP": "true", "AWS_ACCESS_KEY_ID": "testing",
               "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1"}
        lake_root = f"s3://{BUCKET}/lake"
        workdir = tmp_path / "runs"
        copy_warm_start(policy_dir, workdir, run_id)
        run = UserRun(tmp_path, train_args(run_id, workdir, lake_root, steps, "--value-samples", "0"),
                      os.environ | prefect_api | aws)
        killed = crash_chain(run, S3_MOMENTS, seed=20)
        assert killed == [moment.name for moment in S3_MOMENTS], killed
        lake = Lake.open(LakeConfig(root=lake_root, storage_options=aws))
        stats = assert_run_accounted_for(run, run_id, steps, lake, lake_root, data_run=False)
    print(json.dumps({"chain": "s3", "killed": killed, **stats}))


@pytest.mark.crash
def test_killed_at_random_moments_with_two_trainer_workers_a_run_resumes(tmp_path, prefect_api, policy_dir):
    """Two Ray Train workers; a kill just after the driver's third append of launches (rollouts without
    records, which the resume must close out and launch again), then kills at seeded random times after
    the rollout app is up, wherever they land (starting the trainer, waiting for a batch, mid-update,
    committing, publishing)."""
    run_id, steps = "crash-random", 6
    workdir = tmp_path / "runs"
    copy_warm_start(policy_dir, workdir, run_id)
    run = UserRun(tmp_path, train_args(run_id, workdir, "lake", steps, "--value-samples", "0",
                                       "--num-replicas", "1", "--trainer-workers", "2"), os.environ | prefect_api)
    # The random kills (one while the trainer starts, one once steps are being taken) may or may not find
    # rollouts in flight: the staleness gate holds launches back while the trainer catches up, and a
    # step's 8 rollouts of 96 tokens may all be stored within a second. So the first start is killed at
    # its third append of launches, which leaves rollouts without records wherever it comes, with the
    # run's steps all ahead.
    moments = [Moment("after-issue", crash_at="after-issue:3"), Moment("random-start", TRAINING, (2.0, 30.0)),
               Moment("random-step", ANY_STEP, (0.0, 2.5))]
    killed = crash_chain(run, moments, seed=21)
    assert killed == [moment.name for moment in moments], killed
    stats = assert_run_accounted_for(run, run_id, steps, Lake.open(LakeConfig(root=str(tmp_path / "lake"))),
                                     "lake", data_run=False, workers=2)
    assert stats["abandoned"] > 0  # the kills left rollouts without records: closed out, launched again
    assert stats["relaunched"] == stats["abandoned"]
    print(json.dumps({"chain": "random", "killed": killed, **stats}))


@pytest.mark.crash
def test_ctrl_c_stops_cleanly_twice_exits_at_once_and_the_same_command_resumes(tmp_path, policy_dir):
    """No ``PREFECT_API_URL``: ``sao train`` starts its own temporary Prefect server, as on a laptop."""
    run_id, steps = "ctrl-c", 6
    workdir = tmp_path / "runs"
    copy_warm_start(policy_dir, workdir, run_id)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env["PREFECT_HOME"] = str(tmp_path / "prefect-home")
    run = UserRun(tmp_path, train_args(run_id, workdir, "lake", steps, "--value-samples", "0",
                                       "--num-replicas", "1"), env)
    lake = Lake.open(LakeConfig(root=str(tmp_path / "lake")))

    # One Ctrl-C during training: the step in progress is committed, the run exits 130 and says how to resume.
    run.start()
    assert run.wait_for(step_done(1))
    os.killpg(run.process.pid, signal.SIGINT)
    stopped_at = time.monotonic()
    code = run.process.wait(timeout=120)
    output = run.output()
    assert code == 130, output[-4000:]
    assert time.monotonic() - stopped_at < 90
    assert f"Resume with: sao train --run-id {run_id}" in output
    assert not processes_with_env("PREFECT_HOME", env["PREFECT_HOME"]), "processes of the run outlived it"
    done = lake.read("train_steps", predicate=f"run_id = '{run_id}'").num_rows
    assert 2 <= done < steps
    first = subprocess.run([SAO, "lake", "check", "--lake", "lake", "--run", run_id], env=env, cwd=tmp_path,
                           capture_output=True, text=True, timeout=300)
    assert first.returncode == 0 and "closed out" not in first.stdout, first.stdout  # nothing left in flight

    # Two Ctrl-Cs: the second exits at once, killing what the run started; the run stays resumable.
    run.start()
    assert run.wait_for(step_done(done))
    os.killpg(run.process.pid, signal.SIGINT)
    time.sleep(0.5)
    os.killpg(run.process.pid, signal.SIGINT)
    code = run.process.wait(timeout=30)
    assert code == 130, run.output()[-4000:]
    assert "exiting now" in run.output()
    time.sleep(2)
    left = processes_with_env("PREFECT_HOME", env["PREFECT_HOME"])
    assert not left, f"processes of the run outlived it: {[p.cmdline()[:3] for p in left]}"

    # The same command finishes the run.
    run.start()
    assert run.wait() == 0, run.tail()
    assert_run_accounted_for(run, run_id, steps, lake, "lake", data_run=False)
