"""A toy inference loop used by the process tests: compile, recompile, graph break, new shapes."""
import os
import sys

if os.environ.get("WITH_AGENT") == "1":
    import torch_watchdog.agent.auto  # noqa: F401  (the one import a server needs)

import torch

import torch_watchdog.agent


def f(x):
    x = x.relu()
    print("", end="")  # graph break
    return x + 1


def main() -> int:
    model = torch.compile(f, dynamic=False, backend="eager")
    if os.environ.get("WITH_AGENT") == "1":
        model = torch_watchdog.agent.watch(model, name="toy")
    # recompile_limit from 2.7; cache_size_limit (still an alias later) before
    limit = ("recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit")
             else "cache_size_limit")
    with torch._dynamo.config.patch(**{limit: 2}):
        for n in (3, 4, 5, 6, 3):
            out = model(torch.ones(n))
            assert torch.equal(out, torch.full((n,), 2.0))
    torch_watchdog.agent.uninstall()
    print("served", file=sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
