#!/usr/bin/env python3
"""Renders deploy/k8s with `kubectl kustomize` (offline) and checks the objects.

    k8s_test.py REPO_ROOT

Checks what would break gpufeedd on a node without any API server to tell: the probes and
their ports, the ports against the config's listen addresses, the socket directory shared by
the DaemonSet, its preStop drain and the example training Job, the labels and selectors the
PodMonitor and the DaemonSet agree on, and the ConfigMap the DaemonSet mounts. Exit 0 when
all holds, 1 with one line per problem.
"""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess
import sys
from typing import Dict, List, Optional

import yaml

NAME_LABEL = "app.kubernetes.io/name"
READINESS_SERVICE = "gpufeed.v1.Feed"
SOCKET_DIR = "/run/gpufeed"
CONFIG_DIR = "/etc/gpufeed"

problems: List[str] = []


def expect(condition: bool, message: str) -> bool:
    if not condition:
        problems.append(message)
    return condition


# DaemonConfig's repeated fields this test reads: a list, one value a line or [a, b].
REPEATED = ("admin_uids", "admin_gids", "allow_uids", "allow_gids")


def textproto_scalars(text: str) -> Dict[str, object]:
    """`field: value` lines of a flat text-format message (what DaemonConfig is): strings,
    integers, true/false, and lists for the REPEATED fields."""
    fields: Dict[str, object] = {}
    for line in text.splitlines():
        match = re.match(r'^\s*([a-z_][a-z0-9_]*)\s*:\s*("(?:[^"\\]|\\.)*"|[-0-9]+|true|false|'
                         r'\[[-0-9, ]*\])\s*(#.*)?$', line)
        if match:
            name, raw = match.group(1), match.group(2)
            if raw.startswith("["):
                value: object = [int(v) for v in raw[1:-1].split(",") if v.strip()]
            elif raw in ("true", "false"):
                value = raw == "true"
            else:
                value = raw[1:-1] if raw.startswith('"') else int(raw)
            if name in REPEATED:
                fields.setdefault(name, [])
                fields[name] += value if isinstance(value, list) else [value]
            else:
                fields[name] = value
        elif line.strip() and not line.strip().startswith("#"):
            problems.append(f"config line not understood by this test: {line!r}")
    return fields


def port_of(address: str) -> Optional[int]:
    match = re.fullmatch(r"(.*):(\d+)", address)
    return int(match.group(2)) if match else None


def quantity_bytes(q: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "K": 10**3, "M": 10**6,
             "G": 10**9, "T": 10**12}
    match = re.fullmatch(r"(\d+)([KMGT]i?)?", str(q))
    if not match:
        raise ValueError(f"memory quantity {q!r}")
    return int(match.group(1)) * units.get(match.group(2) or "", 1)


def by_name(items: List[dict]) -> Dict[str, dict]:
    return {item["name"]: item for item in items or []}


def project_version(root: pathlib.Path) -> str:
    match = re.search(r"project\(gpufeed VERSION ([0-9.]+)", (root / "CMakeLists.txt").read_text())
    return match.group(1) if match else "?"


