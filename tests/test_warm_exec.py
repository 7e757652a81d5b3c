"""fedcomp.clients.warm_exec: ClientApps forked from a zygote that preloaded modules."""

import json
import os
import sys
import time

import pytest

from fedcomp.clients import warm_exec

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="the warm SuperExec needs os.fork")


def _probe(request: dict) -> int:
    with open(request["out"], "w") as f:
        json.dump({"pid": os.getpid(), "ppid": os.getppid(), "n": request["n"],
                   "preloaded": "colorsys" in sys.modules}, f)
    return 0


def _wait(path, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.stat().st_size):
        assert time.monotonic() < deadline, f"{path} was not written"
        time.sleep(0.05)
    time.sleep(0.05)
    return json.loads(path.read_text())


def test_zygote_forks_one_child_per_request_with_the_preloaded_modules(tmp_path):
    zygote = warm_exec.Zygote(["colorsys"], target=_probe)
    try:
        outs = [tmp_path / f"{n}.json" for n in range(3)]
        for n, out in enumerate(outs):
            zygote.launch({"out": str(out), "n": n})
        seen = [_wait(out) for out in outs]
    finally:
        zygote.close()
    assert [s["n"] for s in seen] == [0, 1, 2]
    assert all(s["ppid"] == zygote.pid for s in seen)  # forked by the zygote, not by us
    assert len({s["pid"] for s in seen} | {zygote.pid, os.getpid()}) == 5
    assert all(s["preloaded"] for s in seen)


def test_close_ends_the_zygote(tmp_path):
    zygote = warm_exec.Zygote([], target=_probe)
    zygote.close()
    with pytest.raises(ProcessLookupError):
        os.kill(zygote.pid, 0)
    zygote.close()  # twice is fine


def test_bad_preload_is_named(capsys):
    with pytest.raises(SystemExit):
        warm_exec.main(["--insecure", "--runtime-api-address", "127.0.0.1:1", "--preload", "no_such_module_xyz"])
    assert "no_such_module_xyz" in capsys.readouterr().err


def test_bad_pull_interval_is_named(capsys):
    with pytest.raises(SystemExit):
        warm_exec.main(["--insecure", "--runtime-api-address", "127.0.0.1:1", "--pull-interval", "-1"])
    assert "--pull-interval -1.0" in capsys.readouterr().err
    with pytest.raises(ValueError, match="-0.5"):
        warm_exec.steady_pulls(-0.5)


def test_steady_pulls_retry_at_the_interval_within_flowers_time_limit(monkeypatch):
    from flwr.supercore.constant import PULL_MAX_TIME
    from flwr.supernode.runtime import run_clientapp as module

    flowers = module.pull_and_inflate_object_from_tree
    calls = []
    monkeypatch.setattr(module, "pull_and_inflate_object_from_tree", lambda *a, **k: calls.append(k))
    warm_exec.steady_pulls(0)  # Flower's backoff: untouched
    module.pull_and_inflate_object_from_tree("tree", "pull", "confirm")
    assert calls == [{}]
    warm_exec.steady_pulls(0.1)
    warm_exec.steady_pulls(0.2)  # again: wraps Flower's function, not the previous wrapper
    module.pull_and_inflate_object_from_tree("tree", "pull", "confirm", return_type=int)
    assert calls[1] == {"initial_backoff": 0.2, "backoff_cap": 0.2, "max_tries_per_object": int(PULL_MAX_TIME / 0.2) + 1,
                        "return_type": int}
    assert flowers is not module.pull_and_inflate_object_from_tree


@pytest.mark.slow
def test_warm_deployment_runs_flower_clientapps(tmp_path):
    from fedcomp.simulations import deploy

    nodes, rounds = 2, 2
    with deploy.deployment(tmp_path / "deploy", nodes, isolation="warm") as dep:
        run = deploy.run_app(dep, f"num-server-rounds={rounds}", tmp_path / "run", timeout=300)
        assert run.ok, run.log[-3000:]
        assert len(run.results["rounds"]) == rounds
        assert run.results["rounds"][-1]["accuracy"] > 0.2
        # one ClientApp process per message, each a fork of its node's zygote (named as Flower's)
        assert run.clientapps["processes"] == rounds * nodes, run.clientapps
        superexecs = [p for p in dep.extra if p.name.endswith("-superexec")]
        assert len(superexecs) == nodes
        assert all("fedcomp.clients.warm_exec" in " ".join(p.popen.args) for p in superexecs)
        # each node's state lives in its own file (written before the reply), not in the pushed Context
        files = sorted((tmp_path / "deploy").glob("supernode-*-home/fedcomp-state/run-*/node-*.pt"))
        assert len(files) == nodes, files
        # deploy's SuperNodes (fedcomp.clients.supernode) time their link: measured budgets read it,
        # a reply's push with the node's next reply
        measured = deploy.run_app(dep, "num-server-rounds=3 link-profile='measured' round-deadline-s=600.0 "
                                       "upload=\"topk(ratio=0.01,index='fixed')+qsgd(bits=4)\"",
                                  tmp_path / "measured", timeout=300)
        assert measured.ok, measured.log[-3000:]
        from test_deploy import _check_estimates

        _check_estimates(measured, 3)
        link_files = sorted((tmp_path / "deploy").glob("supernode-*-home/fedcomp-state/links/node-*.json"))
        assert len(link_files) == nodes, link_files
