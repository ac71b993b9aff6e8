"""Agent programs and CLI agents from config: the user owns the loop, the gateway records the tokens.

``env: {name: agent, program: "my_agent.py:solve"}`` — ``solve(sample, client)`` (a plain or an
``async def`` function) gets the task's sample and an ``openai.OpenAI`` (``AsyncOpenAI`` for an
``async def``) client bound to its episode's base URL and key; it returns the episode's reward (a
number), an :class:`AgentResult`, or None (the configured ``rewards:`` then score the episode's
responses). ``env: {name: agent, command: ["python", "my_cli_agent.py", "--task", "{prompt}"]}`` —
any process that reads ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` (or ``ANTHROPIC_BASE_URL`` /
``ANTHROPIC_API_KEY``), started per episode without a
shell (each argument formatted with ``{prompt}``, ``{uid}``, ``{result_file}`` and
``{extra[key]}``; ``HYPERRL_RESULT_FILE`` names the same file), killed with its whole process group
at ``timeout_s``; ``harness: codex`` or ``claude_code`` runs a real coding-agent CLI the same way
(:mod:`hyperrl.agents.harnesses`); ``reward: "file.py:fn"`` scores it — ``fn(sample, result: CommandResult)`` sees
its stdout, stderr, exit code and result file — or, without one, the configured ``rewards:`` do.

Episodes run concurrently, at most ``rollout.max_concurrent_episodes`` at once (async programs on
one event loop; plain programs and commands on threads). An agent that raises, exits non-zero
(without a ``reward`` function to judge it) or outlives ``timeout_s`` fails its episode: its rows
are left out, the error (the stderr or traceback tail) is reported and counted
(``agent_failed``), and the step goes on; an episode that never called the model has nothing to
train on and is counted (``agent_empty``). Each episode's rows (one per prefix-consistent chain,
:mod:`hyperrl.agents.record`) share its reward and its prompt's group id.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import torch
from pydantic import AfterValidator

from hyperrl.agents.gateway import Gateway
from hyperrl.agents.runner import AgentResult, EpisodeOutcome, ProgramRunner, _tail, outcome_of
from hyperrl.agents.worker import AgentPool
from hyperrl.envs.base import EnvCapabilities, register_environment
from hyperrl.envs.tools import check_tool_format
from hyperrl.errors import HyperRLError
from hyperrl.rewards.styles import load_function
from hyperrl.rollout.requests import call_key
from hyperrl.sandbox.tree import run_tree
from hyperrl.trajectory import stack_episodes

__all__ = ["AgentResult", "CommandResult", "AgentEnvironment", "EpisodeOutcome", "AgentError",
           "AgentCancelled"]


@dataclass(frozen=True)
class CommandResult:
    """A CLI agent's end, given to its reward function."""

    stdout: str  # the last TAIL_BYTES (1 MiB) of each stream (hyperrl.sandbox.tree)
    stderr: str
    exit_code: int
    result: str | None  # the result file's text (None: the agent wrote none)
    truncated: bool = False  # stdout or stderr held more than its tail


def _format(name: str | None) -> str | None:
    return None if name in (None, "none") else check_tool_format(name)


def _check_listen(listen) -> None:
    """``env.gateway``: ``{host: str, port: int 0..65535, public_url: http(s)://…}``, each optional."""
    if listen is None:
        return
    if not isinstance(listen, dict) or set(listen) - {"host", "port", "public_url"}:
        raise ValueError(f"env.gateway={listen!r}: a mapping of host, port and public_url (each optional)")
    if not isinstance(listen.get("host", ""), str):
        raise ValueError(f"env.gateway.host={listen['host']!r}: an address to bind, e.g. 0.0.0.0")
    port = listen.get("port", 0)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"env.gateway.port={port!r}: an integer in [0, 65535] (0: a free port)")
    url = listen.get("public_url")
    if url is not None and (not isinstance(url, str) or not url.startswith(("http://", "https://"))):
        raise ValueError(f"env.gateway.public_url={url!r}: the URL agents reach the gateway by, http(s)://host:port")


def _prompt_text(sample) -> str:
    p = sample.prompt
    if isinstance(p, str):
        return p
    users = [m.get("content", "") for m in p if isinstance(m, dict) and m.get("role") == "user"]
    return str(users[-1] if users else p[-1].get("content", ""))


