"""The products task solved by an agent that owns its loop (configs/calculator_agent.yaml).

An ordinary OpenAI-client program: it asks the model, runs the calculator when the model calls it
(an OpenAI function tool bound to this task's question — the tiny character model calls it with a
leading ``?``, which the gateway's ``qmark`` format turns into a ``tool_calls`` entry), sends the
result back as a ``tool`` message and scores the final answer: ``digit_match`` + 0.1 for a call that
returned a result — the same reward as the built-in ``calculator_copy`` environment.
"""

from hyperrl.agents import AgentResult
from hyperrl.envs.tools import calculate
from hyperrl.rewards.builtin import digit_match

MODEL = "hyperrl-policy"
CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Compute the product in the question.",
    "parameters": {"type": "object", "properties": {}}}}


async def solve(sample, client) -> AgentResult:
    """One call of the calculator at most; the response after it (or the first without a call) is the answer."""
    messages = [{"role": "user", "content": sample.prompt}]
    width, called = len(str(sample.answer)), 0
    while True:
        last = called >= 1
        r = await client.chat.completions.create(model=MODEL, messages=messages, tools=[CALCULATOR],
                                                 tool_choice="none" if last else "auto")
        msg = r.choices[0].message
        if not msg.tool_calls:
            score = digit_match(msg.content or "", sample)
            return AgentResult(reward=score + 0.1 * called, success=score == 1.0)
        called += 1
        result = calculate(sample.prompt.rstrip("=")).zfill(width)
        messages += [msg.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": f"[{result}]"}]