def check_daemonset(ds: dict, configmaps: Dict[str, dict], version: str) -> dict:
    """Checks the DaemonSet; returns what the Job and PodMonitor must agree with."""
    meta, spec = ds["metadata"], ds["spec"]
    pod = spec["template"]["spec"]
    template_labels = spec["template"]["metadata"].get("labels", {})
    selector = spec["selector"].get("matchLabels", {})
    expect(selector.get(NAME_LABEL) == "gpufeedd",
           f"DaemonSet selector {selector} does not select {NAME_LABEL}: gpufeedd")
    expect(all(template_labels.get(k) == v for k, v in selector.items()),
           f"DaemonSet selector {selector} does not match its pod labels {template_labels}")
    expect(meta.get("labels", {}).get(NAME_LABEL) == "gpufeedd",
           f"DaemonSet has no label {NAME_LABEL}: gpufeedd")
    expect(spec.get("updateStrategy", {}).get("type") == "OnDelete",
           "DaemonSet updateStrategy is not OnDelete: an apply would restart daemons under "
           "running jobs")
    expect(pod.get("runtimeClassName") == "nvidia", "pod runtimeClassName is not nvidia")

    containers = by_name(pod["containers"])
    if not expect("gpufeedd" in containers, f"no container gpufeedd in {list(containers)}"):
        return {}
    c = containers["gpufeedd"]
    for labels in (meta.get("labels", {}), template_labels):
        label = labels.get("app.kubernetes.io/version")
        expect(label == version,
               f"label app.kubernetes.io/version {label} is not the project's version {version}")
    for container in pod["containers"] + pod.get("initContainers", []):
        expect(container["image"].endswith(":" + version),
               f"container {container['name']}: image {container['image']} is not the project's "
               f"version {version} (CMakeLists.txt)")
    env = {e["name"]: e.get("value") for e in c.get("env", [])}
    expect(env.get("NVIDIA_VISIBLE_DEVICES") == "all",
           f"NVIDIA_VISIBLE_DEVICES is {env.get('NVIDIA_VISIBLE_DEVICES')!r}, not 'all'")
    caps = set((env.get("NVIDIA_DRIVER_CAPABILITIES") or "").split(","))
    expect({"compute", "utility"} <= caps,
           f"NVIDIA_DRIVER_CAPABILITIES {caps} lacks compute or utility")
    expect("nvidia.com/gpu" not in c.get("resources", {}).get("limits", {}),
           "the daemon requests nvidia.com/gpu: it would take GPUs from the training pods")

    # The config: mounted from the generated ConfigMap, named by --config.
    volumes = by_name(pod["volumes"])
    mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
    config_arg = [a for a in c.get("args", []) + c.get("command", []) if a.startswith("--config=")]
    config: Dict[str, object] = {}
    if expect(len(config_arg) == 1, f"gpufeedd is not given one --config=: {config_arg}"):
        path = pathlib.PurePosixPath(config_arg[0].split("=", 1)[1])
        mount = mounts.get(str(path.parent))
        if expect(mount is not None, f"--config={path}: nothing mounted at {path.parent}"):
            volume = volumes[mount["name"]]
            cm_name = volume.get("configMap", {}).get("name")
            expect(mount.get("readOnly") is True, f"{path.parent} is not mounted read-only")
            if expect(cm_name in configmaps, f"volume {mount['name']} names ConfigMap {cm_name}, "
                                             f"which the kustomization does not make "
                                             f"({list(configmaps)})"):
                data = configmaps[cm_name].get("data", {})
                if expect(path.name in data, f"ConfigMap {cm_name} has no key {path.name}"):
                    config = textproto_scalars(data[path.name])
    expect(str(CONFIG_DIR) in mounts, f"no config mounted at {CONFIG_DIR}")

    # The socket directory: the host's /run/gpufeed, where the config's listen socket is.
    socket_mount = mounts.get(SOCKET_DIR)
    if expect(socket_mount is not None, f"nothing mounted at {SOCKET_DIR}"):
        host_path = volumes[socket_mount["name"]].get("hostPath", {})
        expect(host_path.get("path") == SOCKET_DIR,
               f"{SOCKET_DIR} is not the host's {SOCKET_DIR}: {host_path}")
        expect(not socket_mount.get("readOnly"), f"{SOCKET_DIR} is mounted read-only")
    listen = str(config.get("listen", "unix:///run/gpufeed/gpufeed.sock"))
    socket = listen[len("unix://"):] if listen.startswith("unix://") else None
    expect(socket is not None and str(pathlib.PurePosixPath(socket).parent) == SOCKET_DIR,
           f"config listen {listen!r} is not a socket in {SOCKET_DIR}")
    expect(config.get("mem_socket", "") == "",
           "config mem_socket is set: keep it beside listen, in the shared directory")

    # Ports: named, TCP, equal to the config's listen addresses on every interface.
    ports = {p.get("name"): p for p in c.get("ports", [])}
    for name, field in (("metrics", "metrics_listen"), ("health", "health_listen")):
        address = str(config.get(field, ""))
        if expect(name in ports, f"container has no port named {name!r}: {list(ports)}"):
            expect(ports[name].get("protocol", "TCP") == "TCP", f"port {name} is not TCP")
            expect(port_of(address) == ports[name]["containerPort"],
                   f"config {field} {address!r} is not containerPort {name} "
                   f"{ports[name]['containerPort']}")
            expect(address.startswith("0.0.0.0:") or address.startswith("[::]:"),
                   f"config {field} {address!r} does not listen on the pod's address")
    health_port = ports.get("health", {}).get("containerPort")
    metrics_port = ports.get("metrics", {}).get("containerPort")
    expect(health_port != metrics_port, "health and metrics share a port")

    # Probes: gRPC health on the health port; "" is liveness, gpufeed.v1.Feed readiness.
    for probe_name, service in (("livenessProbe", ""), ("startupProbe", ""),
                                ("readinessProbe", READINESS_SERVICE)):
        probe = c.get(probe_name)
        if expect(probe is not None and "grpc" in probe, f"{probe_name} is not a gRPC probe"):
            expect(probe["grpc"].get("port") == health_port,
                   f"{probe_name} port {probe['grpc'].get('port')} is not the health port "
                   f"{health_port}")
            expect(probe["grpc"].get("service", "") == service,
                   f"{probe_name} asks for service {probe['grpc'].get('service', '')!r}, "
                   f"not {service!r}")

    # preStop: drain on the config's socket, inside the grace period.
    command = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    grace = pod.get("terminationGracePeriodSeconds", 30)
    drain = command[1:] if command else []
    if expect(command[:1] == ["/usr/bin/gpufeedctl"] and "drain" in drain,
              f"preStop is not `gpufeedctl ... drain`: {command}"):
        expect(drain[:2] == ["--socket", socket],
               f"preStop drains socket {drain[:2]}, not {socket}")
        timeout = drain[drain.index("--timeout") + 1] if "--timeout" in drain else None
        match = re.fullmatch(r"(\d+)s", timeout or "")
        if expect(match is not None, f"preStop drain has no --timeout Ns: {command}"):
            expect(int(match.group(1)) < grace,
                   f"drain timeout {timeout} is not below terminationGracePeriodSeconds {grace}")

    # The gRPC socket is created under umask 0007 (0660: the trust boundary).
    expect(any("umask 0007" in part for part in c.get("command", [])),
           "gpufeedd is not started under umask 0007: its socket would be world-accessible")

    # Memory: the pinned staging pool fits under the limit, which equals the request.
    resources = c.get("resources", {})
    limit = resources.get("limits", {}).get("memory")
    request = resources.get("requests", {}).get("memory")
    if expect(limit is not None and request is not None, "no memory request and limit"):
        expect(quantity_bytes(limit) == quantity_bytes(request),
               f"memory request {request} differs from limit {limit} (pinned memory cannot be "
               "reclaimed)")
        staging = int(config.get("staging_bytes", 1 << 30))
        expect(staging + (2 << 30) <= quantity_bytes(limit),
               f"staging_bytes {staging} plus 2 GiB does not fit the memory limit {limit}")
    expect("cpu" in resources.get("requests", {}), "no CPU request")

    security = pod.get("securityContext", {})
    expect(security.get("runAsNonRoot") is True and security.get("runAsUser", 0) != 0,
           "the pod does not run as a non-root user")
    expect(not pod.get("hostNetwork"),
           "the DaemonSet uses hostNetwork: its 0.0.0.0 metrics and health ports would be the "
           "node's")

    # Admins by explicit uid only (docs/SECURITY.md section 1): a root pod is uid 0 on the
    # hostPath socket and any pod may choose the daemon's uid, so neither is an admin by
    # itself; the config names the daemon's uid, for the preStop drain, and nothing else.
    daemon_uid = security.get("runAsUser")
    expect(config.get("root_is_admin") is False,
           f"config root_is_admin is {config.get('root_is_admin', 'unset (true)')}: every root "
           "pod on the node would be an admin")
    expect(config.get("daemon_uid_is_admin") is False,
           f"config daemon_uid_is_admin is {config.get('daemon_uid_is_admin', 'unset (true)')}: "
           "name the daemon's uid in admin_uids instead")
    expect(config.get("admin_uids") == [daemon_uid],
           f"config admin_uids {config.get('admin_uids')} is not exactly the DaemonSet's "
           f"runAsUser [{daemon_uid}] (the preStop drain runs as it)")
    expect(not config.get("admin_gids"),
           f"config admin_gids {config.get('admin_gids')}: a pod joins any group it names in "
           "supplementalGroups")
    expect(daemon_uid != security.get("runAsGroup"),
           f"the daemon's uid {daemon_uid} equals its group, which training pods join")
    init = by_name(pod.get("initContainers", [])).get("socket-dir", {})
    expect(f"chown {daemon_uid}:{security.get('runAsGroup')} {SOCKET_DIR}"
           in " ".join(init.get("command", [])),
           f"the init container does not hand {SOCKET_DIR} to the daemon's uid and group "
           f"{daemon_uid}:{security.get('runAsGroup')} (clients trust its owner): "
           f"{init.get('command')}")
    expect(c.get("securityContext", {}).get("allowPrivilegeEscalation") is False,
           "gpufeedd may escalate privileges")
    datasets = [m["mountPath"] for m in c.get("volumeMounts", [])
                if "hostPath" in volumes[m["name"]] and m["mountPath"] != SOCKET_DIR]
    return {"selector": selector, "socket": socket, "gid": security.get("runAsGroup"),
            "uid": daemon_uid, "admin_uids": config.get("admin_uids", []),
            "admin_gids": config.get("admin_gids", []),
            "ports": ports, "datasets": {m: volumes[mounts[m]["name"]]["hostPath"]["path"]
                                         for m in datasets}}