@register_environment("agent", capabilities=EnvCapabilities(owns_loop=True))
class AgentEnvironment:
    """An agent that owns its loop, behind the gateway (see the module doc). Hyperparameters:
    ``program`` (``"file.py:function"``), ``command`` (an argv list) or ``harness`` (a coding-agent CLI:
    ``codex`` or ``claude_code``, :mod:`hyperrl.agents.harnesses`); ``reward`` (a command's
    ``"file.py:function"`` judge); ``timeout_s`` per episode; ``tool_format`` the model's tool-call
    format (``hermes``, ``hyperrl``, ``qmark`` or ``none``); ``model_name`` what the client asks for;
    ``isolate`` runs a program in agent processes (not the trainer's), ``workers`` of them (each round's
    episodes split among them: the SDK's per-call CPU on more than one core); ``gateway`` where the gateway
    listens — ``{host, port, public_url}`` (default 127.0.0.1, a free port; ``public_url`` the address agents
    in containers or on other hosts reach it by)."""


    def __init__(self, *, program: str | None = None, command: list[str] | None = None, harness: str | None = None,
                 reward: str | None = None,
                 timeout_s: float = 300.0, tool_format: Annotated[str | None, AfterValidator(_format)] = "hermes",
                 model_name: str = "hyperrl-policy", isolate: bool = True, workers: int = 1,
                 gateway: dict | None = None):
        self.check({"program": program, "command": command, "harness": harness, "timeout_s": timeout_s,
                    "workers": workers, "isolate": isolate, "gateway": gateway})
        self.listen = dict(gateway or {})
        self.isolate = isolate and program is not None
        # the program by its absolute path: an agent process loads it again from there
        self.program = (str(Path(program.rpartition(":")[0]).resolve()) + ":" + program.rpartition(":")[2]
                        if program is not None else None)
        # a harness (codex, claude_code) is a CLI agent whose command line the harness writes per episode
        self.command = list(command) if command is not None else (["{harness}"] if harness is not None else None)
        self.harness_name, self.harness = harness, None
        self.first_refusal: str | None = None  # the last round's first refused request (named in errors)
        self._cancel = threading.Event()  # set by cancel(): the round under way ends now, no later one starts
        self.cancelled: str | None = None
        self.judge = load_function(reward, "env.reward") if reward is not None else None
        self.timeout_s, self.tool_format, self.model_name = timeout_s, tool_format, model_name
        self.workers = workers
        self.runner = self.worker = None
        self.gateway: Gateway | None = None
        self.stats: dict[str, float] = {}

    @staticmethod
    def check(args: dict, *, has_rewards: bool | None = None) -> None:
        """The config's ``env`` arguments make an agent (what the config alone decides; raises
        ``ValueError`` naming the key): exactly one of ``program`` / ``command``, the program
        importable and a function, a command an argv list, a CLI agent judged (``reward`` or
        ``rewards:``, when ``has_rewards`` is known)."""
        from hyperrl.agents.harnesses import HARNESSES

        program, command, harness = args.get("program"), args.get("command"), args.get("harness")
        if sum(x is not None for x in (program, command, harness)) != 1:
            raise ValueError("env.program: environment 'agent' needs env.program (\"file.py:function\"), "
                             "env.command (an argv list) or env.harness (a CLI agent: "
                             f"{' | '.join(HARNESSES.names())}) — exactly one")
        if harness is not None and harness not in HARNESSES.names():
            raise ValueError(f"env.harness={harness!r}: one of {HARNESSES.names()}")
        cli = command is not None or harness is not None
        if args.get("timeout_s", 1.0) <= 0:
            raise ValueError(f"env.timeout_s={args['timeout_s']}: must be > 0")
        workers = args.get("workers", 1)
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"env.workers={workers!r}: the number of agent processes, an integer ≥ 1")
        if workers > 1 and (cli or args.get("isolate") is False):
            raise ValueError(f"env.workers={workers}: agent processes run a program (env.program) with "
                             "env.isolate true; a CLI agent is already a process per episode — leave env.workers 1")
        if command is not None and (not isinstance(command, list) or not command
                                    or not all(isinstance(a, str) for a in command)):
            raise ValueError(f"env.command={command!r}: a non-empty list of strings (argv; no shell)")
        if program is not None:
            if not isinstance(program, str) or ":" not in program:
                raise ValueError(f"env.program={program!r}: expected 'path/to/file.py:function'")
            load_function(program, "env.program")
        if args.get("reward") is not None:
            load_function(args["reward"], "env.reward")
        _check_listen(args.get("gateway"))
        if cli and args.get("reward") is None and has_rewards is False:
            raise ValueError("env.command: a CLI agent needs env.reward (\"file.py:function\" judging its result) "
                             "or configured rewards: over its final response")

    # ------------------------------------------------------------------ wiring
    def bind(self, engine, tokenizer, sampling, *, max_model_len: int, max_episode_tokens: int | None,
             max_concurrent: int, has_rewards: bool, toolbox=None, tool_sources: list | None = None
             ) -> AgentEnvironment:
        """Serve ``engine`` through a gateway (started now; on a free port of 127.0.0.1 unless ``env.gateway`` says
        where). ``toolbox``:
        the run's ``tools:`` for a program taking ``(sample, client, tools)`` (an agent process starts
        its own from ``tool_sources``)."""
        self.toolbox, self.tool_sources = toolbox, list(tool_sources or [])
        self._closing = False
        if self.command is not None and self.judge is None and not has_rewards:
            raise ValueError("env.command: a CLI agent needs env.reward (\"file.py:function\" judging its result) "
                             "or configured rewards: over its final response")
        self.tok, self.max_concurrent, self.has_rewards = tokenizer, max_concurrent, has_rewards
        if self.harness_name is not None:
            from hyperrl.agents.harnesses import HARNESSES

            self.harness = HARNESSES.build(self.harness_name)()  # a CLI that is not installed fails here, named
        self.gateway = Gateway(engine, tokenizer, sampling, tool_format=self.tool_format, model_name=self.model_name,
                               max_model_len=max_model_len, max_episode_tokens=max_episode_tokens, **self.listen)
        if self.isolate:
            self.worker = AgentPool(self.program, processes=self.workers, timeout_s=self.timeout_s,
                                    max_concurrent=max_concurrent, tool_sources=self.tool_sources)
        elif self.program is not None:
            self.runner = ProgramRunner(self.program, timeout_s=self.timeout_s, max_concurrent=max_concurrent,
                                        toolbox=toolbox)
        return self

    def close(self) -> None:
        self._closing = True  # rounds still running end now, unreported (an asynchronous run's units in flight)
        if self.worker is not None:
            self.worker.close()
            self.worker = None
        if self.gateway is not None:
            self.gateway.close()
            self.gateway = None

    # ------------------------------------------------------------------ one round
    def run(self, samples: list, sampling, n: int, *, group_offset: int = 0, uids: list[int] | None = None):
        """``n`` episodes per sample (sampled with ``sampling``; ``uids`` key them — default keys from
        the seed, ``group_offset`` and the sample) → the trajectory batch of their rows; :attr:`stats`
        counts the round (and :attr:`errors` lists its failures). Raises :class:`AgentError` when no
        episode left a row."""
        if self.gateway is None:
            raise RuntimeError("AgentEnvironment.run before bind(engine, …)")
        jobs = [(group_offset + i, s) for i, s in enumerate(samples) for _ in range(n)]
        calls0, rows0 = self.gateway.engine_calls, self.gateway.engine_rows
        keys = uids if uids is not None else [call_key(sampling.seed or 0, g, k % n) for k, (g, _) in enumerate(jobs)]
        batch, self.stats, self.errors = self._round(jobs, keys, sampling)
        if self._cancel.is_set():
            raise AgentCancelled(f"the agent round was cancelled ({self.cancelled}): "
                                 f"{int(self.stats['agent_cancelled'])} of {len(jobs)} episodes had not finished")
        if batch is None:
            refused = int(self.stats["agent_refused_requests"])
            raise AgentError(f"no agent episode produced a row ({int(self.stats['agent_failed'])} failed, "
                             f"{int(self.stats['agent_empty'])} sampled nothing"
                             + (f"; the gateway refused {refused} requests, the first: {self.first_refusal}"
                                if refused else ": they never called the model") + ")"
                             + (f"; the first failure: {self.errors[0]}" if self.errors else ""))
        self.stats["agent_engine_calls"] = float(self.gateway.engine_calls - calls0)
        self.stats["agent_engine_rows"] = float(self.gateway.engine_rows - rows0)
        return batch

    def cancel(self, reason: str) -> None:
        """End the round under way at once (the run was asked to stop): its episodes are closed (an agent's next
        call gets 404), the agent processes and CLI agents killed; the round then raises :class:`AgentCancelled`
        naming ``reason`` and how many episodes had not finished. Safe from any thread; idempotent."""
        self.cancelled = reason
        self._cancel.set()
        if self.gateway is not None:
            self.gateway.finish_all()
        if self.worker is not None:
            self.worker.kill()
        if self.runner is not None:
            self.runner.cancel.set()

    def run_unit(self, sample, sampling, uids: list[int], *, group_id: int, submit) -> tuple:
        """One prompt's ``len(uids)`` episodes for the asynchronous trainer: their calls go to
        ``submit`` (the rollout workers' queue, :meth:`Gateway.open`), their rows carry ``sample_uid``.
        Returns ``(batch or None when no episode left a row, stats, errors)``; thread-safe (units run
        concurrently)."""
        if self.gateway is None:
            raise RuntimeError("AgentEnvironment.run_unit before bind(engine, …)")
        return self._round([(group_id, sample)] * len(uids), uids, sampling, submit=submit, lane="units")

    def _round(self, jobs: list[tuple], keys: list[int], sampling, submit=None, lane: str = "rounds") -> tuple:
        """The episodes ``jobs`` — ``(group id, sample)`` each, keyed by ``keys`` — run to their end:
        ``(batch or None, stats, errors)``; ``lane``: the concurrency bound they share
        (:meth:`~hyperrl.agents.runner.ProgramRunner.run`)."""
        episodes = [self.gateway.open(u, sampling=sampling, submit=submit) for u in keys]
        retried = 0
        try:
            def done(k, outcome=None):  # its agent returned: the gateway stops counting it among those that may
                self.gateway.finish(episodes[k])  # still call

            if self.command is not None:
                def command(k):
                    try:
                        return self._run_command(jobs[k][1], episodes[k])
                    finally:
                        done(k)

                with ThreadPoolExecutor(max(1, min(self.max_concurrent, len(jobs)))) as pool:
                    outcomes = list(pool.map(command, range(len(jobs))))
            else:
                work = [(s, ep.base_url, ep.api_key) for (_, s), ep in zip(jobs, episodes)]
                outcomes = (self.worker if self.isolate else self.runner).run(work, done, lane=lane)
                lost = [k for k, o in enumerate(outcomes) if o.lost]
                # the agent process died under them: once more, each in a fresh episode, in a fresh process —
                # synchronous rounds only (an asynchronous unit's calls may still be queued under the same uids)
                retried = len(lost) if not self._cancel.is_set() and submit is None else 0
                if retried:
                    for k in lost:
                        self.gateway.finish(episodes[k])
                        episodes[k] = self.gateway.open(keys[k], sampling=sampling, submit=submit)
                    again = self.worker.run([(jobs[k][1], episodes[k].base_url, episodes[k].api_key) for k in lost],
                                            lambda j, o=None: done(lost[j]), lane=lane)
                    for k, o in zip(lost, again):
                        outcomes[k] = o if not o.lost else dataclasses.replace(o, error=f"{o.error} (retried once)")
        finally:
            for ep in episodes:
                self.gateway.finish(ep)
        return self._batch(jobs, episodes, outcomes, uids=submit is not None, retried=retried)

    def _run_command(self, sample, ep) -> EpisodeOutcome:
        with tempfile.TemporaryDirectory(prefix="hyperrl-agent-") as tmp:
            result_file = str(Path(tmp) / "result")
            extra: dict[str, str] = {}
            try:
                if self.harness is not None:
                    argv, extra = self.harness.prepare(ep, Path(tmp), _prompt_text(sample), self.model_name)
                else:
                    argv = [a.format(prompt=_prompt_text(sample), uid=ep.uid, result_file=result_file,
                                     extra=dict(getattr(sample, "extra", None) or {})) for a in self.command]
            except (KeyError, IndexError, ValueError) as e:
                return EpisodeOutcome(error=f"env.command: cannot format {self.command} ({type(e).__name__}: {e}); "
                                            "placeholders: {prompt}, {uid}, {result_file}, {extra[key]}")
            env = {**os.environ, "OPENAI_BASE_URL": ep.base_url, "OPENAI_API_KEY": ep.api_key,
                   "ANTHROPIC_BASE_URL": ep.base_url.removesuffix("/v1"), "ANTHROPIC_API_KEY": ep.api_key,
                   "HYPERRL_RESULT_FILE": result_file, **extra}
            exe = argv[0]
            found = (os.access(os.path.join(tmp, exe), os.X_OK) if "/" in exe
                     else shutil.which(exe, path=env.get("PATH")))
            if not found:
                return EpisodeOutcome(error=f"env.command: cannot start {argv[0]!r}: not an executable file "
                                            "(nor found on PATH)")
            # its own pid namespace: every process it starts ends with it, the output kept to a bounded tail
            run = run_tree(argv, env=env, cwd=tmp, timeout_s=self.timeout_s, cancel=self._cancel)
            if run.timed_out and self._cancel.is_set():
                return EpisodeOutcome(error=f"cancelled ({self.cancelled})")
            if run.timed_out:
                return EpisodeOutcome(error=f"timed out after {self.timeout_s}s; stderr: {_tail(run.stderr)}")
            result = Path(result_file).read_text() if Path(result_file).is_file() else None
        res = CommandResult(run.stdout, run.stderr, run.exit_code, result, run.truncated)
        if self.judge is None:
            if run.exit_code != 0:
                return EpisodeOutcome(error=f"exit code {run.exit_code}; stderr: {_tail(run.stderr)}")
            return EpisodeOutcome()
        try:
            return outcome_of(self.judge(sample, res))
        except Exception as e:  # noqa: BLE001 - a failing judge fails the episode, named
            return EpisodeOutcome(error=f"env.reward raised {type(e).__name__}: {e}")

    # ------------------------------------------------------------------ rows
    def _batch(self, jobs, episodes, outcomes, *, uids: bool = False, retried: int = 0):
        """The episodes' rows (``uids``: each carrying its episode's ``sample_uid``) → ``(batch or None,
        stats, errors)``."""
        rows, calls, failed, empty, errors = [], [], 0, 0, []
        success = []
        for (group, _), ep, out in zip(jobs, episodes, outcomes):
            if out.error is None and out.reward is None and not self.has_rewards:
                out = dataclasses.replace(out, error="the agent returned no reward and no rewards: are configured; "
                                                     "return a number or an AgentResult(reward=…)")
            if out.error is not None:
                failed += 1
                errors.append(out.error)
                continue
            chains = ep.record.rows()
            if not chains:
                empty += 1
                continue
            for c in chains:
                rows.append(dict(tokens=c.tokens, action=c.action, logprobs=c.logprobs, token_versions=c.versions,
                                 reward=out.reward or 0.0, group_id=group, final_turn=c.final_turn(),
                                 finish_reason=c.finish_reason,
                                 version=min(v for v, a in zip(c.versions, c.action) if a),
                                 **({"sample_uid": ep.uid} if uids else {})))
                calls.append(c.tool_calls)
                success.append(out.success)
        stats = {"agent_episodes": float(len(episodes)), "agent_failed": float(failed),
                 "agent_empty": float(empty), "agent_calls": float(sum(e.calls for e in episodes)),
                 "agent_rewrites": float(sum(e.record.rewrites for e in episodes)),
                 "agent_malformed_tool_calls": float(sum(e.malformed_tool_calls for e in episodes)),
                 "agent_sampling_overridden": float(sum(e.overridden for e in episodes)),
                 "agent_server_errors": float(sum(len(e.errors) for e in episodes)),
                 "agent_abandoned_streams": float(sum(e.abandoned_streams for e in episodes)),
                 "agent_refused_requests": float(sum(len(e.refused) for e in episodes)),
                 "agent_retried_episodes": float(retried),
                 "agent_cancelled": float(sum(1 for o in outcomes if o.error is not None and self._cancel.is_set())),
                 "agent_rows": float(len(rows))}
        if errors and not getattr(self, "_closing", False):
            print(f"warning: {failed} of {len(episodes)} agent episodes failed; the first: {errors[0]}",
                  file=sys.stderr)
        server = next((e.errors[0] for e in episodes if e.errors), None)
        if server is not None and not getattr(self, "_closing", False):  # the agent got a 500 (and may have retried)
            print(f"warning: {int(stats['agent_server_errors'])} gateway calls of this round failed on the server; "
                  f"the first: {server}", file=sys.stderr)
        refused = self.first_refusal = next((e.refused[0] for e in episodes if e.refused), None)
        if refused is not None and not getattr(self, "_closing", False):  # a 4xx the agent saw (and may retry)
            print(f"warning: the gateway refused {int(stats['agent_refused_requests'])} requests of this round; "
                  f"the first: {refused}", file=sys.stderr)
        if not rows:
            return None, stats, errors
        batch = stack_episodes(rows, self.tok.pad_token_id or 0)
        batch = batch.set("tool_calls", torch.tensor(calls, dtype=torch.int64))
        if all(s is not None for s in success):
            batch = batch.set("success", torch.tensor([float(s) for s in success]))
        return batch, stats, errors


class AgentError(HyperRLError, RuntimeError):
    """No episode of a round produced anything to train on."""


class AgentCancelled(HyperRLError, RuntimeError):
    """A round ended by :meth:`AgentEnvironment.cancel` (the run was asked to stop)."""


