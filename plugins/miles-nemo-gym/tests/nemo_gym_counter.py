"""The task of NeMo Gym's ``example_session_state_mgmt`` dataset as Miles samples, and a scripted policy that
solves it with the server's tools (``increment_counter``, ``get_counter_value``)."""

import json
import re

from miles import Sample


def call(name, **arguments):
    """A call as the chat template renders it (what a model trained on the template writes)."""
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def counter_sample(rows, index):
    """Episode ``index`` from the dataset's rows, in the ways a Miles run can hold a NeMo Gym row: with
    ``data.prompt_key: responses_create_params`` (even episodes), or with a plain text prompt and
    ``data.label_key: expected_count`` (odd ones). Episodes 1 and 2 of every 4 expect a wrong count: reward 0."""
    row = json.loads(json.dumps(rows[index % len(rows)]))
    params = row.pop("responses_create_params")
    if index % 4 in (1, 2):
        row["expected_count"] += 100
    if index % 2 == 0:
        return Sample(prompt=params, prompt_ids=[0], index=index, metadata={"data": row})
    label = row.pop("expected_count")
    text = params["input"][0]["content"]
    return Sample(prompt=text, label=label, prompt_ids=[0], index=index,
                  metadata={"data": {**row, "responses_create_params": {"tools": params["tools"]}}})


def counter_policy(turn, observation):
    """'add A then add B then get the count': both increments in turn 1, read the counter in turn 2, answer."""
    if turn == 1:
        a, b = map(int, re.findall(r"\d+", observation))
        return call("increment_counter", count=a) + "\n" + call("increment_counter", count=b)
    if turn == 2:
        return call("get_counter_value")
    return f"The count is {json.loads(observation.split('<tool_response>')[-1].split('</tool_response>')[0])['count']}."
