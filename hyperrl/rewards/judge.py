"""A judge model as a reward (``rewards: [{judge: {model: path | url: http://…/v1, template: …, parse: …}}]``).

The judge reads each row through a prompt of the user's (``template``: a Jinja file, or the text itself, rendered
with ``prompt``, ``completion``, ``answer`` and the dataset's other columns), built into the judge's own
conversation with **the judge's** chat template, and answers; the verdict is parsed from its answer (``parse:
regex`` — the ``pattern``'s first group, a number; ``json`` — the ``key`` of the first JSON object in the answer)
and divided by ``scale``. An answer that does not parse is an abstention: the row is not applicable for this
reward (``reward_<name>_applicable_frac`` counts them), never a 0 trained on.

Where the judge runs:

* ``model: path/to/hf_dir`` — a frozen ``AutoModelForCausalLM`` and its tokenizer, loaded once on ``device``,
  greedy (or ``temperature``) in batches of ``batch_size`` with left padding: a second engine beside the policy's;
* ``url: http://host:port/v1`` — any OpenAI-compatible endpoint (``POST …/chat/completions``; a vLLM server, or
  hyperrl's own gateway in front of a frozen engine), ``model_name`` its model; the server applies its chat
  template.

Run it with ``workers`` (threads) so its calls overlap generation; ``timeout_s`` and ``retries`` as for any reward.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from hyperrl.rewards.builtin import register_reward_factory
from hyperrl.rewards.calling import RewardError
from hyperrl.rewards.remote import RemoteRewardError

__all__ = ["judge_reward", "parse_verdict", "render_judge_prompt"]

def parse_verdict(text: str, parse: str, pattern: str, key: str) -> float | None:
    """The verdict in a judge's answer: ``regex`` — ``pattern``'s first group (or whole match) as a number;
    ``json`` — ``key`` of the first JSON object (nested ones too) that has it. None when it is not there or is
    not a finite number (an abstention)."""
    import math

    v = None
    if parse == "regex":
        m = re.search(pattern, text)
        if m is None:
            return None
        try:
            v = float(m.group(1) if m.groups() else m.group(0))
        except (TypeError, ValueError):
            return None
    else:
        decoder, at = json.JSONDecoder(), text.find("{")
        while at >= 0 and v is None:
            try:
                obj, _ = decoder.raw_decode(text, at)
            except json.JSONDecodeError:
                obj = None
            got = obj.get(key) if isinstance(obj, dict) else None
            v = float(got) if isinstance(got, int | float | bool) else None
            at = text.find("{", at + 1)
    return v if v is not None and math.isfinite(v) else None


def _template(template: str):
    import jinja2

    p = Path(template)
    src = p.read_text() if template.endswith((".jinja", ".j2", ".txt")) and p.is_file() else template
    if template.endswith((".jinja", ".j2", ".txt")) and not p.is_file():
        raise RewardError(f"judge.template: {p} does not exist (a Jinja file, or the template's text itself)")
    try:
        return jinja2.Environment(undefined=jinja2.StrictUndefined).from_string(src)
    except jinja2.TemplateSyntaxError as e:
        raise RewardError(f"judge.template: not a valid Jinja template: {e}") from None


def render_judge_prompt(tmpl, prompt, completion, columns: dict) -> str:
    """One row's judge prompt: the template rendered with ``prompt`` / ``completion`` (chat ones as their text)
    and the row's columns (``answer`` among them)."""
    def text(x):
        if isinstance(x, list):
            return "\n".join(str(m.get("content", "")) for m in x if isinstance(m, dict))
        return x

    try:
        return tmpl.render(prompt=text(prompt), completion=text(completion), **columns)
    except Exception as e:  # noqa: BLE001 - jinja's UndefinedError and kin: the template asks for a missing key
        raise RewardError(f"judge.template: {type(e).__name__}: {e} (it may read prompt, completion and the "
                          f"row's columns {sorted(columns)})") from None


