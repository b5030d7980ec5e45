"""Several Ray nodes, simulated on this machine: one `ray start --head` plus more `ray start --address=...`,
each with its own temp dir and a custom resource naming it. The config places the engines on some nodes and
the training worker on another; a node whose raylet is killed mid-run loses its engines, which Ray re-places
on a live node with room."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

# Ray on loopback, without the token of a secured cluster; a dead node is noticed within a few seconds.
ROOT = Path(__file__).resolve().parents[1]
RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_worker_niceness": "0", "RAY_health_check_period_ms": "500",
           "RAY_health_check_failure_threshold": "4", "RAY_health_check_timeout_ms": "1000"}


def _descendants(roots: list[int]) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    seen, todo = set(), list(roots)
    while todo:
        pid = todo.pop()
        if pid not in seen:
            seen.add(pid)
            todo += children.get(pid, [])
    return seen


def _processes_mentioning(marker: str) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                if marker in Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace"):
                    out.append(int(entry))
            except OSError:
                pass
    return out


def _kill(pids: set[int]) -> None:
    for pid in pids - {os.getpid()}:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


class LocalNodes:
    """Ray nodes on this machine, each in a temp dir of its own (``ray stop`` is never used: it would stop
    every Ray instance on the machine)."""

    def __init__(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"
        self.dirs: dict[str, str] = {}

    def start(self, name: str, cpus: int, resources: dict[str, float]) -> None:
        temp_dir = tempfile.mkdtemp(prefix=f"rn-{name}-", dir="/tmp")  # short: Ray's socket paths live under it
        head = not self.dirs
        where = (["--head", f"--port={self.port}", "--include-dashboard=false"] if head
                 else [f"--address={self.address}"])
        subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "start", *where, "--node-ip-address=127.0.0.1",
                        f"--num-cpus={cpus}", f"--resources={json.dumps(resources)}", f"--temp-dir={temp_dir}",
                        "--disable-usage-stats"], env={**os.environ, **RAY_ENV}, check=True, capture_output=True)
        self.dirs[name] = temp_dir

    def kill_raylet(self, name: str) -> None:
        raylets = [pid for pid in _processes_mentioning(f"--raylet_socket_name={self.dirs[name]}")]
        assert raylets, f"no raylet of node {name} found"
        _kill(_descendants(raylets))

    def stop(self) -> None:
        for temp_dir in reversed(list(self.dirs.values())):
            _kill(_descendants(_processes_mentioning(temp_dir)))


@pytest.fixture
def nodes():
    cluster = LocalNodes()
    try:
        yield cluster
    finally:
        cluster.stop()


# The run's driver, in a process of its own: Ray keeps process-wide state (its auth settings among them) that
# must not leak into the other tests. After step 2 it writes the cluster's nodes to GATE.reached and waits
# for GATE.release: the moment to kill a node is chosen by the test, not raced.
DRIVER = """
import json, logging, sys, time
from pathlib import Path
import miles
from miles.run.runner import prepare, train
gate = Path(sys.argv[1])

class Hold:
    @miles.hookimpl
    def miles_train_step_end(self, step):
        if step == 2:
            import ray
            nodes = [(n["NodeID"], n["RayletSocketName"]) for n in ray.nodes()]
            gate.with_suffix(".reached").write_text(json.dumps(nodes))
            while not gate.with_suffix(".release").exists():
                time.sleep(0.05)

logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
train(prepare("configs/quickstart.yaml", sys.argv[2:], extra_plugins=[("hold", Hold())]))
"""


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_engines_and_training_on_named_nodes_and_an_engine_of_a_lost_node_is_re_placed(tmp_path, nodes):
    nodes.start("head", 2, {"train_node": 1})
    nodes.start("b", 1, {"engine_node": 1})
    nodes.start("c", 1, {"engine_node": 1})
    gate, run_dir = tmp_path / "gate", tmp_path / "run"
    overrides = [
        f"run.dir={run_dir}", "run.progress=false", "sft.steps=0", "run.steps=6", "run.eval_size=0",
        "rollout.prompts_per_step=4", "rollout.n_samples=4", "rollout.engine.num_engines=1",
        f"cluster.address={nodes.address}", "cluster.engine_resources={engine_node: 1}",
        "cluster.train_resources={train_node: 1}", "rollout.weight_sync.name=tensor"]
    with open(tmp_path / "driver.log", "w+") as log:
        driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(gate), *overrides], cwd=ROOT, stdout=log,
                                  stderr=subprocess.STDOUT, env={**os.environ, **RAY_ENV})
        try:
            while not gate.with_suffix(".reached").exists():
                assert driver.poll() is None, f"the run ended before step 2:\n{Path(log.name).read_text()[-3000:]}"
                time.sleep(0.1)
            reached = json.loads(gate.with_suffix(".reached").read_text())
            by_socket = {socket_name: node_id for node_id, socket_name in reached}
            head, b, c = (next(node for path, node in by_socket.items() if path.startswith(nodes.dirs[name]))
                          for name in ("head", "b", "c"))
            placed = Path(log.name).read_text()
            train_line = next(line for line in placed.splitlines() if line.startswith("backend: the training worker"))
            engine_line = next(line for line in placed.splitlines() if line.startswith("rollout.engine: 1 engine"))
            assert f"({head[:8]})" in train_line  # train_resources: the only node with train_node
            assert f"({b[:8]})" in engine_line or f"({c[:8]})" in engine_line  # engine_resources: never the head
            lost, lost_id = ("b", b) if f"({b[:8]})" in engine_line else ("c", c)
            nodes.kill_raylet(lost)
            gate.with_suffix(".release").touch()
            assert driver.wait(timeout=600) == 0, Path(log.name).read_text()[-3000:]
        finally:
            if driver.poll() is None:
                driver.kill()
        output = Path(log.name).read_text()
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == list(range(6))
    assert [r["weight_version"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert sum(r["rollout/engines_lost_with_node"] for r in rows) == 1
    assert sum(r["rollout/readmissions"] for r in rows) >= 1
    assert rows[-1]["rollout/engines_in_service"] == 1
    reports = [line for line in output.splitlines() if "which is gone" in line]
    assert len(reports) == 1 and f"({lost_id[:8]})" in reports[0] and "engine_node" in reports[0]