def check_podmonitor(pm: dict, ds: dict) -> None:
    spec = pm["spec"]
    expect(spec.get("selector", {}).get("matchLabels") == ds["selector"],
           f"PodMonitor selects {spec.get('selector')}, the DaemonSet {ds['selector']}")
    endpoints = spec.get("podMetricsEndpoints", [])
    if expect(len(endpoints) == 1, f"PodMonitor has {len(endpoints)} endpoints, want 1"):
        ep = endpoints[0]
        expect(ep.get("port") in ds["ports"] and ep.get("port") == "metrics",
               f"PodMonitor scrapes port {ep.get('port')!r}, not the container port 'metrics'")
        expect(ep.get("path", "/metrics") == "/metrics", f"PodMonitor path {ep.get('path')}")
        expect(ep.get("honorLabels") is True,
               "PodMonitor does not honour labels: the consumers' `job` would become "
               "`exported_job` and the dashboard's job variable would be empty")


def check_job(job: dict, ds: dict) -> None:
    pod = job["spec"]["template"]["spec"]
    volumes = by_name(pod["volumes"])
    c = pod["containers"][0]
    mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
    socket_mount = mounts.get(SOCKET_DIR)
    if expect(socket_mount is not None, f"the Job does not mount {SOCKET_DIR}"):
        expect(volumes[socket_mount["name"]].get("hostPath", {}).get("path") == SOCKET_DIR,
               f"the Job's {SOCKET_DIR} is not the host's")
    env = {e["name"]: e.get("value") for e in c.get("env", [])}
    expect(env.get("GPUFEED_SOCKET") == ds["socket"],
           f"the Job's GPUFEED_SOCKET {env.get('GPUFEED_SOCKET')!r} is not the daemon's "
           f"{ds['socket']!r}")
    expect(ds["gid"] in pod.get("securityContext", {}).get("supplementalGroups", []),
           f"the Job is not in the daemon's group {ds['gid']}, which owns the sockets")
    # Not an admin: its own explicit non-root uid, neither the daemon's nor an admin's, and no
    # admin group (a uid the image chooses could be anything, root or the daemon's included).
    security = {**pod.get("securityContext", {}), **c.get("securityContext", {})}
    uid = security.get("runAsUser")
    expect(isinstance(uid, int) and uid != 0,
           f"the Job does not name a non-root runAsUser ({uid}): it would run as whatever the "
           "image says, root or the daemon's uid included")
    expect(security.get("runAsNonRoot") is True, "the Job does not set runAsNonRoot: true")
    expect(uid != ds["uid"], f"the Job runs as the daemon's uid {uid}")
    expect(uid not in ds["admin_uids"], f"the Job's uid {uid} is in admin_uids")
    groups = set(pod.get("securityContext", {}).get("supplementalGroups", []))
    groups.add(security.get("runAsGroup"))
    expect(not groups & set(ds["admin_gids"]),
           f"the Job is in admin group(s) {sorted(groups & set(ds['admin_gids']))}")
    for path, host in ds["datasets"].items():
        mount = mounts.get(path)
        expect(mount is not None and volumes[mount["name"]].get("hostPath", {}).get("path") == host,
               f"the Job does not see the datasets at {path} (host {host}) as the daemon does")
    command = c.get("command", []) + c.get("args", [])
    expect(command[:1] == ["torchrun"] and "--loader=gpufeed" in command,
           f"the Job does not run torchrun with --loader=gpufeed: {command}")
    nproc = [a.split("=", 1)[1] for a in command if a.startswith("--nproc_per_node=")]
    gpus = c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
    expect(nproc and str(gpus) == nproc[0],
           f"the Job runs {nproc} processes per node on {gpus} GPUs")
    expect(not pod.get("hostIPC") and not pod.get("hostPID"),
           "the example Job shares host namespaces, which the default (VMM) path does not need")


