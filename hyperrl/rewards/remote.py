"""Remote rewards: a reward server scores the rows over HTTP (``rewards: [{url: http://host:port/score}]``).

A remote reward is the registered factory ``remote``: a batch-style function that POSTs its rows as JSON and reads
one value per row back. The wire format is a registered **contract** (``rewards[].style`` of a ``url`` reward):

* ``hyperrl`` (the default) — request ``{"prompts": [...], "completions": [...], "completion_ids": [[int]],
  "answer": [...], <the dataset's other columns>: [...]}`` (the arguments a TRL-style function gets, column by
  column; chat prompts are message lists, their completions ``[{"role": "assistant", "content": ...}]``); response
  ``{"rewards": [float | null, ...]}``, one per row in order (``null``: not applicable, with ``abstains: true``);
* ``openrlhf`` — OpenRLHF's remote reward model (``--remote_rm_url``, ``openrlhf.cli.serve_rm``): request
  ``{"query": [prompt + completion], "prompts": [prompt], "labels": [answer]}``, response ``{"rewards": [...]}``
  (a server that answers ``scores`` instead is read too), so an existing server works unchanged. A chat prompt's
  query is its messages' contents joined by newlines, then the completion — hyperrl does not hold the policy's
  rendered prompt text here; a server that needs the chat template applies its own.

Every request has ``rewards[].timeout_s`` (the socket's and the runner's); a refused connection, an HTTP error or
a malformed answer raises an error naming the URL — retried up to ``retries`` times, then the step's error (or,
``on_error: abstain``, the rows unscored). ``batch`` rows go in one request; ``workers`` requests at once.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable

from hyperrl.registry import Registry
from hyperrl.rewards.builtin import register_reward_factory
from hyperrl.rewards.calling import RewardError

__all__ = ["CONTRACTS", "register_contract", "remote_reward", "RemoteRewardError"]


class RemoteRewardError(ConnectionError):
    """A reward server that did not answer, answered an HTTP error, or answered something unreadable (transient:
    retried)."""


CONTRACTS: Registry = Registry("remote reward contract")
register_contract = CONTRACTS.register


def _text(x) -> str:
    if isinstance(x, list):  # a chat prompt / completion: its contents
        return "\n".join(str(m.get("content", "")) for m in x if isinstance(m, dict))
    return "" if x is None else str(x)


@register_contract("hyperrl")
def hyperrl_contract(prompts, completions, completion_ids, **columns) -> dict:
    """hyperrl's request: the TRL-style call's arguments, column by column."""
    return {"prompts": prompts, "completions": completions, "completion_ids": completion_ids, **columns}


@register_contract("openrlhf")
def openrlhf_contract(prompts, completions, completion_ids, answer=None, **columns) -> dict:
    """OpenRLHF's remote reward model request: ``query`` (prompt + completion), ``prompts``, ``labels``."""
    ps = [_text(p) for p in prompts]
    return {"query": [p + _text(c) for p, c in zip(ps, completions)], "prompts": ps,
            "labels": list(answer) if answer is not None else [None] * len(ps)}


def _post(url: str, body: dict, timeout_s: float) -> dict:
    data = json.dumps(body, default=str).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:  # noqa: S310 - the user's own server
            raw = resp.read()
    except urllib.error.HTTPError as e:
        raise RemoteRewardError(f"{url} answered HTTP {e.code}: {e.read()[:200].decode(errors='replace')}") from None
    except (urllib.error.URLError, OSError) as e:
        raise RemoteRewardError(f"{url} did not answer: {getattr(e, 'reason', e)}") from None
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        raise RemoteRewardError(f"{url} answered something that is not JSON: {raw[:120]!r}") from None


@register_reward_factory("remote")
def remote_reward(*, url: str, contract: str = "hyperrl", timeout_s: float = 120.0) -> Callable:
    """A TRL-style function posting its rows to the reward server at ``url`` in the ``contract``'s format
    (``hyperrl`` | ``openrlhf``, registered in ``CONTRACTS``) and returning its ``rewards``."""
    if not url.startswith(("http://", "https://")):
        raise RewardError(f"rewards.url: {url!r} is not an http(s) URL (e.g. http://127.0.0.1:8000/score)")
    request = CONTRACTS.get(contract)

    def remote(prompts, completions, completion_ids=None, **columns):
        n = len(completions)
        got = _post(url, request(prompts, completions, completion_ids or [[] for _ in range(n)], **columns),
                    timeout_s)
        vals = got.get("rewards", got.get("scores")) if isinstance(got, dict) else None
        if not isinstance(vals, list) or len(vals) != n:
            raise RemoteRewardError(f"{url} answered {str(got)[:160]}; expected {{\"rewards\": [...]}} with {n} "
                                    "values, one per row")
        return vals

    return remote
