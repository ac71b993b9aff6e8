"""The sandboxed ``python`` tool (issue 50, item 5): what an agent's or an environment's call gets back, and the
escapes a model's code might try through it — each contained and reported."""

import os
import socket
import threading

import pytest

from hyperrl.agents.mcp import Toolbox
from hyperrl.config.schema import ToolSource
from hyperrl.envs.tools import TOOLS
from hyperrl.registry import HyperparameterError

pytestmark = pytest.mark.xdist_group("sandbox")  # the sandbox's uids: one process limit each, kept apart


@pytest.fixture(scope="module")
def box():
    tb = Toolbox([{"name": "python", "args": {"wall_s": 4, "cpu_s": 2, "memory_mb": 256, "processes": 16}}])
    yield tb
    tb.close()


def test_the_tool_answers_what_the_code_prints_and_names_failures(box):
    assert box.call("python", {"code": "print(sum(range(10)))"}) == "45"
    assert box.call("python", '{"code": "print(1)\\nprint(2)"}') == "1\n2"  # arguments as the model's JSON text
    got = box.call("python", {"code": "raise ValueError('bad input')"})
    assert got.endswith("ValueError: bad input\n[error]")
    assert box.call("python", {"code": "x = 1"}) == "(no output)"
    assert box.call("python", {"code": "while True:\n    pass"}) == "[timeout]"
    assert box.call("python", {"code": "b = bytearray(1 << 30)"}).endswith("[memory]")
    long = box.call("python", {"code": "print('y' * 9000)"})
    assert long.startswith("y" * 4000) and long.endswith("[… 5000 more characters cut]")
    assert box.call("python", {"nope": 1}).startswith("error:")  # the schema is checked


def test_escapes_through_the_tool_are_contained(box, tmp_path):
    secret = tmp_path / "checkpoint.pt"
    secret.write_text("weights")
    got = box.call("python", {"code": f"print(open({str(secret)!r}).read())"})
    assert "FileNotFoundError" in got and "weights" not in got
    got = box.call("python", {"code": f"open({str(tmp_path / 'x')!r}, 'w').write('x')"})
    assert "[error]" in got and not (tmp_path / "x").exists()
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    accepted = []
    threading.Thread(target=lambda: accepted.append(server.accept()), daemon=True).start()
    got = box.call("python", {"code": f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2)"})
    assert "ConnectionRefusedError" in got and not accepted  # 127.0.0.1 inside is the sandbox's own
    server.close()
    got = box.call("python", {"code": f"import os, signal; os.kill({os.getpid()}, signal.SIGKILL)"})
    assert "ProcessLookupError" in got  # the trainer (this test) is not visible, let alone killable
    got = box.call("python", {"code": "import os\nwhile True:\n    os.fork()"})
    assert got.endswith("]")  # the fork bomb stopped at the process limit (an error or the deadline)
    assert box.call("python", {"code": "print('after')"}) == "after"  # and the next call runs


def test_tool_hyperparameters_are_checked():
    with pytest.raises(HyperparameterError, match="wall_seconds"):
        TOOLS.build("python", wall_seconds=3)
    with pytest.raises(ValueError, match=r"tools\[\].args: hyperparameters of a registered tool"):
        ToolSource(mcp=["python", "-m", "x"], args={"wall_s": 1})
