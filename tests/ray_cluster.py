"""A real two-node Ray cluster on this machine for the tests: `ray start --head --num-cpus 1` and a second
`ray start --address ... --num-cpus 1`, small object stores, no dashboard, every port chosen free (so it stands
beside any other Ray on the machine), its own temp dir. `stop()` ends exactly the processes it started (those
whose command line names its temp dir, and their children), not every Ray process of the machine as `ray stop`
would.

    python tests/ray_cluster.py start      # prints the address; for a manual run
    python tests/ray_cluster.py stop DIR
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).with_name("ray"))
OBJECT_STORE = "100000000"       # bytes per node: batch lines and results are small


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def node_ports(min_worker: int) -> list[str]:
    agent, grpc, metrics, runtime_env, node_manager, object_manager = free_ports(6)
    return ["--dashboard-agent-listen-port", str(agent), "--dashboard-agent-grpc-port", str(grpc),
            "--metrics-export-port", str(metrics), "--runtime-env-agent-port", str(runtime_env),
            "--node-manager-port", str(node_manager), "--object-manager-port", str(object_manager),
            "--min-worker-port", str(min_worker), "--max-worker-port", str(min_worker + 200)]


def worker_port_base(seed: int, nodes: int) -> int:
    """The first of `nodes` worker port ranges (201 ports each), below the kernel's ephemeral range: the other
    ports are bound ephemeral ones (`free_ports`), so a range there could hold one of them and Ray refuses to start
    ("worker_ports is trying to use a port number ... used by other components")."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    span = 200 * nodes + 1
    slots = max(1, (low - 10000) // span)
    return 10000 + (seed % slots) * span


def env() -> dict:
    # the workers import this checkout's kvflow; Ray reports no usage and keeps its memory small
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(":"),
            "RAY_DISABLE_USAGE_STATS": "1", "RAY_USAGE_STATS_ENABLED": "0"}


class RayCluster:
    def __init__(self, temp_dir: str) -> None:
        self.temp_dir = temp_dir
        self.address: str | None = None

    @classmethod
    def start(cls, nodes: int = 2, cpus_per_node: int = 1) -> "RayCluster":
        # a short path: Ray's unix sockets live under it (108 bytes at most)
        cluster = cls(tempfile.mkdtemp(prefix="kvray", dir="/tmp"))
        port = free_ports(1)[0]
        base = worker_port_base(port, nodes)
        common = ["--num-cpus", str(cpus_per_node), "--object-store-memory", OBJECT_STORE, "--disable-usage-stats"]
        try:
            cluster._ray("start", "--head", "--port", str(port), "--include-dashboard=false",
                         "--temp-dir", cluster.temp_dir, *common, *node_ports(base))
            cluster.address = f"127.0.0.1:{port}"
            for i in range(1, nodes):
                cluster._ray("start", "--address", cluster.address, *common, *node_ports(base + 200 * i))
            cluster.wait_for_nodes(nodes)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _ray(self, *args: str) -> None:
        run = subprocess.run([RAY, *args], capture_output=True, text=True, timeout=120, env=env(), cwd=REPO)
        if run.returncode != 0:
            raise RuntimeError(f"ray {' '.join(args[:2])} failed:\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}")

    def wait_for_nodes(self, n: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            run = subprocess.run([RAY, "status", "--address", self.address], capture_output=True, text=True,
                                 timeout=60, env=env())
            active = run.stdout.split("Active:", 1)[-1].split("Pending:", 1)[0]
            if active.count("node_") >= n:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Ray cluster has not {n} nodes after {timeout}s:\n{run.stdout}{run.stderr}")
            time.sleep(0.5)

    def stop(self) -> list[int]:
        """SIGTERM, then SIGKILL, to the processes naming the temp dir and their descendants."""
        return kill_tree(self.temp_dir)


def kill_tree(tag: str) -> list[int]:
    procs: dict[int, tuple[int, str]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace")
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            procs[int(entry)] = (ppid, cmd)
    mine, p = set(), os.getpid()
    while p > 1:                          # never this process nor its parents (their command line may name it)
        mine.add(p)
        p = procs.get(p, (1, ""))[0]
    found = {p for p, (_, cmd) in procs.items() if tag in cmd and p not in mine}
    grew = True
    while grew:
        grew = False
        for p, (ppid, _) in procs.items():
            if ppid in found and p not in found and p not in mine:
                found.add(p)
                grew = True
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in found:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass
        if sig == signal.SIGTERM:
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in found):
                time.sleep(0.1)
    return sorted(found)


# Connected once before the run starts, it watches the cluster's actor table (the GCS's, what `ray list actors`
# shows) and SIGKILLs one of the run's two replicas as soon as both are up and results have begun to arrive; then
# waits for Ray to restart it. Prints one JSON line per event.
KILLER = """
import json, os, signal, sys, time
import ray
from ray._private import state
address, output = sys.argv[1], sys.argv[2]
ray.init(address=address, logging_level="ERROR", log_to_driver=False)
def replicas():
    return [a for a in state.actors().values() if "BatchReplica" in a["ActorClassName"]]
before = {a["ActorID"] for a in replicas()}
print(json.dumps({"event": "ready"}), flush=True)
deadline = time.monotonic() + 300
while time.monotonic() < deadline:
    live = [a for a in replicas() if a["ActorID"] not in before and a["State"] == "ALIVE"]
    written = len(open(output).read().splitlines()) if os.path.exists(output) else 0
    if len(live) == 2 and written:
        victim = live[0]
        os.kill(victim["Pid"], signal.SIGKILL)
        print(json.dumps({"event": "killed", "pid": victim["Pid"], "written": written}), flush=True)
        break
    time.sleep(0.02)
else:
    sys.exit("no two replicas with results within 300 s")
while time.monotonic() < deadline:
    again = [a for a in replicas() if a["ActorID"] == victim["ActorID"]][0]
    if again["NumRestarts"] >= 1:
        print(json.dumps({"event": "restarted", "restarts": again["NumRestarts"], "pid": again["Pid"]}), flush=True)
        break
    time.sleep(0.1)
"""


if __name__ == "__main__":
    if sys.argv[1] == "start":
        c = RayCluster.start()
        print(c.address, c.temp_dir)
    else:
        print(kill_tree(sys.argv[2]))
