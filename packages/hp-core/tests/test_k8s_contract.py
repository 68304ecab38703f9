"""Contract tests of `hp k8s manifest` / hp.core.schedulers.k8s.manifest: no API server runs here, so every generated
object is checked against the schemas an API server would check it with: Kubernetes' own (kubernetes-validate,
strict, two versions) for core and RBAC kinds and for the Job and pod templates inside JobSets and Volcano
Jobs, the vendored CRDs' openAPIV3Schema (jsonschema, strict fields) for the custom kinds; core and RBAC kinds
also round-trip through the official client's models. The flags in the pods' commands are parsed by hp's own CLI parser."""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import kubernetes_validate
import pytest
import yaml
from kubernetes.client import ApiClient

from hp.core import cli
from hp.core.schedulers.k8s import schemas
from hp.core.schedulers.k8s.manifest import WRAPPER, ManifestConfig, watch_args
from hp.core.schedulers.k8s.objects import manifests

K8S_VERSIONS = ("1.31.0", "1.36.0")  # kubernetes-validate 1.37.0 bundles 1.25 .. 1.37; JobSet and native
                                     # sidecars (the watcher's restartPolicy: Always init container) need >= 1.29
POLICY = "min_replicas: 2\nmax_replicas: 8\nglobal_batch: 64\nmicro_batch: 4\n"
REPO = Path(__file__).resolve().parents[3]
CONFIGS = {
    "minimal": ManifestConfig(name="demo", entrypoint="train.py"),
    "elastic-kueue": ManifestConfig(name="llama-8b", entrypoint="train.py", args=["--steps", "1000"], min_nodes=2,
                                    max_nodes=4, scaling_policy=POLICY, nproc_per_node=8, gpus_per_node=8, cpu="90",
                                    memory="1000Gi", ckpt_state_gib=40, ckpt_replicas=1, namespace="team-a",
                                    queue="team-a-queue", workload_priority_class="training",
                                    image="registry.example.com/ml/hp:0.1.0", node_selector={"gpu.example.com/type": "h100"}),
    "split-elastic": ManifestConfig(name="demo", entrypoint="pkg.train", module=True, min_nodes=1, max_nodes=3,
                                    scaling_policy=POLICY, split_elastic=True, queue="q", memory="64Gi",
                                    workload_priority_class="high", elastic_workload_priority_class="low",
                                    grace_period_s=90.5, service_account="trainer", max_restarts=2),
    "volcano": ManifestConfig(name="demo", entrypoint="train.py", variant="volcano", min_nodes=2, max_nodes=5,
                              scaling_policy=POLICY, queue="research", gpus_per_node=4, memory="128Gi"),
    "volcano-fixed": ManifestConfig(name="fixed", entrypoint="train.py", variant="volcano", min_nodes=3),
    "no-watch": ManifestConfig(name="plain", entrypoint="train.py", namespace="team-a", watch=False),
}
CORE_MODELS = {"ConfigMap": "V1ConfigMap", "Service": "V1Service", "Pod": "V1Pod", "ServiceAccount": "V1ServiceAccount",
               "Role": "V1Role", "RoleBinding": "V1RoleBinding", "ClusterRole": "V1ClusterRole",
               "ClusterRoleBinding": "V1ClusterRoleBinding"}
RBAC_KINDS = ["ServiceAccount", "Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding"]
READ = ["get", "list", "watch"]


def _objects(name: str) -> list[dict]:
    return manifests(copy.deepcopy(CONFIGS[name]))


