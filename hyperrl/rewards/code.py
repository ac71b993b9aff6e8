"""The ``code`` reward: a completion's program run against the row's unit tests in the sandbox
(:mod:`hyperrl.sandbox`), scored by the fraction of tests passed (or 1.0 only when all pass).

Tests come in the formats code-RL datasets use (verl's and TRL's rows): a list of Python statements — asserts,
``assert f(2) == 7`` (MBPP / HumanEval style: all run in one process after the program, each in its own ``try``) —
or stdin/stdout pairs, ``{"inputs": [...], "outputs": [...]}`` (APPS / verl's ``input_output``, possibly a JSON
string: the program runs once per pair with the input on stdin, its stdout compared line by line with trailing
whitespace ignored). The program is the completion's last fenced code block (```` ```python … ``` ````), else the
whole completion.

Known limit (shared with verl's sandbox-fusion and every harness that runs tests beside the program): the program
runs with the harness's privileges, so one that forges the harness's report (prints its marker, exits 0 early) is
not told apart; the sandbox keeps it from harming anything else.
"""

from __future__ import annotations

import json
import re

from hyperrl.rewards.builtin import register_reward, register_reward_factory
from hyperrl.rewards.calling import RewardError
from hyperrl.sandbox import Limits, Sandbox, allocate_uids
from hyperrl.sandbox.server import SandboxServer

__all__ = ["code_reward", "extract_program", "parse_tests", "compiles"]

_FENCE = re.compile(r"```(?:python|py|Python)?[^\n]*\n(.*?)```", re.DOTALL)
_MARK = "HYPERRL_TEST_RESULTS "
_HARNESS = """import json, sys
src = open('solution.py').read()
tests = json.load(open('tests.json'))
ns = {'__name__': '__solution__'}
try:
    exec(compile(src, 'solution.py', 'exec'), ns)
    loaded = True
except BaseException:
    loaded = False
results = []
for t in tests:
    if not loaded:
        results.append(False)
        continue
    try:
        exec(compile(t, 'test', 'exec'), dict(ns))
        results.append(True)
    except BaseException:
        results.append(False)
sys.stdout.write('\\n""" + _MARK + """' + json.dumps(results) + '\\n')
"""


def extract_program(completion: str) -> str:
    """The program in a completion: its last fenced code block, else the whole text (stripped)."""
    blocks = _FENCE.findall(completion)
    return (blocks[-1] if blocks else completion).strip()


def parse_tests(tests, row: int | None = None) -> tuple[str, list]:
    """A row's ``tests`` as ``("asserts", [statement, …])`` or ``("io", [(stdin, stdout), …])``; a row without
    tests (or in no known format) is a :class:`~hyperrl.rewards.calling.RewardError` naming the row."""
    where = f"code reward: row {row}" if row is not None else "code reward"
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except json.JSONDecodeError:
            tests = [tests]  # one statement
    if isinstance(tests, dict) and "inputs" in tests and "outputs" in tests:
        ins, outs = list(tests["inputs"]), list(tests["outputs"])
        if len(ins) != len(outs) or not ins:
            raise RewardError(f"{where}: tests has {len(ins)} inputs and {len(outs)} outputs; need as many, ≥ 1",
                              row=row)
        return "io", [(str(i), str(o)) for i, o in zip(ins, outs)]
    if isinstance(tests, list | tuple) and tests and all(isinstance(t, str) for t in tests):
        return "asserts", list(tests)
    raise RewardError(f"{where}: no tests — a row needs `tests`: a list of assert statements or "
                      f"{{'inputs': [...], 'outputs': [...]}} (got {type(tests).__name__}: {str(tests)[:80]!r})",
                      row=row)


def compiles(program: str) -> bool:
    """Does ``program`` compile as Python? (``compile`` parses, never runs: safe on untrusted text.) A program that
    does not is failed without a sandbox run — when the sandbox's Python is this one's version (its grammar);
    otherwise every program is run (True)."""
    import warnings

    if not _same_python():
        return True
    try:
        with warnings.catch_warnings():  # "invalid decimal literal" and kin: the program's, not the trainer's
            warnings.simplefilter("ignore")
            compile(program, "solution.py", "exec", dont_inherit=True)  # not this module's __future__ flags
        return True
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
        return False


_PYTHON: list[bool] = []


