"""Multi-node placement on a real two-node Ray cluster, both nodes on this machine: a head
(`ray start --head`, 1 CPU, custom resource engine_node, label pool=gen) and a second node
(`ray start --address=...`, 2 CPUs, custom resource trainer_node, label pool=train). The demo
config runs across them, unchanged but for the cluster keys, a short run and the tests' tiny model
and shards, and the test reads from Ray's state API where each actor ran: the engine and the
rollout worker on the head, the trainer ranks and the reward worker on the second node; the
weights reach the engine over the collective transport, from one node to the other. Then two
ZeRO-3 ranks, one per node, form one process group at rank 0's node address and gather the
model they partitioned. A faster test reserves placement groups on a local instance.

The cluster keys use every way to place a role: a custom resource (engines, reward workers), a
node label (trainer ranks, rollout workers), a placement group (cluster.placement_strategy=PACK:
bundles for the engine, each rank and the reward workers) and scheduling outside it (the rollout
workers ask for no resources, so they are placed by their label alone).

Only the two nodes started here are stopped: other Ray instances may run on this machine at
the same time (never a bare `ray stop`, which stops every Ray process on the machine)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import psutil
import pytest
from _runs import HANG_S, REPO, rows, run_env, train_cmd

from mmrl.utils.env import RAY_WORKER_REGISTER_TIMEOUT_S

RAY = str(Path(sys.executable).with_name("ray"))
START_S = 180.0  # hang guard for the nodes to register on a loaded 2-core machine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TwoNodes:
    """Two `ray start --block` processes (each stops its node's processes when terminated) under
    one short temp dir (Ray's socket paths must stay under the OS limit)."""

    def __init__(self) -> None:
        self.temp_dir = tempfile.mkdtemp(prefix="mmrl-mn-", dir="/tmp")
        self.gcs_port, self.dashboard_port = _free_port(), _free_port()
        self.address = f"127.0.0.1:{self.gcs_port}"
        self.dashboard = f"http://127.0.0.1:{self.dashboard_port}"
        self.procs: list[subprocess.Popen] = []
        # as init_local_ray sets them for a local instance: workers at normal priority, time to register
        self.env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
                    "RAY_worker_niceness": "0", "RAY_worker_register_timeout_seconds": str(RAY_WORKER_REGISTER_TIMEOUT_S)}

    def _start(self, name: str, *args: str) -> None:
        # every port chosen here, none of Ray's fixed defaults: other Ray instances may hold them
        ports = [f"--{flag}={_free_port()}" for flag in (
            "node-manager-port", "object-manager-port", "metrics-export-port", "dashboard-agent-listen-port",
            "dashboard-agent-grpc-port", "runtime-env-agent-port")]
        cmd = [RAY, "start", "--block", f"--temp-dir={self.temp_dir}", "--num-gpus=0", "--disable-usage-stats",
               "--object-store-memory=300000000", *ports, *args]
        with open(Path(self.temp_dir) / f"{name}.log", "w") as log:
            self.procs.append(subprocess.Popen(cmd, cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                               start_new_session=True))

    def start(self) -> None:
        # the dashboard serves Ray's state API (where each actor ran); it is all it is here for
        self._start("head", "--head", f"--port={self.gcs_port}", f"--ray-client-server-port={_free_port()}",
                    "--include-dashboard=true", f"--dashboard-port={self.dashboard_port}", "--num-cpus=1",
                    '--resources={"engine_node": 1}', "--labels=pool=gen")
        self._wait(lambda: (Path(self.temp_dir) / "ray_current_cluster").exists(), "the head node")
        self._start("second", f"--address={self.address}", "--num-cpus=2", '--resources={"trainer_node": 1}',
                    "--labels=pool=train")
        self._wait(lambda: len(self.nodes()) == 2, "both nodes (and the state API)")

    def _wait(self, ready: Any, what: str) -> None:
        deadline = time.time() + START_S
        while time.time() < deadline:
            assert all(p.poll() is None for p in self.procs), f"a node stopped while waiting for {what}:\n" + self.logs()
            try:
                if ready():
                    return
            except Exception:  # the state API is not up yet
                pass
            time.sleep(1)
        raise AssertionError(f"{what} did not come up within {START_S:g} s:\n" + self.logs())

    def nodes(self) -> list[Any]:
        from ray.util.state import list_nodes

        return [n for n in list_nodes(address=self.dashboard, detail=True) if n.state == "ALIVE"]

    def actors(self) -> list[Any]:
        from ray.util.state import list_actors

        return list_actors(address=self.dashboard, detail=True, limit=1000)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in Path(self.temp_dir).glob("*.log"))

    def stop(self) -> None:
        """Terminate the two `ray start --block` processes (each stops its node: GCS, raylet,
        dashboard), then kill whatever of their process trees outlived that (the workers and the
        engine-core processes descend from the raylets)."""
        tree = []
        for p in self.procs:
            try:
                tree += psutil.Process(p.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                pass
        for p in reversed(self.procs):  # the second node first, the head last
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        _, alive = psutil.wait_procs(tree, timeout=15)
        for proc in alive:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        shutil.rmtree(self.temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")  # the two tests below share one cluster: its start is ~20 s
def two_nodes() -> Iterator[TwoNodes]:
    nodes = TwoNodes()
    try:
        nodes.start()
        yield nodes
    finally:
        nodes.stop()


def test_reserve_placement_on_a_local_instance(capsys: pytest.CaptureFixture[str]) -> None:
    """The group is reserved with the plan's bundles and the actors run inside it; reserving again
    under the run's name (a restart in the same process) replaces the first group instead of
    holding both; a group that cannot fit is refused with the key to change; an actor no node has
    the resources for is named at once (it would wait)."""
    import ray
    from ray.util import get_current_placement_group, placement_group_table

    from mmrl.config import load_config
    from mmrl.controller.placement import placement_plan, reserve_placement
    from mmrl.utils.env import init_local_ray

    def plan_for(strategy: str, *more: str) -> list[Any]:
        cfg = load_config(str(REPO / "configs" / "colors_demo.yaml"),
                          ["cluster.ray_address=auto", f"cluster.placement_strategy={strategy}", *more],
                          check_files=False)
        return placement_plan(cfg, "cpu")

    init_local_ray(num_cpus=2, include_dashboard=False)
    try:
        first = reserve_placement(plan_for("PACK"), "PACK", name="mmrl:test")
        plan = plan_for("PACK")
        group = reserve_placement(plan, "PACK", name="mmrl:test")
        live = [g for g in placement_group_table().values() if g["name"] == "mmrl:test" and g["state"] != "REMOVED"]
        assert [g["placement_group_id"] for g in live] == [group.id.hex()] and first.id != group.id
        assert group.bundle_specs == [{"CPU": 1.0}, {"CPU": 0.5}, {"CPU": 0.5}]

        @ray.remote
        class Probe:
            def group_id(self) -> str:
                return get_current_placement_group().id.hex()

        rank1 = next(p for p in plan if p.role == "trainer" and p.index == 1)
        assert ray.get(Probe.options(**rank1.ray_options()).remote().group_id.remote()) == group.id.hex()

        with pytest.raises(RuntimeError, match=r"cluster.placement_strategy=STRICT_SPREAD: the placement group's "
                                               r"3 bundles .* found no room"):
            reserve_placement(plan_for("STRICT_SPREAD"), "STRICT_SPREAD", name="mmrl:spread", timeout_s=3)
        reserve_placement(plan_for("PACK", "cluster.role_resources.trainer.trainer_node=0.01"), None, name="x")
        assert "no node of the Ray cluster offers trainer/0 its resources {'trainer_node': 0.01}" in capsys.readouterr().err
    finally:
        ray.shutdown()


@pytest.mark.slow
def test_demo_runs_across_two_nodes_with_each_role_where_the_config_puts_it(
        two_nodes: TwoNodes, tmp_path: Path, tiny_model_dir: Path, colors_dir: Path) -> None:
    run_dir = tmp_path / "run"
    placement = ["cluster.placement_strategy=PACK", "cluster.role_resources.rollout.engine_node=0.01",
                 "cluster.role_labels.trainer.pool=train", "cluster.role_resources.reward.trainer_node=0.01",
                 "cluster.role_labels.rollout_worker.pool=gen"]
    cmd = train_cmd(run_dir, tiny_model_dir, colors_dir, f"cluster.ray_address={two_nodes.address}",
                    "run.max_steps=2", "weight_sync.transport=collective", "weight_sync.bucket_mb=0.25",
                    *placement)
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=HANG_S, env=run_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:] + two_nodes.logs()
    metrics = rows(run_dir)
    assert max(metrics) == 2  # the last step logged: the run went through
    # the collective transport carried the weights across the nodes: in several buckets, of which
    # the engine held about one at a time (the object store stages the whole model)
    syncs = [m for m in metrics.values() if "weight_sync/engine_peak_staged_mb" in m]
    assert syncs and all(m["weight_sync/buckets"] >= 4 for m in syncs), syncs
    assert all(0 < m["weight_sync/engine_peak_staged_mb"] <= 2 * 0.25 + 0.1 < m["weight_sync/mb"] / 2
               for m in syncs), syncs

    node_of = {("engine" if "engine_node" in n.resources_total else "trainer"): n.node_id
               for n in two_nodes.nodes()}
    assert set(node_of) == {"engine", "trainer"}
    ran: dict[str, list[Any]] = {}
    for a in two_nodes.actors():
        ran.setdefault(a.class_name, []).append(a)
    name_of = {nid: name for name, nid in node_of.items()}
    where = {cls: sorted({name_of.get(a.node_id, a.node_id) for a in actors}) for cls, actors in ran.items()}
    assert where["RolloutEngine"] == ["engine"], where
    assert where["RolloutWorker"] == ["engine"], where
    assert where["TrainerWorker"] == ["trainer"], where
    assert where["RewardWorker"] == ["trainer"], where
    # the run's own record of its ranks names the processes the second node ran
    ranks = json.loads((run_dir / "ranks.json").read_text())
    assert {r["pid"] for r in ranks} == {a.pid for a in ran["TrainerWorker"]}
    assert len(ranks) == 2
    # the engine, the ranks and the reward workers ran in the run's placement group (4 bundles, as
    # --dry-run plans them); the rollout worker asks for nothing and ran outside it
    from ray.util.state import list_placement_groups

    groups = [g for g in list_placement_groups(address=two_nodes.dashboard, detail=True)
              if g.name == f"mmrl:{run_dir.resolve()}"]
    assert len(groups) == 1 and len(groups[0].bundles) == 4, groups
    in_group = {cls: {a.placement_group_id for a in actors} for cls, actors in ran.items()}
    for cls in ("RolloutEngine", "TrainerWorker", "RewardWorker"):
        assert in_group[cls] == {groups[0].placement_group_id}, (cls, in_group)
    assert groups[0].placement_group_id not in in_group["RolloutWorker"], in_group


@pytest.mark.slow
def test_zero3_ranks_on_two_nodes_meet_at_rank_0s_node_and_gather_the_model(
        two_nodes: TwoNodes, tmp_path: Path, tiny_model_dir: Path) -> None:
    """ZeRO-3 across nodes: rank 0 on the second node, rank 1 on the head. Rank 0 listens on its
    node's address (not loopback, which the other node could not reach across machines), each
    rank is local rank 0 of its node, and the model they partitioned between them gathers back
    to the weights it was loaded from."""
    import ray
    import torch
    from transformers import AutoModelForImageTextToText

    from mmrl.trainer.update import LossSettings
    from mmrl.trainer.worker import TrainerSpec, make_trainer_actors, setup_ranks
    from mmrl.utils.env import engine_env

    spec = TrainerSpec(model_path=str(tiny_model_dir), dtype="float32", world_size=2, device="cpu", lr=1e-3,
                       betas=(0.9, 0.999), weight_decay=0.0, grad_clip=1.0, deepspeed={}, temperature=1.0,
                       forbidden_token_ids=[], pad_token_id=0, loss=LossSettings(), seed=0,
                       env=engine_env(tmp_path, "cpu"))
    ray.init(address=two_nodes.address, runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1"}})
    try:
        ranks = make_trainer_actors(spec, [{"num_cpus": 0, "label_selector": {"pool": pool}}
                                           for pool in ("train", "gen")])
        setups, rendezvous = setup_ranks(ranks)
        host, _port = ray.get(rendezvous, timeout=HANG_S)
        ray.get(setups, timeout=HANG_S)
        ip_of = {n.node_id: n.node_ip for n in two_nodes.nodes()}
        nodes = ray.get([r.node_id.remote() for r in ranks])
        assert nodes[0] != nodes[1] and set(nodes) == set(ip_of)
        assert host == ip_of[nodes[0]]  # the second node's address: the head's rank reached it there
        assert [(i["local_rank"], i["local_world_size"]) for i in ray.get([r.setup_info.remote() for r in ranks])] \
            == [(0, 1), (0, 1)]
        gathered, none = ray.get([r.full_state_dict.remote() for r in ranks], timeout=HANG_S)
        assert none is None
        loaded = AutoModelForImageTextToText.from_pretrained(tiny_model_dir, dtype=torch.float32).state_dict()
        shared = set(gathered) & set(loaded)
        assert len(shared) > 10 and shared == set(gathered)
        assert all(torch.equal(gathered[k], loaded[k]) for k in shared)
        ray.get([r.shutdown.remote() for r in ranks], timeout=HANG_S)
    finally:
        ray.shutdown()
