"""Remote rewards (issue 50, item 3) against a real local HTTP server process: hyperrl's JSON contract and
OpenRLHF's, batched; a slow, a failing, a dying and a garbling server; an address nothing answers."""

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from hyperrl.config.schema import RewardSpec
from hyperrl.data import Sample
from hyperrl.rewards import RewardError, build_rewards, check_rewards

SERVER = Path(__file__).with_name("reward_server.py")


@pytest.fixture
def server(tmp_path):
    procs = []

    def start(mode: str = "ok") -> tuple[str, subprocess.Popen]:
        port_file = tmp_path / f"port-{len(procs)}"
        p = subprocess.Popen([sys.executable, str(SERVER), str(port_file), "--mode", mode])
        procs.append(p)
        deadline = time.time() + 20
        while not port_file.exists():
            assert time.time() < deadline and p.poll() is None, "the reward server did not start"
            time.sleep(0.05)
        return f"http://127.0.0.1:{port_file.read_text()}", p

    yield start
    for p in procs:
        p.kill()
        p.wait()


def _sizes(base: str) -> list[int]:
    with urllib.request.urlopen(base + "/stats") as r:
        return json.loads(r.read())["sizes"]


ROWS = [Sample("1+2=", "3", "a", {}), Sample("2+2=", "4", "b", {}), Sample("3+3=", "6", "c", {})] * 3
TEXTS = ["3", "5", "6", "3", "4", "0", "3", "4", "6"]  # rows 0, 2, 3, 4, 6, 7, 8 right
WANT = [1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0]


def _score(rs, texts=TEXTS, rows=ROWS):
    return rs.score([s.prompt for s in rows], texts, [[1]] * len(texts), rows)


def test_hyperrl_contract_in_batches_and_concurrently(server):
    base, _ = server()
    rs = build_rewards([RewardSpec(url=base + "/score", batch=4, workers=2, name="judge")])
    comps, app, _ = _score(rs)
    assert comps[:, 0].tolist() == WANT and app.all()
    assert sorted(_sizes(base)) == [1, 4, 4]  # 9 rows in requests of at most 4
    rs.close()


def test_openrlhf_contract_works_with_its_server_unchanged(server):
    base, _ = server()
    rs = build_rewards([RewardSpec(url=base + "/get_reward", style="openrlhf")])
    comps, _, _ = _score(rs)
    # query = prompt + completion, label = answer: "1+2=3".endswith("3")
    assert comps[:, 0].tolist() == WANT and _sizes(base) == [9]


def test_a_slow_server_is_overlapped_by_workers_and_stopped_by_the_deadline(server):
    base, _ = server("slow")
    rs = build_rewards([RewardSpec(url=base + "/score", batch=1, workers=9)])
    t0 = time.perf_counter()
    assert _score(rs)[0][:, 0].tolist() == WANT
    assert time.perf_counter() - t0 < 9 * 0.5 * 0.6  # serially 4.5 s; 9 at once ≈ 0.5 s
    rs.close()
    rs = build_rewards([RewardSpec(url=base + "/score", timeout_s=0.2)])
    with pytest.raises(RewardError, match=r"reward 'remote' did not return within rewards\[\].timeout_s=0.2 s; it "
                                          r"was stopped \(one call on 9 rows\)"):
        _score(rs)


def test_a_failing_server_is_retried_and_counted(server):
    base, _ = server("flaky")
    rs = build_rewards([RewardSpec(url=base + "/score", retries=3)])
    comps, _, m = _score(rs)
    assert comps[:, 0].tolist() == WANT and m["reward_remote_retries"] == 2.0
    base, _ = server("flaky")
    rs = build_rewards([RewardSpec(url=base + "/score")])
    with pytest.raises(RewardError, match=r"http://127.0.0.1:\d+/score answered HTTP 503: .*warming up"):
        _score(rs)


def test_a_dying_server_and_an_address_nothing_answers_are_named_after_the_retries(server, tmp_path):
    base, proc = server("die")
    rs = build_rewards([RewardSpec(url=base + "/score", batch=3, retries=2)])
    t0 = time.perf_counter()
    with pytest.raises(RewardError, match=rf"reward 'remote' raised RemoteRewardError: {base}/score did not answer"):
        _score(rs)  # the third request kills it; its retries find nobody
    assert proc.wait(timeout=5) == 1 and time.perf_counter() - t0 < 10
    rs = build_rewards([RewardSpec(url=base + "/score", on_error="abstain", retries=1)])
    with pytest.warns(RuntimeWarning, match=r"did not answer.*on_error: abstain"):
        comps, app, m = _score(rs)
    assert not app.any() and m["reward_remote_failed"] == 9.0 and m["reward_remote_retries"] == 1.0


def test_a_garbling_server_and_bad_urls_are_named(server):
    base, _ = server("garbage")
    rs = build_rewards([RewardSpec(url=base + "/score")])
    with pytest.raises(RewardError, match=r"answered \{'rewards': .*expected \{\"rewards\": \[...\]\} with 9 values"):
        _score(rs)
    with pytest.raises(RewardError, match=r"'ftp://x' is not an http\(s\) URL"):
        build_rewards([RewardSpec(url="ftp://x")])
    with pytest.raises(RewardError, match=r"rewards\[0\].style: a url reward's style is its server's contract, one "
                                          r"of \['hyperrl', 'openrlhf'\] \(got 'verl'\)"):
        check_rewards([RewardSpec(url="http://127.0.0.1:1/x", style="verl")])
    with pytest.raises(ValueError, match="a reward needs one of fn .* and judge .*; it has fn and url"):
        RewardSpec(fn="exact_answer", url="http://127.0.0.1:1/x")
