"""Checks the compose model (compose-loader's JSON, on stdin) against
scripts/stack and the configuration's defaults, for scripts/compose-check.

    check_stack.py REPO_DIR KAFKA_VERSION STACK_ENV_FILE < model.json

STACK_ENV_FILE is `scripts/stack env --plain` with none of its settings
in the environment: the defaults a developer gets. Prints one line per
check; exits 1 after listing every failure.
"""

import json
import pathlib
import re
import sys
import urllib.parse

repo = pathlib.Path(sys.argv[1])
kafka_version = sys.argv[2]
stack_env = dict(
    line.split("=", 1) for line in pathlib.Path(sys.argv[3]).read_text().splitlines() if "=" in line
)
model = json.load(sys.stdin)
services = model["services"]
stack_text = (repo / "scripts/stack").read_text()

failures = []
passed = 0


def check(ok, what):
    global passed
    print(("ok    " if ok else "FAIL  ") + what)
    if ok:
        passed += 1
    else:
        failures.append(what)


def env(service):
    return services[service].get("environment") or {}


def published(service, target):
    return [
        p for p in services[service].get("ports") or [] if int(p["target"]) == target
    ]


ONE_SHOTS = {"migrate", "admin-tls", "keys"}
LONG_RUNNING = {"kafka", "postgres", "ductor", "worker", "prometheus", "grafana"}

# --- the services, and how each is run -------------------------------------
check(set(services) == ONE_SHOTS | LONG_RUNNING,
      f"services are {sorted(ONE_SHOTS | LONG_RUNNING)} (found {sorted(services)})")
for name in sorted(set(services) & LONG_RUNNING):
    hc = services[name].get("healthcheck") or {}
    check(bool(hc.get("test")) and not hc.get("disable"), f"{name} has a healthcheck")
    check(services[name].get("restart") == "unless-stopped", f"{name} restarts unless stopped")
for name in sorted(set(services) & ONE_SHOTS):
    check(services[name].get("restart") == "no", f"{name} is a one-shot (restart: \"no\")")

# Every dependency waits for the state that makes its dependant work: a
# one-shot's success, a long-running service's health.
EXPECTED_DEPENDS = {
    "migrate": {"kafka", "postgres"},
    "admin-tls": set(),
    "ductor": {"kafka", "postgres", "migrate", "admin-tls"},
    "worker": {"kafka", "migrate"},
    "keys": {"migrate", "admin-tls"},
    "prometheus": {"ductor", "keys"},
    "grafana": {"prometheus"},
}
for name, deps in EXPECTED_DEPENDS.items():
    if name not in services:
        continue
    got = services[name].get("depends_on") or {}
    check(set(got) == deps, f"{name} depends on {sorted(deps)} (found {sorted(got)})")
    for dep, how in got.items():
        want = "service_completed_successfully" if dep in ONE_SHOTS else "service_healthy"
        check(how.get("condition") == want, f"{name} waits for {dep}: {want}")

# --- Kafka: the version and the ports of scripts/stack ----------------------
check(services["kafka"].get("image") == f"apache/kafka:{kafka_version}",
      f"kafka image is apache/kafka:{kafka_version}, the version of scripts/stack "
      f"(found {services['kafka'].get('image')})")
stack_kafka_host, stack_kafka_port = stack_env["KAFKA_BOOTSTRAP_SERVERS"].rsplit(":", 1)
ports = published("kafka", 9092)
check(len(ports) == 1 and ports[0].get("host_ip") == stack_kafka_host
      and ports[0].get("published") == stack_kafka_port,
      f"kafka's client listener is published on {stack_kafka_host}:{stack_kafka_port}, "
      f"scripts/stack's (found {ports})")
kenv = env("kafka")
advertised = dict(
    item.split("://", 1) for item in kenv.get("KAFKA_ADVERTISED_LISTENERS", "").split(",") if item
)
check(advertised.get("EXTERNAL") == stack_env["KAFKA_BOOTSTRAP_SERVERS"],
      f"kafka advertises EXTERNAL://{stack_env['KAFKA_BOOTSTRAP_SERVERS']} (found {advertised})")
controller = re.search(r"KAFKA_CONTROLLER_PORT:-(\d+)", stack_text).group(1)
check(kenv.get("KAFKA_CONTROLLER_QUORUM_VOTERS") == f"1@kafka:{controller}",
      f"kafka's controller listens on {controller}, as in scripts/stack")
internal = advertised.get("INTERNAL", "")
for name in ("migrate", "ductor", "worker"):
    check(env(name).get("KAFKA_BOOTSTRAP_SERVERS") == internal,
          f"{name} reaches Kafka on its INTERNAL listener {internal}")