def _pod_templates(obj: dict) -> list[tuple[str, dict]]:
    if obj["kind"] == "JobSet":
        return [(r["name"], r["template"]["spec"]["template"]) for r in obj["spec"]["replicatedJobs"]]
    if obj["kind"] == "Job" and obj["apiVersion"].startswith("batch.volcano.sh"):
        return [(t["name"], t["template"]) for t in obj["spec"]["tasks"]]
    if obj["kind"] == "Pod":
        return [("controller", {"metadata": obj["metadata"], "spec": obj["spec"]})]
    return []


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_object_validates_against_the_official_schemas(name):
    for obj in _objects(name):
        if schemas.known(obj["apiVersion"], obj["kind"]):
            schemas.validate(obj)
        else:
            for version in K8S_VERSIONS:
                kubernetes_validate.validate(obj, version, strict=True)
        if obj["kind"] == "JobSet":  # each replicated job's template is a batch/v1 JobTemplateSpec
            for rj in obj["spec"]["replicatedJobs"]:
                job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": f"{obj['metadata']['name']}-{rj['name']}-0"},
                       "spec": rj["template"]["spec"]}
                for version in K8S_VERSIONS:
                    kubernetes_validate.validate(job, version, strict=True)
        if obj["apiVersion"] == "batch.volcano.sh/v1alpha1":  # a task's template is a PodTemplateSpec
            for task in obj["spec"]["tasks"]:
                template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": task["name"]},
                            "template": task["template"]}
                for version in K8S_VERSIONS:
                    kubernetes_validate.validate(template, version, strict=True)


def test_the_validators_refuse_what_an_api_server_would():
    """The checks above can fail: an unknown field, a wrong type, a bad enum, a bad pod template."""
    objects = {o["kind"]: o for o in _objects("elastic-kueue")}
    js = copy.deepcopy(objects["JobSet"])
    js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(schemas.SchemaError, match="imagePullPolicyy"):
        schemas.validate(js)
    js = copy.deepcopy(objects["JobSet"])
    js["spec"]["successPolicy"]["operator"] = "Most"
    with pytest.raises(schemas.SchemaError, match="successPolicy/operator"):
        schemas.validate(js)
    js = copy.deepcopy(objects["JobSet"])
    js["spec"]["replicatedJobs"][0]["replicas"] = "1"
    with pytest.raises(schemas.SchemaError, match="replicas"):
        schemas.validate(js)
    pod = copy.deepcopy(objects["Pod"])
    pod["spec"]["containers"][0]["env"][0]["valueFrom"]["fieldRef"]["fieldPathh"] = "x"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod, "1.36.0", strict=True)
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "x"},
           "spec": copy.deepcopy(objects["JobSet"]["spec"]["replicatedJobs"][0]["template"]["spec"])}
    job["spec"]["podFailurePolicy"]["rules"][0]["action"] = 7
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, "1.36.0", strict=True)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_core_objects_round_trip_through_the_client_models(name):
    api = ApiClient()
    for obj in _objects(name):
        if obj["kind"] in CORE_MODELS:
            model = api.deserialize(SimpleNamespace(data=json.dumps(obj)), CORE_MODELS[obj["kind"]])
            assert type(model).__name__ == CORE_MODELS[obj["kind"]]
            assert api.sanitize_for_serialization(model) == obj


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_pods_commands_parse_with_hps_own_cli(name):
    """The worker's `hp run` and the controller's `hp controller` flags are real: hp's parser accepts them,
    with the values the config asked for."""
    cfg = CONFIGS[name]
    parser = cli.build_parser()
    for obj in _objects(name):
        for group, template in _pod_templates(obj):
            command = template["spec"]["containers"][0]["command"]
            if group == "controller":
                assert command[:2] == ["hp", "controller"]
                args = parser.parse_args([a.replace("$(HP_POD_IP)", "10.0.0.9") for a in command[1:]])
                assert (args.host, args.port, args.nnodes) == ("10.0.0.9", 29400, cfg.nnodes)
                continue
            assert command[:4] == ["/bin/sh", "-c", WRAPPER, "hp-run"]
            args = parser.parse_args(["run", "--node-rank", "0", *command[4:]])
            assert args.nnodes == cfg.nnodes and args.nproc_per_node == cfg.nproc_per_node
            assert args.rdzv_endpoint == f"{cfg.name}-controller.{cfg.namespace}.svc:29400" and args.external_controller
            assert args.grace_period_s == cfg.grace_period_s and args.module == cfg.module
            assert args.entrypoint == cfg.entrypoint and args.args == cfg.args
            assert (args.scaling_policy is not None) == (cfg.max_nodes is not None)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_node_ranks_grace_shm_image_and_priorities(name):
    cfg = CONFIGS[name]
    ranks = []
    for obj in _objects(name):
        sizes = {r["name"]: r["template"]["spec"]["completions"] for r in obj["spec"].get("replicatedJobs", [])} \
            if obj["kind"] == "JobSet" else {t["name"]: t["replicas"] for t in obj["spec"].get("tasks", [])} \
            if obj["apiVersion"].startswith("batch.volcano.sh") else {}
        for group, template in _pod_templates(obj):
            spec = template["spec"]
            container = spec["containers"][0]
            assert container["image"] == cfg.image
            assert spec["terminationGracePeriodSeconds"] >= cfg.grace_period_s + 10
            if group == "controller":
                continue
            env = {e["name"]: e for e in container["env"]}
            index_path = env["HP_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"]
            assert index_path == ("metadata.annotations['volcano.sh/task-index']" if cfg.variant == "volcano"
                                  else "metadata.annotations['batch.kubernetes.io/job-completion-index']")
            offset = int(env["HP_RANK_OFFSET"]["value"])
            ranks += [offset + i for i in range(sizes[group])]
            assert spec["priorityClassName"] == (cfg.base_priority_class if group == "base" else cfg.elastic_priority_class)
            shm = next(v for v in spec["volumes"] if v["name"] == "dshm")
            assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": cfg.shm}
            assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert sorted(ranks) == list(range(cfg.max_nodes or cfg.min_nodes))  # every node rank exactly once


