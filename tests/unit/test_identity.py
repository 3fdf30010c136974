"""Which server a process belongs to: an explicit name (checked), a torch.distributed job,
its systemd service from /proc/self/cgroup, else its process group, with its GPU set."""
import pytest

from torch_watchdog.agent.identity import check_name, server_name, unit_from_cgroup, warm_name

CENTOS7_V1 = """11:cpuset:/
10:memory:/system.slice/tritonserver.service
9:devices:/system.slice/tritonserver.service
4:cpu,cpuacct:/system.slice/tritonserver.service
1:name=systemd:/system.slice/tritonserver.service
"""

# (what /proc/self/cgroup holds, the service it names)
CASES = [
    ("0::/system.slice/vllm.service\n", "vllm.service"),
    ("0::/system.slice/system-llm.slice/llm@3.service\n", "llm@3.service"),  # a template's instance
    ("0::/system.slice/llm.service/payload\n", "llm.service"),  # Delegate=yes sub-group
    (CENTOS7_V1, "tritonserver.service"),
    # hybrid host: systemd's tree on the name=systemd line, the unified one unused
    ("1:name=systemd:/system.slice/llm.service\n0::/\n", "llm.service"),
    ("0::/system.slice/llm.service\n1:name=systemd:/system.slice/llm.service\n", "llm.service"),
    # user units, not the user manager around them
    ("0::/user.slice/user-1000.slice/user@1000.service/app.slice/llm.service\n", "llm.service"),
    ("0::/user.slice/user-1000.slice/user@1000.service/init.scope\n", None),
    ("0::/user.slice/user-1000.slice/user@1000.service/app.slice/"
     "app-org.gnome.Terminal.slice/vte-spawn-0c1d2e3f.scope\n", None),
    ("0::/user.slice/user-1000.slice/session-3.scope\n", None),  # a login shell
    ("0::/init.scope\n", None),
    # containers: a private cgroup namespace, the host's view, docker and kubernetes drivers
    ("0::/\n", None),
    ("0::/system.slice/docker-3f1a9b2c4d5e.scope\n", None),
    ("12:memory:/docker/3f1a9b2c4d5e\n1:name=systemd:/docker/3f1a9b2c4d5e\n", None),
    ("0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1b2c.slice/"
     "cri-containerd-9e8f7a6b.scope\n", None),
    ("11:memory:/kubepods/burstable/pod1b2c3d4e/9e8f7a6b\n"
     "1:name=systemd:/kubepods/burstable/pod1b2c3d4e/9e8f7a6b\n", None),
    ("9:name=systemd:/\n4:memory:/process_api/cf9314\n0::/\n", None),  # a sandbox's
    ("", None),
    ("garbage without fields\n", None),
    ("0::/system.slice/.service\n", None),
]


@pytest.mark.parametrize("text, unit", CASES)
def test_the_innermost_systemd_service_names_the_server(text, unit):
    assert unit_from_cgroup(text) == unit


def _read(text):
    return lambda: text


SERVICE = "0::/system.slice/llm.service\n"
SESSION = "0::/user.slice/user-1000.slice/session-3.scope\n"
TORCHRUN = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "9f1c"}

# (cgroup, environment, process group, the name): what a process says in its hello
RULE = [
    (SERVICE, {}, 42, "llm.service"),
    (SESSION, {}, 42, "pgid:42"),
    # replicas under one supervisor, one GPU each: one server per GPU set
    (SESSION, {"CUDA_VISIBLE_DEVICES": "0"}, 42, "pgid:42/cuda:0"),
    (SESSION, {"CUDA_VISIBLE_DEVICES": "2,3"}, 42, "pgid:42/cuda:2,3"),
    (SESSION, {"CUDA_VISIBLE_DEVICES": " 1 "}, 42, "pgid:42/cuda:1"),
    (SESSION, {"CUDA_VISIBLE_DEVICES": ""}, 42, "pgid:42"),
    (SERVICE, {"CUDA_VISIBLE_DEVICES": "7"}, 42, "llm.service/cuda:7"),  # 8 in one unit
    (SESSION, {"CUDA_VISIBLE_DEVICES": ",".join(f"GPU-{i:036d}" for i in range(8))}, 42,
     "pgid:42/cuda:sha1-"),
    # the ranks of a torch.distributed job: one server, whatever their sessions and GPUs
    (SESSION, TORCHRUN, 20038, "dist:127.0.0.1:29500"),
    (SESSION, dict(TORCHRUN, RANK="0", CUDA_VISIBLE_DEVICES="0"), 20039, "dist:127.0.0.1:29500"),
    (SESSION, {"WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "job-7"}, 5, "torchrun:job-7"),
    (SERVICE, TORCHRUN, 20038, "llm.service"),  # the service: what a restart takes
    # a world of one, or variables that name no job, are no job
    (SESSION, dict(TORCHRUN, WORLD_SIZE="1"), 42, "pgid:42"),
    (SESSION, dict(TORCHRUN, WORLD_SIZE="two"), 42, "pgid:42"),
    (SESSION, {"WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "none"}, 42, "pgid:42"),
]


@pytest.mark.parametrize("cgroup, env, pgid, name", RULE)
def test_the_default_server_name(cgroup, env, pgid, name):
    got = server_name(None, env=env, read_cgroup=_read(cgroup), getpgid=lambda pid: pgid)
    assert got.startswith(name) if name.endswith("sha1-") else got == name
    assert check_name(got) == got


def test_an_explicit_name_wins():
    assert server_name("replica-3", env=TORCHRUN, read_cgroup=_read(SERVICE),
                       getpgid=lambda pid: 42) == "replica-3"


def test_no_proc_falls_back_to_the_process_group():
    def missing():
        raise FileNotFoundError("/proc/self/cgroup")

    assert server_name(None, env={}, read_cgroup=missing, getpgid=lambda pid: 7) == "pgid:7"


@pytest.mark.parametrize("server, explicit, name", [
    ("llm-a", "llm-a", "llm-a"),
    ("llm.service/cuda:3", None, "llm.service"),   # 8 replicas, one bundle
    ("pgid:42/cuda:3", None, "server.py"),
    ("dist:127.0.0.1:29500", None, "server.py"),
])
def test_the_warm_bundle_is_named_by_what_stays_across_starts_and_replicas(server, explicit,
                                                                           name):
    assert warm_name(server, explicit, "/srv/server.py") == name


@pytest.mark.parametrize("name", ["llm-a", "vllm@3.service", "replica 3", "x" * 255, "lämma"])
def test_good_names_pass(name):
    assert check_name(name) == name


@pytest.mark.parametrize("name", ["", "   ", "a\nb", "tab\there", "x" * 256, " lead",
                                  "trail ", "nul\x00", 123])
def test_bad_names_are_refused_with_the_reason(name):
    with pytest.raises(ValueError, match="server"):
        check_name(name)
