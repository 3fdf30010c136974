"""Which server a process belongs to: its systemd service from /proc/self/cgroup, else its
process group; an explicit name is checked."""
import pytest

from torch_watchdog.agent.identity import check_name, server_name, unit_from_cgroup

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


def test_a_service_is_the_server_else_the_process_group():
    def read(text):
        return lambda: text

    assert server_name(None, read_cgroup=read("0::/system.slice/llm.service\n"),
                       getpgid=lambda pid: 42) == "llm.service"
    assert server_name(None, read_cgroup=read("0::/user.slice/user-1000.slice/session-3.scope"),
                       getpgid=lambda pid: 42) == "pgid:42"
    assert server_name("replica-3", read_cgroup=read("0::/system.slice/llm.service\n"),
                       getpgid=lambda pid: 42) == "replica-3"


def test_no_proc_falls_back_to_the_process_group():
    def missing():
        raise FileNotFoundError("/proc/self/cgroup")

    assert server_name(None, read_cgroup=missing, getpgid=lambda pid: 7) == "pgid:7"


@pytest.mark.parametrize("name", ["llm-a", "vllm@3.service", "replica 3", "x" * 255, "lämma"])
def test_good_names_pass(name):
    assert check_name(name) == name


@pytest.mark.parametrize("name", ["", "   ", "a\nb", "tab\there", "x" * 256, " lead",
                                  "trail ", "nul\x00", 123])
def test_bad_names_are_refused_with_the_reason(name):
    with pytest.raises(ValueError, match="server"):
        check_name(name)