def test_memory_tier_size_follows_the_checkpoint():
    # 40 GiB of state, two slots, itself + 1 replica: 160 GiB, + 1 GiB headroom
    assert CONFIGS["elastic-kueue"].shm == "161Gi"
    assert ManifestConfig(name="a", entrypoint="t.py").shm == "2Gi"
    assert ManifestConfig(name="a", entrypoint="t.py", shm_size="7Gi").shm == "7Gi"


def test_kueue_labels_and_split_elastic():
    by_name = {o["metadata"]["name"]: o for o in _objects("split-elastic") if o["kind"] == "JobSet"}
    assert by_name["demo"]["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "q"
    assert by_name["demo"]["metadata"]["labels"]["kueue.x-k8s.io/priority-class"] == "high"
    assert by_name["demo-elastic"]["metadata"]["labels"]["kueue.x-k8s.io/priority-class"] == "low"
    assert [r["name"] for r in by_name["demo-elastic"]["spec"]["replicatedJobs"]] == ["elastic"]
    assert all("kueue.x-k8s.io/queue-name" not in o["metadata"]["labels"] for o in _objects("minimal"))


def test_the_token_is_never_in_a_manifest(monkeypatch, capsys):
    token = "f" * 64
    monkeypatch.setenv("HP_JOB_TOKEN", token)
    for name, cfg in CONFIGS.items():
        text = json.dumps(_objects(name))
        assert token not in text
        for obj in _objects(name):
            assert obj["kind"] != "Secret"
            for _, template in _pod_templates(obj):
                for container in template["spec"]["containers"] + template["spec"].get("initContainers", []):
                    env = {e["name"]: e for e in container["env"]}
                    assert "value" not in env["HP_JOB_TOKEN"]
                    assert env["HP_JOB_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": cfg.secret_name,
                                                                                "key": "token"}
    assert cli.main(["k8s", "manifest", "--name", "demo", "train.py"]) == 0
    out, err = capsys.readouterr()
    assert token not in out and token not in err and "create secret generic demo-token" in err


BAD = [
    (["--name", "Demo"], "--name must be a DNS-1123 label"),
    (["--name", "a" * 41], "--name must be a DNS-1123 label"),
    (["--name", "demo", "--namespace", "team_a"], "--namespace must be a DNS-1123 label"),
    (["--name", "demo", "--nnodes", "2:4"], "--scaling-policy"),
    (["--name", "demo", "--nnodes", "4:2", "--scaling-policy", "examples/policy.yaml"], "--nnodes MAX must be an integer >= 4"),
    (["--name", "demo", "--memory", "8Gi", "--shm-size", "8Gi"], "counts against the pod's memory limit"),
    (["--name", "demo", "--cpu", "four"], "--cpu must be a positive Kubernetes quantity"),
    (["--name", "demo", "--image", "Bad Image"], "--image must be a container image reference"),
    (["--name", "demo", "--queue", "a/b"], "--queue must be a DNS-1123 subdomain"),
    (["--name", "demo", "--variant", "volcano", "--workload-priority-class", "x"], "Kueue's"),
    (["--name", "demo", "--token-key", "a/b"], "--token-key"),
    (["--name", "demo", "--grace-period", "0"], "--grace-period must be in (0, 86400]"),
    (["--name", "demo", "--nnodes", "1:2", "--scaling-policy", "/nonexistent/policy.yaml"], "policy"),
    (["--name", "demo", "--variant", "slurm"], "invalid choice"),
    (["--name", "demo", "--not-ready-grace", "0"], "--not-ready-grace must be in (0, 3600]"),
    (["--name", "demo", "--not-ready-grace", "3601"], "--not-ready-grace must be in (0, 3600]"),
    (["--name", "demo", "--not-ready-grace", "nan"], "--not-ready-grace must be in (0, 3600]"),
    (["--name", "demo", "--not-ready-grace", "soon"], "--not-ready-grace: invalid float value"),
    # #31 item 11: were tracebacks or an empty label key
    (["--name", "demo", "--cpu", "1e999"], "--cpu must be a positive Kubernetes quantity"),
    (["--name", "demo", "--ckpt-state-gib", "nan"], "--ckpt-state-gib must be > 0 and at most"),
    (["--name", "demo", "--ckpt-state-gib", "1e308"], "--ckpt-state-gib must be > 0 and at most"),
    (["--name", "demo", "--node-selector", "="], "--node-selector: expected KEY=VALUE with a non-empty KEY"),
]


@pytest.mark.parametrize("flags,message", BAD)
def test_bad_options_are_one_line_exit_2_nothing_written(flags, message, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert cli.main(["k8s", "manifest", *flags, "train.py"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("hp: error: ") and message in err, err


def test_the_command_prints_a_yaml_stream_of_the_same_objects():
    args = ["k8s", "manifest", "--name", "demo", "--nnodes", "1:3", "--scaling-policy", "examples/policy.yaml",
            "--gpus-per-node", "8", "--memory", "256Gi", "train.py", "--steps", "5"]
    done = subprocess.run([sys.executable, "-m", "hp.core.cli", *args], cwd=REPO, capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 0, done.stderr
    docs = list(yaml.safe_load_all(done.stdout))
    assert "&id" not in done.stdout  # no YAML anchors: no two places share one list
    as_json = subprocess.run([sys.executable, "-m", "hp.core.cli", *args[:2], "--json", *args[2:]], cwd=REPO,
                             capture_output=True, text=True, timeout=60, check=False)
    assert docs == json.loads(as_json.stdout)
    assert [d["kind"] for d in docs] == ["ConfigMap", *RBAC_KINDS, "Service", "Pod", "JobSet"]
    assert docs[0]["data"]["policy.yaml"] == (REPO / "examples" / "policy.yaml").read_text()


# --- the watcher: its sidecar, its RBAC objects, the workers' incarnation ------------------------------------


def _manifest_cli(capsys, *flags: str) -> list[dict]:
    assert cli.main(["k8s", "manifest", "--json", *flags, "train.py"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_worker_pods_know_their_incarnation_and_mount_no_token(name):
    """HP_NODE_INCARNATION is the pod's uid (a replacement pod of the same name has another one); workers never
    call the API, so they get no service account token."""
    templates = [(g, t) for obj in _objects(name) for g, t in _pod_templates(obj) if g != "controller"]
    assert templates
    for _, template in templates:
        env = {e["name"]: e for e in template["spec"]["containers"][0]["env"]}
        assert env["HP_NODE_INCARNATION"] == {"name": "HP_NODE_INCARNATION",
                                              "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}}
        assert template["spec"]["automountServiceAccountToken"] is False


def test_the_controller_pod_runs_the_watcher_as_a_native_sidecar():
    cfg = CONFIGS["elastic-kueue"]
    pod = next(o for o in _objects("elastic-kueue") if o["kind"] == "Pod")
    controller, = pod["spec"]["containers"]
    sidecar, = pod["spec"]["initContainers"]
    assert (sidecar["name"], sidecar["restartPolicy"]) == ("watch", "Always")
    assert sidecar["command"] == ["hp", *watch_args(cfg)] == [
        "hp", "k8s", "watch", "--job", "llama-8b", "--namespace", "team-a", "--controller", "$(HP_POD_IP):29400",
        "--nproc-per-node", "8", "--not-ready-grace", "10"]
    assert (sidecar["image"], sidecar["securityContext"]) == (controller["image"], controller["securityContext"])
    assert sidecar["env"] == controller["env"]  # HP_POD_IP from status.podIP, the token from the Secret
    assert sidecar["env"][0] == {"name": "HP_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    small = {"cpu": "100m", "memory": "256Mi"}
    assert sidecar["resources"] == {"requests": small, "limits": small}
    assert "ports" not in sidecar and "volumeMounts" not in sidecar
    assert pod["spec"]["restartPolicy"] == "OnFailure"  # the controller's: the pod still completes
    assert pod["spec"]["serviceAccountName"] == "llama-8b-watch"
    assert "automountServiceAccountToken" not in pod["spec"]  # the watcher needs the token
    grace = ManifestConfig(name="x", entrypoint="t.py", not_ready_grace_s=2.5, nproc_per_node=4)
    assert watch_args(grace)[-4:] == ["--nproc-per-node", "4", "--not-ready-grace", "2.5"]


def test_the_watchers_rbac_objects_grant_reading_pods_workloads_and_nodes():
    objects = _objects("elastic-kueue")
    assert [o["kind"] for o in objects] == ["ConfigMap", *RBAC_KINDS, "Service", "Pod", "JobSet"]
    rbac = {o["kind"]: o for o in objects if o["kind"] in RBAC_KINDS}
    own, cluster = "llama-8b-watch", "hp-watch-team-a.llama-8b"
    for kind in ("ServiceAccount", "Role", "RoleBinding"):
        assert rbac[kind]["metadata"] == {"name": own, "namespace": "team-a", "labels": {"hp.dev/job": "llama-8b"}}
    for kind in ("ClusterRole", "ClusterRoleBinding"):  # cluster-scoped: no namespace
        assert rbac[kind]["metadata"] == {"name": cluster, "labels": {"hp.dev/job": "llama-8b", "hp.dev/namespace": "team-a"}}
    assert rbac["Role"]["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": READ},
                                     {"apiGroups": ["kueue.x-k8s.io"], "resources": ["workloads"], "verbs": READ}]
    assert rbac["ClusterRole"]["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": READ}]
    subjects = [{"kind": "ServiceAccount", "name": own, "namespace": "team-a"}]
    assert rbac["RoleBinding"]["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": own}
    assert rbac["ClusterRoleBinding"]["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                                     "name": cluster}
    assert rbac["RoleBinding"]["subjects"] == rbac["ClusterRoleBinding"]["subjects"] == subjects
    rbac["Role"]["rules"][0]["verbs"].append("delete")  # each object its own lists
    assert next(o for o in _objects("elastic-kueue") if o["kind"] == "Role")["rules"][0]["verbs"] == READ


def test_cluster_scoped_names_keep_jobs_apart():
    """Namespace team-a job x and namespace team job a-x: distinct ClusterRoles, each a DNS-1123 subdomain."""
    def cluster_role(namespace: str, name: str) -> str:
        cfg = ManifestConfig(name=name, entrypoint="t.py", namespace=namespace)
        return next(o for o in manifests(cfg) if o["kind"] == "ClusterRole")["metadata"]["name"]

    assert cluster_role("team-a", "x") != cluster_role("team", "a-x")
    longest = cluster_role("n" * 63, "j" * 40)
    assert len(longest) <= 253
    kubernetes_validate.validate({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
                                  "metadata": {"name": longest}, "rules": []}, "1.36.0", strict=True)


def test_no_watch_gives_no_sidecar_and_no_rbac(capsys):
    objects = _manifest_cli(capsys, "--name", "demo", "--no-watch")
    assert [o["kind"] for o in objects] == ["Service", "Pod", "JobSet"]
    pod = objects[1]
    assert "initContainers" not in pod["spec"] and "serviceAccountName" not in pod["spec"]
    assert all("watch" not in " ".join(c["command"]) for c in pod["spec"]["containers"])


def test_a_named_service_account_gets_the_sidecar_and_no_rbac(capsys):
    objects = _manifest_cli(capsys, "--name", "demo", "--service-account", "trainer", "--not-ready-grace", "30")
    assert [o["kind"] for o in objects] == ["Service", "Pod", "JobSet"]
    pod = objects[1]
    assert pod["spec"]["serviceAccountName"] == "trainer"
    assert pod["spec"]["initContainers"][0]["command"][-2:] == ["--not-ready-grace", "30"]
    worker = objects[2]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert worker["serviceAccountName"] == "trainer" and worker["automountServiceAccountToken"] is False


def test_the_cli_defaults_are_the_configs():
    args = cli.build_parser().parse_args(["k8s", "manifest", "--name", "demo", "train.py"])
    from hp.core.schedulers.k8s.cli import config_from_args

    cfg = config_from_args(args)
    assert (cfg.watch, cfg.not_ready_grace_s) == (True, 10.0) == (ManifestConfig.watch, ManifestConfig.not_ready_grace_s)


# --- the pods' shell wrapper, run for real with a stand-in `hp` ---------------------------------------------

FAKE_HP = """#!/bin/sh
echo "$@" > "$HP_ARGS_FILE"
trap 'echo term >> "$HP_ARGS_FILE"; exit "${HP_EXIT_ON_TERM:-0}"' TERM
[ -n "$HP_SLEEP" ] && { sleep "$HP_SLEEP" & wait; }
exit "${HP_EXIT:-0}"
"""


def _wrapper(tmp_path: Path, **env: str) -> subprocess.Popen:
    (tmp_path / "bin").mkdir(exist_ok=True)
    fake = tmp_path / "bin" / "hp"
    fake.write_text(FAKE_HP)
    fake.chmod(0o755)
    full = {"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "HP_ARGS_FILE": str(tmp_path / "args"), **env}
    return subprocess.Popen(["/bin/sh", "-c", WRAPPER, "hp-run", "--nnodes", "2:4", "train.py"], env=full,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_wrapper_computes_the_node_rank_and_passes_the_exit_code(tmp_path):
    p = _wrapper(tmp_path, HP_INDEX="1", HP_RANK_OFFSET="2", HP_EXIT="7")
    assert p.wait(timeout=10) == 7
    assert (tmp_path / "args").read_text().split() == ["run", "--node-rank", "3", "--nnodes", "2:4", "train.py"]


def test_wrapper_turns_a_clean_leave_after_sigterm_into_143(tmp_path):
    p = _wrapper(tmp_path, HP_INDEX="0", HP_RANK_OFFSET="0", HP_SLEEP="30", HP_EXIT_ON_TERM="0")
    deadline = time.monotonic() + 10
    while not (tmp_path / "args").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.1)  # the trap is set before hp starts; give the stand-in time to set its own
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=10) == 143
    assert (tmp_path / "args").read_text().splitlines()[-1] == "term"  # forwarded to hp run


def test_wrapper_without_an_index_refuses(tmp_path):
    p = _wrapper(tmp_path, HP_RANK_OFFSET="0")
    assert p.wait(timeout=10) != 0
    assert "HP_INDEX is not set" in p.stderr.read()
    assert not (tmp_path / "args").exists()
