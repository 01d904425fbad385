"""Memory and CPU of a process tree (a benchmark arm and everything it started: Ray's processes, Serve
replicas, engine processes), sampled from ``/proc`` with psutil.

    sampler = TreeSampler(pid, root_component="driver + trainer process")
    sampler.start(); ...; sampler.stop()
    sampler.peak_rss, sampler.peak_pss          # bytes, summed over the tree
    sampler.cpu_between(t0, t1)                 # CPU seconds per component in a wall-clock window
    sampler.thread_cpu_between(t0, t1)          # CPU seconds per thread id of the root process
    sampler.machine_busy_between(t0, t1)        # CPU seconds the whole machine was busy (any process)

Every ``interval_s`` the sampler sums the tree's RSS (peak kept) and reads each process's CPU time;
every ``pss_every``-th sample it also sums PSS, in which a page shared by n processes counts 1/n in each
(RSS counts it in every one, so a sum of RSS overstates a tree of Ray workers that map the same
libraries; reading PSS costs about 5 ms a process, hence the lower rate). A process is attributed to a
component by :func:`component` from its title (Ray names its workers ``ray::<Actor>``) and its
parent's component. CPU of a process (or thread) that exits between two samples is counted up to the
last sample that saw it. The machine's busy time (all CPU time but idle and I/O wait, steal included)
against the tree's tells how much else ran on the machine meanwhile.
"""

from __future__ import annotations

import bisect
import threading
import time
from pathlib import Path

__all__ = ["TreeSampler", "component"]


def component(title: str, parent: str | None, root: str | None) -> str:
    """The component of a process with command line ``title`` whose parent is ``parent``; ``root``
    names the tree's root process (given only for the root)."""
    if root is not None:
        return root
    if "RolloutReplica" in title or parent == "rollout replicas":
        return "rollout replicas"  # the replica, its engine process and its sandbox
    if "ServeController" in title or "ProxyActor" in title:
        return "Serve controller"
    if any(name in title for name in ("TrainController", "RayTrainWorker", "DatasetManager", "SplitCoordinator")):
        return "Ray Train"
    if title.startswith("ray::") and not any(name in title for name in ("DashboardAgent", "RuntimeEnvAgent")):
        return "other Ray workers"  # the weight broker, Serve's stats actors, idle workers
    if title.startswith("ray::") or "/ray/" in title:
        return "Ray system"  # gcs, raylet, dashboard and its agents, log monitor (all under the ray package)
    return parent or "other"


class TreeSampler:
    """Samples the tree under ``root_pid`` in a thread (see the module docstring)."""

    def __init__(self, root_pid: int, root_component: str, interval_s: float = 0.5, pss_every: int = 10) -> None:
        self.root_pid, self.root_component = root_pid, root_component
        self.interval_s, self.pss_every = interval_s, pss_every
        self.peak_rss = self.peak_pss = 0
        self.processes = 0
        self._cpu: dict[int, tuple[str, float]] = {}  # pid -> (component, CPU seconds at its last sample)
        self._times: list[float] = []
        self._totals: list[dict[str, float]] = []  # per sample: component -> cumulative CPU seconds
        self._thread_cpu: dict[int, float] = {}  # thread id of the root -> CPU seconds at its last sample
        self._threads: list[dict[int, float]] = []  # per sample: a copy of _thread_cpu
        self.thread_names: dict[int, str] = {}  # thread id of the root -> the kernel's name for it (comm)
        self._machine: list[float] = []  # per sample: the machine's cumulative busy CPU seconds
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tree-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        count = 0
        while not self._stop.is_set():
            try:
                self._sample(pss=count % self.pss_every == 0)
            except Exception:  # the root exited between the check and the read
                pass
            count += 1
            self._stop.wait(self.interval_s)

    def _read(self, pss: bool) -> dict[int, tuple[int, str, int, float, int]]:
        """pid -> (parent pid, title, RSS, CPU seconds, PSS or 0) for every live process of the tree."""
        import psutil

        root = psutil.Process(self.root_pid)
        info = {}
        for proc in [root, *root.children(recursive=True)]:
            try:
                with proc.oneshot():
                    cpu = proc.cpu_times()
                    info[proc.pid] = (proc.ppid(), " ".join(proc.cmdline()) or proc.name(), proc.memory_info().rss,
                                      cpu.user + cpu.system, proc.memory_full_info().pss if pss else 0)
            except psutil.Error:
                continue
        return info

    def _sample(self, pss: bool) -> None:
        import psutil

        now = time.time()
        info = self._read(pss)
        try:
            self._thread_cpu.update({t.id: t.user_time + t.system_time for t in psutil.Process(self.root_pid).threads()})
        except psutil.Error:
            pass
        for tid in self._thread_cpu.keys() - self.thread_names.keys():
            try:  # named by whoever started the thread (Ray's C++ threads, gRPC, OpenMP); Python's keep the process's
                self.thread_names[tid] = Path(f"/proc/{self.root_pid}/task/{tid}/comm").read_text().strip()
            except OSError:
                self.thread_names[tid] = "?"
        machine = psutil.cpu_times()
        components: dict[int, str] = {}

        def of(pid: int) -> str:
            if pid not in components:
                ppid, title = info[pid][0], info[pid][1]
                is_root = pid == self.root_pid
                parent = of(ppid) if ppid in info and not is_root else None
                components[pid] = component(title, parent, self.root_component if is_root else None)
            return components[pid]

        for pid, values in info.items():
            self._cpu[pid] = (of(pid), values[3])
        totals: dict[str, float] = {}
        for name, cpu_s in self._cpu.values():
            totals[name] = totals.get(name, 0.0) + cpu_s
        self._times.append(now)
        self._totals.append(totals)
        self._threads.append(dict(self._thread_cpu))
        self._machine.append(sum(machine) - machine.idle - getattr(machine, "iowait", 0.0))
        self.peak_rss = max(self.peak_rss, sum(v[2] for v in info.values()))
        self.processes = max(self.processes, len(info))
        if pss:
            self.peak_pss = max(self.peak_pss, sum(v[4] for v in info.values()))

    def cpu_total(self) -> dict[str, float]:
        """CPU seconds per component over the whole sampling, largest first."""
        return dict(sorted(self._totals[-1].items(), key=lambda kv: -kv[1])) if self._totals else {}

    def _at(self, when: float) -> int:
        """Index of the first sample at or after ``when`` (the last sample if none)."""
        return min(bisect.bisect_left(self._times, when), len(self._times) - 1)

    def cpu_between(self, start: float, end: float) -> dict[str, float]:
        """CPU seconds per component between the samples nearest to ``start`` and ``end`` (epoch seconds)."""
        if not self._times:
            return {}
        first, last = self._totals[self._at(start)], self._totals[self._at(end)]
        return {name: last.get(name, 0.0) - first.get(name, 0.0) for name in last}

    def thread_cpu_between(self, start: float, end: float) -> dict[int, float]:
        """CPU seconds per thread id (the kernel's, ``threading.get_native_id()``) of the root process."""
        if not self._times:
            return {}
        first, last = self._threads[self._at(start)], self._threads[self._at(end)]
        return {tid: cpu_s - first.get(tid, 0.0) for tid, cpu_s in last.items() if cpu_s > first.get(tid, 0.0)}

    def machine_busy_between(self, start: float, end: float) -> float:
        """CPU seconds the whole machine was busy (every process, this tree's and any other)."""
        if not self._times:
            return 0.0
        return self._machine[self._at(end)] - self._machine[self._at(start)]
