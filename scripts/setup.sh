#!/usr/bin/env bash
# Create .venv at the repository root and install all five hp distributions editable, with tests.
# Idempotent: re-running only installs what changed.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
# On this project's CI and dev machines pip finds a local CPU wheel of torch 2.13.0; elsewhere
# set HP_TORCH (e.g. HP_TORCH="torch==2.13.0" from PyTorch's CUDA index) before running.
HP_TORCH=${HP_TORCH:-torch==2.13.0}

# hp-chaos's multi-node tests put each "node" in a network namespace (ip, iptables, nsenter); only
# root can use them, so only root installs them, once.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null \
    && ! { command -v ip && command -v iptables && command -v nsenter; } >/dev/null 2>&1; then
    apt-get install -y -qq iproute2 iptables util-linux >/dev/null 2>&1 \
        || { apt-get update -qq && apt-get install -y -qq iproute2 iptables util-linux >/dev/null; }
fi

# The `etcd` store backend's tests and `hp bench init` run a real etcd (Debian's etcd-server; etcdctl
# from etcd-client for people). Installing the package must not leave a system etcd running: the
# tests start their own on free ports.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! command -v etcd >/dev/null 2>&1; then
    apt-get install -y -qq etcd-server etcd-client >/dev/null 2>&1 \
        || { apt-get update -qq && apt-get install -y -qq etcd-server etcd-client >/dev/null; }
    { command -v systemctl && systemctl disable --now etcd; } >/dev/null 2>&1 || true
fi

# The `slurm` scheduler backend's tests run a real Slurm (hp.chaos.clusters.slurm: munged, slurmctld and a
# slurmd per fake node, on free ports, in a private directory); the QOS quota tests add accounting
# (hp.chaos.clusters.slurm_accounting: a private MariaDB and slurmdbd). No system daemon is left running.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null \
        && { ! command -v slurmctld || ! command -v slurmdbd || ! command -v mariadbd; } >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq slurm-wlm munge slurmdbd mariadb-server >/dev/null 2>&1 \
        || { apt-get update -qq && apt-get install -y -qq slurm-wlm munge slurmdbd mariadb-server >/dev/null; }
    { command -v systemctl && systemctl disable --now munge slurmd slurmctld slurmdbd mariadb; } >/dev/null 2>&1 || true
fi

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -qq --upgrade "pip>=24" "setuptools>=69" wheel
.venv/bin/python -m pip install -qq "$HP_TORCH"
.venv/bin/python -m pip install -qq \
    -e "packages/hp-core[test,etcd,kubernetes]" \
    -e "packages/hp-elastic[test,plot]" \
    -e "packages/hp-checkpointless[test,tiered]" \
    -e "packages/hp-tiered-ckpt[test]" \
    -e "packages/hp-chaos[test,torchft]"
# hp-chaos[nvrx] (hp bench recovery's NVRx variants), its wheel without its dependencies and then the ones
# it uses: its `pynvml` requirement is a deprecated shim over nvidia-ml-py that makes every `import torch`
# print a FutureWarning; nvidia-ml-py provides the same `pynvml` module. Its torch requirement (>=2.3)
# is met by the CPU torch above, which stays.
.venv/bin/python -m pip install -qq --no-deps "nvidia-resiliency-ext==0.4.1"
.venv/bin/python -m pip install -qq "nvidia-ml-py>=12.570.86" "psutil>=6.0.0" defusedxml packaging pyyaml
.venv/bin/python -m pip uninstall -qq -y pynvml 2>/dev/null || true  # left by an earlier plain install
.venv/bin/python -m pip install -qq -r docs/requirements.txt  # the documentation site (mkdocs.yml; integration/test_docs.py)
echo "setup: .venv ready ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