# The broker settings scripts/stack writes (server.properties) that the
# compose file sets too must agree; these must be set.
stack_props = dict(
    re.findall(r"^([a-z][a-z0-9.]*)=([^$\n]*)$", stack_text, flags=re.MULTILINE)
)
REQUIRED = {"num.partitions", "auto.create.topics.enable", "group.initial.rebalance.delay.ms",
            "default.replication.factor", "min.insync.replicas", "offsets.topic.num.partitions",
            "transaction.state.log.num.partitions"}
# The listeners differ by design (the compose broker has one for the
# containers and one for the host, scripts/stack's has the SASL ones of
# the tests); their ports are checked above.
LISTENER_PROPS = {"listeners", "advertised.listeners", "listener.security.protocol.map",
                  "inter.broker.listener.name", "controller.quorum.bootstrap.servers"}
for prop, value in sorted(stack_props.items()):
    key = "KAFKA_" + prop.upper().replace(".", "_")
    if prop in LISTENER_PROPS:
        continue
    if key in kenv or prop in REQUIRED:
        check(kenv.get(key) == value, f"kafka {prop}={value} as in scripts/stack (found {kenv.get(key)})")

# --- Postgres: the major version, the port, the sizing, the roles -----------
pg_major = re.search(r"^PG_BIN=/usr/lib/postgresql/(\d+)/bin$", stack_text, re.MULTILINE).group(1)
check(services["postgres"].get("image") == f"postgres:{pg_major}",
      f"postgres image is postgres:{pg_major}, scripts/stack's PostgreSQL")
stack_db = urllib.parse.urlsplit(stack_env["DATABASE_URL"])
ports = published("postgres", 5432)
check(len(ports) == 1 and ports[0].get("host_ip") == stack_db.hostname
      and ports[0].get("published") == str(stack_db.port),
      f"postgres is published on {stack_db.hostname}:{stack_db.port}, scripts/stack's (found {ports})")
command = services["postgres"].get("command") or []
settings = [command[i + 1] for i, arg in enumerate(command[:-1]) if arg == "-c"]
for setting in settings:
    name, value = setting.split("=", 1)
    stack_value = re.search(rf"^{re.escape(name)} = (\S+)$", stack_text, re.MULTILINE)
    check(stack_value is not None and stack_value.group(1) == value,
          f"postgres {name}={value} as in scripts/stack")

# Each role's URL: scripts/stack's user, password and database, on the
# compose network's postgres.
for name, svc in sorted(services.items()):
    for var, url in sorted(env(name).items()):
        if not var.startswith("DATABASE_") or not var.endswith("URL"):
            continue
        got, want = urllib.parse.urlsplit(url), urllib.parse.urlsplit(stack_env.get(var, ""))
        check((got.username, got.password, got.path) == (want.username, want.password, want.path)
              and (got.hostname, got.port) == ("postgres", 5432),
              f"{name} {var} is scripts/stack's role {want.username} on postgres:5432{want.path}")

# Least privilege: each Ductor process gets the roles it needs and no other.
ROLES = {
    "migrate": {"DATABASE_URL", "DATABASE_MIGRATE_URL", "DATABASE_KEYS_URL"},
    "ductor": {"DATABASE_URL"},
    "keys": {"DATABASE_KEYS_URL"},
    "worker": set(),
    "admin-tls": set(),
}
for name, want in ROLES.items():
    got = {v for v in env(name) if v.startswith("DATABASE_")}
    check(got == want, f"{name} has the database URLs {sorted(want)} only (found {sorted(got)})")

# --- Ductor's listeners ------------------------------------------------------
default_toml = (repo / "config/default.toml").read_text()
listen_port = re.search(r'^listen = "[^"]*:(\d+)"$', default_toml, re.MULTILINE).group(1)
ports = published("ductor", 8080)
check(len(ports) == 1 and ports[0].get("host_ip") == "127.0.0.1"
      and ports[0].get("published") == listen_port,
      f"serve's API is published on 127.0.0.1:{listen_port}, server.listen's default port")
check(not published("ductor", 9464), "serve's admin listener is not published on the host")

# --- every file a service mounts from the repository exists -----------------
for name, svc in sorted(services.items()):
    for vol in svc.get("volumes") or []:
        if vol.get("type") == "bind":
            source = pathlib.Path(vol["source"])
            check(source.exists(), f"{name} mounts {source.relative_to(repo) if source.is_relative_to(repo) else source}, which exists")

if failures:
    print(f"{len(failures)} of {passed + len(failures)} checks failed", file=sys.stderr)
    sys.exit(1)
print(f"all {passed} checks passed")