def main(argv: List[str]) -> int:
    root = pathlib.Path(argv[1]).resolve()
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        print("FAIL: kubectl not found (Debian package kubernetes-client; "
              "deploy/install-deps.sh installs it)")
        return 1
    run = subprocess.run([kubectl, "kustomize", str(root / "deploy/k8s")],
                         capture_output=True, text=True, timeout=60)
    if run.returncode != 0 or run.stderr.strip():
        print(f"FAIL: kubectl kustomize deploy/k8s: exit {run.returncode}\n{run.stderr}")
        return 1
    objects = [o for o in yaml.safe_load_all(run.stdout) if o]
    kinds: Dict[str, List[dict]] = {}
    for o in objects:
        kinds.setdefault(o["kind"], []).append(o)
        if o["kind"] != "Namespace":
            expect(o["metadata"].get("namespace") == "gpufeed",
                   f"{o['kind']} {o['metadata']['name']} is not in namespace gpufeed")
    for kind in ("Namespace", "ConfigMap", "DaemonSet", "PodMonitor"):
        expect(len(kinds.get(kind, [])) == 1,
               f"rendered {len(kinds.get(kind, []))} {kind} objects, want 1")
    if problems:
        return report()
    configmaps = {cm["metadata"]["name"]: cm for cm in kinds["ConfigMap"]}
    cm = kinds["ConfigMap"][0]
    source = (root / "deploy/k8s/gpufeedd.textproto").read_text(encoding="utf-8")
    expect(cm.get("data", {}).get("gpufeedd.textproto") == source,
           "the ConfigMap does not hold deploy/k8s/gpufeedd.textproto")
    expect(re.fullmatch(r"gpufeedd-config-[a-z0-9]+", cm["metadata"]["name"]) is not None,
           f"ConfigMap {cm['metadata']['name']} has no content hash suffix")
    ds = check_daemonset(kinds["DaemonSet"][0], configmaps, project_version(root))
    if ds:
        check_podmonitor(kinds["PodMonitor"][0], ds)
        job = yaml.safe_load((root / "deploy/k8s/examples/training-job.yaml").read_text())
        check_job(job, ds)
    return report(len(objects))


def report(count: int = 0) -> int:
    for p in problems:
        print("FAIL:", p)
    if not problems:
        print(f"ok: deploy/k8s renders {count} objects, consistent with each other and with "
              "examples/training-job.yaml")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