def _local(model: str, device: str, batch_size: int, max_new_tokens: int, temperature: float):
    """Answers of a local judge: prompts (already rendered) → texts, the judge's chat template around each."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = Path(model)
    if not (p / "config.json").is_file():
        raise RewardError(f"judge.model: {p} is not a model directory (no config.json)")
    files = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
    try:
        if not any((p / f).is_file() for f in files):
            raise OSError(f"none of {', '.join(files)}")
        tok = AutoTokenizer.from_pretrained(str(p), padding_side="left")
    except (OSError, ValueError) as e:
        raise RewardError(f"judge.model: {p} has no tokenizer the judge can read ({type(e).__name__}: {e}); save "
                          "the judge's tokenizer beside its weights") from None
    if not getattr(tok, "chat_template", None):
        raise RewardError(f"judge.model: {p}'s tokenizer has no chat template; the judge's prompt is built with its "
                          "own template — save one with the tokenizer (tokenizer.chat_template)")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    lm = AutoModelForCausalLM.from_pretrained(str(p)).to(device).eval()
    stop = lm.generation_config.eos_token_id if lm.generation_config.eos_token_id is not None else tok.eos_token_id
    lock = __import__("threading").Lock()  # one model: calls from a thread pool take turns

    @torch.no_grad()
    def answer(prompts: list[str]) -> list[str]:
        texts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                         add_generation_prompt=True) for q in prompts]
        out = []
        with lock:
            for i in range(0, len(texts), batch_size):
                enc = tok(texts[i:i + batch_size], return_tensors="pt", padding=True, add_special_tokens=False)
                enc = enc.to(device)
                gen = lm.generate(**enc, max_new_tokens=max_new_tokens, do_sample=temperature > 0,
                                  temperature=temperature or None, top_p=None, top_k=None, eos_token_id=stop,
                                  pad_token_id=tok.pad_token_id)
                out += tok.batch_decode(gen[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        return out

    return answer


def _remote(url: str, model_name: str, max_new_tokens: int, temperature: float, timeout_s: float, concurrency: int):
    """Answers of an OpenAI-compatible judge endpoint, one request per prompt, ``concurrency`` at once."""
    if not url.startswith(("http://", "https://")):
        raise RewardError(f"judge.url: {url!r} is not an http(s) URL (e.g. http://127.0.0.1:8000/v1)")
    endpoint = url.rstrip("/") + "/chat/completions"

    def one(q: str) -> str:
        body = json.dumps({"model": model_name, "messages": [{"role": "user", "content": q}],
                           "max_tokens": max_new_tokens, "temperature": temperature}).encode()
        req = urllib.request.Request(endpoint, data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:  # noqa: S310 - the user's own endpoint
                got = json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise RemoteRewardError(f"{endpoint} answered HTTP {e.code}: "
                                    f"{e.read()[:200].decode(errors='replace')}") from None
        except (urllib.error.URLError, OSError, json.JSONDecodeError) as e:
            raise RemoteRewardError(f"{endpoint} did not answer: {getattr(e, 'reason', e)}") from None
        try:
            return got["choices"][0]["message"]["content"] or ""
        except (KeyError, IndexError, TypeError):
            raise RemoteRewardError(f"{endpoint} answered {str(got)[:160]}; expected an OpenAI chat "
                                    "completion") from None

    from concurrent.futures import ThreadPoolExecutor

    def answer(prompts: list[str]) -> list[str]:
        if len(prompts) <= 1 or concurrency <= 1:
            return [one(q) for q in prompts]
        with ThreadPoolExecutor(min(concurrency, len(prompts))) as ex:
            return list(ex.map(one, prompts))

    return answer


@register_reward_factory("judge")
def judge_reward(*, template: str, model: str = "", url: str = "", model_name: str = "judge", parse: str = "regex",
                 pattern: str = r"([-+]?\d+(?:\.\d+)?)", key: str = "score", scale: float = 1.0,
                 max_new_tokens: int = 64, temperature: float = 0.0, batch_size: int = 8, device: str = "cpu",
                 timeout_s: float = 120.0, concurrency: int = 8) -> Callable:
    """A TRL-style reward asking a judge about each row (module doc): ``model`` (a local directory) or ``url`` (an
    OpenAI-compatible base URL; ``concurrency`` requests of a call at once); ``template`` (a Jinja file or text);
    ``parse`` ``regex`` | ``json``; the value is the verdict / ``scale``, None (an abstention) when the answer has
    none."""
    if bool(model) == bool(url):
        raise RewardError("judge: give one of model (a local model directory) and url (an OpenAI-compatible "
                          "endpoint, http://host:port/v1)")
    if parse not in ("regex", "json"):
        raise RewardError(f"judge.parse: {parse!r}; use regex (pattern's first group) or json (key)")
    if parse == "regex":
        try:
            re.compile(pattern)
        except re.error as e:
            raise RewardError(f"judge.pattern: {pattern!r} is not a regular expression: {e}") from None
    if scale == 0:
        raise RewardError("judge.scale: 0; the verdict is divided by it")
    tmpl = _template(template)
    answer = (_local(model, device, batch_size, max_new_tokens, temperature) if model else
              _remote(url, model_name, max_new_tokens, temperature, timeout_s, concurrency))

    def judge(prompts, completions, completion_ids=None, **columns):
        rows = [{k: v[i] for k, v in columns.items()} for i in range(len(completions))]
        qs = [render_judge_prompt(tmpl, p, c, row) for p, c, row in zip(prompts, completions, rows)]
        verdicts = [parse_verdict(a, parse, pattern, key) for a in answer(qs)]
        return [None if v is None else v / scale for v in verdicts]

    return judge


judge_reward.abstains = True  # a factory's declaration: an answer without a verdict is not applicable, counted