def _same_python(python: str = "/usr/bin/python3") -> bool:
    """Is the sandbox's Python (``python``) of this interpreter's major.minor version? (Asked once.)"""
    if not _PYTHON:
        import subprocess
        import sys

        try:
            out = subprocess.run([python, "-I", "-c", "import sys; print(sys.version_info[:2])"], capture_output=True,
                                 text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            out = ""
        _PYTHON.append(out == str(tuple(sys.version_info[:2])))
    return _PYTHON[0]


class _Cache:
    """Verdicts of (program, tests, limits) → which tests passed, shared by every code reward of the process (the
    same program against the same tests under the same limits is run once: a group repeats its answers, and a
    pass-fraction and an all-pass reward read the same runs). Bounded: the oldest entries go first. Programs are
    assumed deterministic — one that draws random numbers is scored by its first run."""

    def __init__(self, size: int = 200_000):
        import collections
        import threading

        self.size, self.lock, self.data = size, threading.Lock(), collections.OrderedDict()

    def get(self, key):
        with self.lock:
            return self.data.get(key)

    def put(self, key, value) -> None:
        with self.lock:
            self.data[key] = value
            while len(self.data) > self.size:
                self.data.popitem(last=False)


_CACHE = _Cache()


def _same_output(got: str, want: str) -> bool:
    norm = [line.rstrip() for line in got.strip().splitlines()]
    return norm == [line.rstrip() for line in want.strip().splitlines()]


_SETTLED = ("ok", "error", "memory", "output_limit")  # the program's own doing; a timeout or a kill may be the load


def _score(box: Sandbox | SandboxServer, program: str, kind: str, tests: list) -> tuple[list[bool], bool]:
    """Which tests the program passes, and whether that is the program's own doing (every run's verdict in
    ``_SETTLED``: worth caching) rather than a deadline or a kill a busier moment might not repeat."""
    if kind == "asserts":
        r = box.run_python(_HARNESS, files={"solution.py": program, "tests.json": json.dumps(tests)})
        line = next((ln for ln in reversed(r.stdout.splitlines()) if ln.startswith(_MARK)), None)
        if line is None:  # killed, timed out, out of memory before reporting: nothing passed
            return [False] * len(tests), r.verdict in _SETTLED
        got = json.loads(line[len(_MARK):])
        return [bool(x) for x in got][:len(tests)] + [False] * max(0, len(tests) - len(got)), r.verdict in _SETTLED
    runs = [box.run_python(program, stdin=i) for i, _ in tests]
    return [r.ok and _same_output(r.stdout, o) for r, (_, o) in zip(runs, tests)], all(r.verdict in _SETTLED
                                                                                       for r in runs)


@register_reward_factory("code")
def code_reward(*, all_pass: bool = False, wall_s: float = 10.0, cpu_s: int = 5, memory_mb: int = 512,
                processes: int = 64, workers: int = 4, prefix: str = "", cache: bool = True, server: bool = False):
    """A TRL-style reward ``(prompts, completions, tests, **kw) → [float]``: each completion's program (see
    :func:`extract_program`) run against its row's ``tests`` — or, verl's code rows, its ground truth ``answer`` —
    (:func:`parse_tests`) in the sandbox under the given
    limits; the fraction of tests passed, or — ``all_pass`` — 1.0 only when every test passes. ``workers`` rows run
    at once (threads waiting on sandboxed processes), each slot a sandbox of its own uid — one program's fork bomb
    cannot starve another's process limit; the values are in row order, the same as one at a time. The sandboxes
    are made once, here: a machine without their mechanism fails at load, naming what to install. ``prefix`` goes
    before the completion's code (``"f = lambda x: "``: the completion is the expression); a program that does not
    compile passes nothing without being run; ``cache``: a program already run against the same tests under the
    same limits is not run again (:class:`_Cache`). ``server``: each slot runs its programs one after another in a
    sandboxed fork server (:class:`hyperrl.sandbox.server.SandboxServer`: the sandbox cleared between programs) —
    several times cheaper a run than a fresh sandbox each; io tests run once per pair either way."""
    import queue
    from concurrent.futures import ThreadPoolExecutor

    if workers < 1:
        raise RewardError(f"code reward: workers={workers}; must be ≥ 1")
    limits = Limits(wall_s=wall_s, cpu_s=cpu_s, memory_mb=memory_mb, processes=processes)
    slots: queue.Queue = queue.Queue()
    for uid in allocate_uids(workers):  # uids of its own: one slot's fork bomb cannot starve another's limit
        slots.put(SandboxServer(limits, uid=uid) if server else Sandbox(limits, uid=uid))

    def one(row: int, completion, t) -> float:
        kind, cases = parse_tests(t, row)
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        program = prefix + extract_program(text)
        key = (program, kind, repr(cases), limits)
        passed = _CACHE.get(key) if cache else None
        if passed is None and not compiles(program):
            passed = [False] * len(cases)
        if passed is None:
            box = slots.get()
            try:
                passed, settled = _score(box, program, kind, cases)
            finally:
                slots.put(box)
            if cache and settled:  # a timeout or a kill is not cached: the next run may finish
                _CACHE.put(key, passed)
        return float(all(passed)) if all_pass else sum(passed) / len(passed)

    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hyperrl-code-reward")

    def code(prompts, completions, tests=None, answer=None, **kw):
        tests = tests if tests is not None else answer  # verl's code rows: the tests are the ground truth
        if tests is None:
            raise RewardError("code reward: the rows carry no `tests` column (a list of asserts or "
                              "{'inputs': [...], 'outputs': [...]} per row) and no ground truth")
        for row, t in enumerate(tests):  # every row's tests are named before anything runs
            parse_tests(t, row)
        return list(pool.map(one, range(len(completions)), completions, tests))

    return code


_DEFAULT: dict = {}  # the code rewards program_passes runs with, by prefix (each built at its first call)


@register_reward("program_passes")
def program_passes(response: str, sample) -> float:
    """hyperrl style: the fraction of the sample's ``extra["tests"]`` that the response's program passes — the
    program is ``extra.get("prefix", "")`` + its code — run in the sandbox with the ``code`` reward's defaults
    (one row at a time: configure ``rewards: [{fn: code, kwargs: {workers: …}}]`` to run rows at once)."""
    extra = getattr(sample, "extra", None) or {}
    if "tests" not in extra:
        raise RewardError("program_passes: the sample has no extra['tests'] (a list of asserts or stdin/stdout "
                          "pairs)")
    prefix = extra.get("prefix", "")
    if prefix not in _DEFAULT:
        _DEFAULT[prefix] = code_reward(workers=1, prefix=prefix)
    return _DEFAULT[prefix]([sample.prompt], [response], tests=[extra["tests"]])[0]
