"""The process-tree sampler: components from Ray's process titles, and real peaks and CPU seconds of a
tree of two processes."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from benchmarks._proctree import TreeSampler, component


def test_components_follow_ray_titles_and_parents():
    assert component("python -c ...", None, "driver + trainer process") == "driver + trainer process"
    assert component("ray::ServeReplica:peer-x:RolloutReplica", "Ray system", None) == "rollout replicas"
    assert component("python -c from multiprocessing.spawn import spawn_main", "rollout replicas",
                     None) == "rollout replicas"  # a replica's engine process
    assert component("ray::ServeController", "Ray system", None) == "Serve controller"
    assert component("ray::RayTrainWorker", "Ray system", None) == "Ray Train"
    assert component("ray::WeightBroker", "Ray system", None) == "other Ray workers"
    assert component("ray::IDLE", "Ray system", None) == "other Ray workers"
    assert component(".venv/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet --x",
                     "driver + trainer process", None) == "Ray system"
    assert component("ray::DashboardAgent", "Ray system", None) == "Ray system"
    # a helper process of the root (a multiprocessing resource tracker) belongs to the root's component
    assert component("python -c from multiprocessing.resource_tracker import main", "TRL process",
                     None) == "TRL process"


# 150 MiB touched, then 1 s of CPU (however busy the machine is), then a pause the sampler sees it in
_BUSY = "import time; data = bytearray(150 * 2**20); data[::4096] = b'x' * len(data[::4096])\n" \
        "while time.process_time() < 1.0: pass\ntime.sleep(0.4)"


def test_sampler_sees_the_whole_tree_memory_and_cpu():
    child = f"import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', {_BUSY!r}]); exec({_BUSY!r}); p.wait()"
    process = subprocess.Popen([sys.executable, "-c", child])
    sampler = TreeSampler(process.pid, "root", interval_s=0.1, pss_every=2)
    started = time.time()
    sampler.start()
    process.wait(timeout=60)
    sampler.stop()
    assert sampler.processes == 2
    assert sampler.thread_names[process.pid].startswith("python")  # the root's main thread, named by the kernel
    assert sampler.peak_rss >= 2 * 150 * 2**20  # both processes touched 150 MiB
    assert 0 < sampler.peak_pss <= sampler.peak_rss
    cpu = sampler.cpu_total()
    assert set(cpu) == {"root"}  # the grandchild's title names nothing else: it is the root's
    assert 1.9 <= cpu["root"] <= 2.6  # two processes of 1 s of CPU each (plus start-up)
    assert sampler.cpu_between(started, time.time())["root"] == pytest.approx(cpu["root"], abs=0.2)
    assert sampler.cpu_between(time.time() + 10, time.time() + 20) == {"root": 0.0}  # after the last sample
