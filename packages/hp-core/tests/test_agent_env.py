"""The environment ``hp run``'s agent gives a worker and a spare (hp.core.agent.env): the keys and values
the agent set before it was split into parts, and which source wins a key two of them set."""

from __future__ import annotations

import os

from torch.distributed.elastic.multiprocessing import Std

from hp.core.agent.env import heartbeat_file, worker_env
from hp.core.config import ElasticConfig, FaultToleranceConfig, LaunchConfig, RendezvousConfig, RunConfig
from hp.core.worker_env import WorkerEnv
from hp.core.workers import Worker

TOKEN = "t" * 64


def _cfg(elastic: dict | None = None, rendezvous: dict | None = None) -> RunConfig:
    return RunConfig(LaunchConfig(entrypoint="train.py", nproc_per_node=2, nnodes=2, node_rank=1, run_id="job7"),
                     FaultToleranceConfig(max_restarts=3), ElasticConfig(**(elastic or {})),
                     RendezvousConfig(**(rendezvous or {})))


def _env(w: Worker, cfg: RunConfig, **kw) -> dict[str, str]:
    w.heartbeat_file = heartbeat_file("/logs", w)
    args = {"world_size": 4, "store_host": "10.0.0.1", "store_port": 29500, "generation": 5,
            "controller": "10.0.0.1:29400", "token": TOKEN, "transport": "gloo", "store": "tcp", "log_dir": "/logs",
            "agent_pid": 4242}
    return worker_env(w, cfg, **{**args, **kw})


def _worker(**kw) -> Worker:
    return Worker(command=["python", "train.py"], log_dir="/logs", tee=Std(3), **kw)


COMMON = {
    "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "4", "ROLE_WORLD_SIZE": "4", "ROLE_NAME": "default",
    "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500",
    "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "job7", "TORCHELASTIC_MAX_RESTARTS": "3",
    "HP_GENERATION": "5", "HP_CONTROLLER": "10.0.0.1:29400", "HP_JOB_TOKEN": TOKEN, "HP_TRANSPORT": "gloo",
    "HP_STORE": "tcp", "HP_STORE_JOB": "job7", "HP_CONTROLLER_HA": "", "HP_NODE_RANK": "1", "HP_RUN_ID": "job7",
    "HP_LOG_DIR": "/logs", "HP_AGENT_PID": "4242",
}


def test_a_worker_gets_its_rank_device_and_the_job_s_coordinates():
    cfg = _cfg()
    w = _worker(rank=3, local_rank=1, holder="r3@1", restarts=1)
    env = _env(w, cfg)
    assert w.heartbeat_file == os.path.join("/logs", "heartbeats", "rank3.attempt1")
    assert env == {**COMMON, **cfg.worker_thread_env(), "RANK": "3", "ROLE_RANK": "3", "LOCAL_RANK": "1",
                   "HP_ROLE": "worker", "HP_HOLDER": "r3@1", "HP_HEARTBEAT_FILE": w.heartbeat_file}


def test_a_spare_has_no_rank_until_promoted_and_keeps_its_device():
    cfg = _cfg()
    w = _worker(rank=-1, local_rank=2, spare_id="n1s0", holder="spare:n1s0")
    env = _env(w, cfg)
    assert w.heartbeat_file == os.path.join("/logs", "heartbeats", "spare-n1s0.attempt0")
    assert env == {**COMMON, **cfg.worker_thread_env(), "LOCAL_RANK": "2", "HP_ROLE": "spare",
                   "HP_SPARE_ID": "n1s0", "HP_HOLDER": "spare:n1s0", "HP_HEARTBEAT_FILE": w.heartbeat_file}
    assert "RANK" not in env and "ROLE_RANK" not in env


def test_it_reads_back_as_the_typed_contract():
    cfg = _cfg(elastic={"scaling_policy": "policy.py"})
    env = _env(_worker(rank=3, local_rank=1, holder="r3@1"), cfg)
    back = WorkerEnv.from_env(env)
    assert (back.rank, back.local_rank, back.world_size, back.generation, back.agent_pid) == (3, 1, 4, 5, 4242)
    assert env["HP_SCALING_POLICY"] == back.scaling_policy == os.path.abspath("policy.py")


def test_sources_merge_in_order_and_the_agent_s_own_environment_keeps_a_transport_default():
    cfg = _cfg()
    env = _env(_worker(rank=0, local_rank=0, holder="r0@0"), cfg,
               transport_defaults={"GLOO_X": "1", "NCCL_Y": "default", "HP_GENERATION": "0"},
               services_env={"HP_SVC": "a:1", "WORLD_SIZE": "99"}, relay_env={"HP_FANOUT": "/chan", "HP_HOLDER": "x"},
               outer_env={"NCCL_Y": "the user's"})
    assert env["GLOO_X"] == "1" and "NCCL_Y" not in env  # the worker inherits the user's value
    assert env["HP_SVC"] == "a:1"
    assert env["WORLD_SIZE"] == "4" and env["HP_GENERATION"] == "5"  # hp's contract over the services' and defaults
    assert env["HP_FANOUT"] == "/chan" and env["HP_HOLDER"] == "x"  # the relay's last


def test_an_ha_job_tells_workers_to_follow_the_controller():
    cfg = _cfg(rendezvous={"store": "etcd", "store_endpoint": "10.0.0.9:2379"})
    env = _env(_worker(rank=0, local_rank=0, holder="r0@0"), cfg, store="etcd")
    assert env["HP_CONTROLLER_HA"] == "1" and env["HP_STORE"] == "etcd"
