"""One client never hurts another in the embedded engine: every input is checked at the door (400 naming the
field, and in a batch the element, before anything is scheduled), an error raised for one request inside the
batcher fails that request only, and a client that disconnects aborts its requests.

The server runs in a thread of this process on 127.0.0.1 and is spoken to over real sockets. Nothing waits a
fixed time: requests are held with the engine's pause, or with a gate on the model's forward passes, and a test
waits (with a deadline that only stops a hung test) until the engine's own counters say what it looks for.
"""

import asyncio
import json
import random
import socket
import threading
import urllib.error
import urllib.request

import pytest

from miles.engine import LocalEngine
from miles.engine.batcher import Request
from miles.engine.sampling import MAX_SAMPLES, MAX_TOP_K, SamplingParams
from miles.testing import serve_in_thread

from test_engine_server import wait_for

PROMPTS = [[4, 13, 5, 14], [7, 13, 2, 14], [3, 13, 9, 14], [9, 13, 9, 14, 1, 3]]
GREEDY = {"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True}
VOCAB = 15  # the tiny model's
DEEP = json.loads("[" * 400 + "]" * 400)  # deep, yet within what the server parses


def call(base, path, body=None, *, data=None):
    """(status, parsed JSON answer) of a POST of ``body`` as JSON (``data`` as it is), or a GET."""
    if body is not None:
        data = json.dumps(body).encode()
    request = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def in_background(base, body):
    """A /generate call in a thread; returns the thread and a dict that gets ``answer``."""
    out = {}
    thread = threading.Thread(target=lambda: out.update(answer=call(base, "/generate", body)))
    thread.start()
    return thread, out


SCHEDULING = ("requests_finished", "prefill_batches", "prefill_tokens_requested", "decode_steps")


def scheduled(engine):
    """What the engine has scheduled so far, once nothing waits or runs (a row leaves the batch just after its
    answer is handed over)."""
    wait_for(lambda: engine.stats()["waiting_requests"] == engine.stats()["running_requests"] == 0,
             "the engine to be idle")
    stats = engine.stats()
    return {k: stats[k] for k in SCHEDULING}


def make_engine(tiny_model_dir):
    engine = LocalEngine(seed=1, background=True)
    engine.load_model(str(tiny_model_dir))
    return engine


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    """(engine, base URL) of an engine served from a thread of this process."""
    engine = make_engine(tiny_model_dir)
    with serve_in_thread(engine) as base:
        yield engine, base
    engine.close()


@pytest.fixture(scope="module")
def reference(served):
    """Each prompt's greedy answer to GREEDY, generated alone."""
    _, base = served
    return [call(base, "/generate", {"input_ids": p, "sampling_params": GREEDY})[1]["output_ids"] for p in PROMPTS]


# -- every sampling parameter at its extremes ----------------------------------------------------------

NOT_A_NUMBER = [True, False, "1", "abc", [], [1], {}, {"a": 1}, DEEP]
NOT_AN_INT = [*NOT_A_NUMBER, 1.5, 1.0, 1e300, float("nan"), float("inf")]

# parameter: (values refused at the door, values taken at their type's extremes)
SAMPLING_EXTREMES = {
    "max_new_tokens": ([-1, -(2**63), None, *NOT_AN_INT], [0, 1, 2**63 - 1, 2**63, 10**400]),
    "temperature": ([-1e-300, -1, -(2**63), float("nan"), float("inf"), float("-inf"), 10**400, None, *NOT_A_NUMBER],
                    [0, 0.0, 5e-324, 1e-300, 1, 1e300, 2**63]),
    "top_p": ([0, 0.0, -0.5, 1.0000001, 2, -(2**63), 2**63, float("nan"), float("inf"), None, *NOT_A_NUMBER],
              [5e-324, 1e-300, 0.5, 1, 1.0]),
    "top_k": ([0, -2, -(2**63), MAX_TOP_K + 1, 2**63, 10**400, None, *NOT_AN_INT],
              [-1, 1, VOCAB, VOCAB + 1, MAX_TOP_K]),
    "stop_token_ids": ([5, "5", "abc", {}, {"a": 1}, True, 1.5, [True], [-1], [1.5], ["1"], [[1]], [None], [2**63],
                        [-(2**63)], DEEP],
                       [None, [], [0], [VOCAB - 1], [VOCAB], [2**63 - 1], list(range(10_000))]),
    "ignore_eos": ([1, 0, None, "true", "yes", 1.5, [], {}, DEEP], [True, False]),
    "n": ([0, -1, MAX_SAMPLES + 1, 2**63, 10**400, -(2**63), None, *NOT_AN_INT], [1, 2]),
    # SGLang's parameters the engine takes at their defaults only
    "min_new_tokens": ([1, -1, 2**63, True, float("nan"), "0", []], [0, 0.0]),
    "min_p": ([0.5, 1e-300, float("nan"), float("inf"), True, "0"], [0, 0.0]),
    "frequency_penalty": ([0.5, -2, float("nan"), False, "0"], [0, 0.0]),
    "presence_penalty": ([0.5, -2, float("inf"), False, "0"], [0, 0.0]),
    "repetition_penalty": ([1.5, 0, float("nan"), True, "1"], [1, 1.0]),
    "skip_special_tokens": ([False, 1, None, "true"], [True]),
    "spaces_between_special_tokens": ([False, 1, "true"], [True]),
    "no_stop_trim": ([True, 0, "false"], [False]),
    "stop": (["x", ["x"], 5, DEEP], [None, "", []]),
    "stop_regex": (["x+", ["x"]], [None, ""]),
    "json_schema": (['{"type": "string"}', {"type": "string"}], [None]),
    "regex": (["[0-9]+"], [None]),
    "ebnf": (["root ::= x"], [None]),
    "structural_tag": (["{}"], [None]),
    "stream_interval": ([1, 2**63], [None]),
    "logit_bias": ([{"3": 1.0}], [None, {}]),
    "sampling_seed": ([0, 2**63, -1], [None]),
    "custom_params": ([{"a": 1}], [None, {}]),
    "watermark": ([True], [None]),
    "beam_width": ([2], [None]),
}


def test_the_extremes_cover_every_sampling_parameter_the_engine_takes():
    from dataclasses import fields

    from miles.engine.sampling import SGLANG_NEUTRAL

    assert set(SAMPLING_EXTREMES) == {f.name for f in fields(SamplingParams)} | set(SGLANG_NEUTRAL)


def _bad_values(name):
    return SAMPLING_EXTREMES[name][0]


@pytest.mark.parametrize("name", sorted(SAMPLING_EXTREMES))
def test_a_sampling_parameter_out_of_range_in_a_batch_refuses_the_batch_before_anything_runs(served, name):
    engine, base = served
    for value in _bad_values(name):
        before = scheduled(engine)
        status, answer = call(base, "/generate", {"input_ids": PROMPTS[:2],
                                                  "sampling_params": [GREEDY, {**GREEDY, name: value}]})
        assert status == 400, (name, value, answer)
        assert answer["error"].startswith(f"batch element 1: sampling_params.{name}: "), (value, answer)
        assert scheduled(engine) == before, (name, value)  # nothing generated and thrown away


@pytest.mark.parametrize("name", sorted(SAMPLING_EXTREMES))
def test_a_sampling_parameter_out_of_range_hurts_no_request_in_flight(served, reference, name):
    """A good request held in the engine (paused) while every bad value of ``name`` is refused: it then runs
    to its end."""
    engine, base = served
    call(base, "/pause_generation", {})
    try:
        thread, out = in_background(base, {"input_ids": PROMPTS[0], "sampling_params": GREEDY})
        wait_for(lambda: engine.stats()["waiting_requests"] == 1, "the good request to wait in the engine")
        for value in _bad_values(name):
            status, answer = call(base, "/generate", {"input_ids": PROMPTS[1],
                                                      "sampling_params": {**GREEDY, name: value}})
            assert status == 400 and answer["error"].startswith(f"sampling_params.{name}: "), (value, answer)
        assert thread.is_alive()
    finally:
        call(base, "/continue_generation", {})
    thread.join(60)
    status, good = out["answer"]
    assert status == 200 and good["output_ids"] == reference[0]
    assert good["meta_info"]["finish_reason"] == {"type": "length", "length": 3}


@pytest.mark.parametrize("name", sorted(SAMPLING_EXTREMES))
def test_a_sampling_parameter_at_its_accepted_extremes_runs_beside_a_good_request(served, reference, name):
    _, base = served
    for value in SAMPLING_EXTREMES[name][1]:
        params = {**GREEDY, name: value}
        status, answers = call(base, "/generate", {"input_ids": PROMPTS[:2], "sampling_params": [GREEDY, params]})
        assert status == 200, (name, value, answers)
        assert answers[0]["output_ids"] == reference[0]
        extreme = answers[1:]
        assert len(extreme) == (value if name == "n" else 1)
        for answer in extreme:
            assert answer["meta_info"]["finish_reason"]["type"] in ("length", "stop"), (name, value, answer)
            if name == "max_new_tokens":  # above the context: the rest of the context
                assert len(answer["output_ids"]) == min(value, 128 - len(PROMPTS[1]))


def test_max_new_tokens_zero_generates_nothing_and_gives_the_prompt_logprobs(served):
    _, base = served
    status, answer = call(base, "/generate", {"input_ids": PROMPTS[0], "return_logprob": True, "logprob_start_len": 0,
                                              "sampling_params": {"max_new_tokens": 0}})
    assert status == 200 and answer["output_ids"] == [] and answer["meta_info"]["completion_tokens"] == 0
    assert answer["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert [t for _, t, _ in answer["meta_info"]["input_token_logprobs"]] == PROMPTS[0]


def test_a_parsed_parameter_is_not_taken_for_an_equal_one_of_another_type():
    """The parse cache tells 1 from true and 1.0 (they are equal, and hash alike, in Python)."""
    assert SamplingParams.parse({"top_k": 1}).top_k == 1
    for value in (True, 1.0):
        with pytest.raises(ValueError, match="sampling_params.top_k"):
            SamplingParams.parse({"top_k": value})


# -- a batch is checked whole ----------------------------------------------------------------------

def _batch_with(bad, at, size=31):
    """A batch of ``size`` good prompts whose element ``at`` gets the per-prompt values in ``bad``."""
    body = {"input_ids": [list(PROMPTS[i % len(PROMPTS)]) for i in range(size)],
            "sampling_params": [dict(GREEDY) for _ in range(size)], "rid": [f"r{i}" for i in range(size)],
            "return_logprob": [False] * size, "logprob_start_len": [-1] * size, "top_logprobs_num": [0] * size,
            "return_routed_experts": [False] * size}
    for field, value in bad.items():
        body[field][at] = {**GREEDY, **value} if field == "sampling_params" and isinstance(value, dict) else value
    return body


BAD_ELEMENTS = [
    ({"sampling_params": {"top_k": 2**63}}, "sampling_params.top_k"),
    ({"sampling_params": {"temperature": float("nan")}}, "sampling_params.temperature"),
    ({"sampling_params": {"n": 0}}, "sampling_params.n"),
    ({"sampling_params": "greedy"}, "sampling_params: expected a JSON object"),
    ({"input_ids": []}, "input_ids: expected a non-empty list"),
    ({"input_ids": [4, VOCAB]}, "input_ids: token ids must be integers"),
    ({"input_ids": [4, True]}, "input_ids: token ids must be integers"),
    ({"input_ids": [4] * 128}, "input_ids: prompt of 128 tokens does not fit the context"),
    ({"rid": 7}, "rid: expected a string"),
    ({"return_logprob": "yes"}, "return_logprob: expected true or false"),
    ({"logprob_start_len": 2**63}, "logprob_start_len: expected -1"),
    ({"top_logprobs_num": -1}, "top_logprobs_num: expected an integer in [0, 15]"),
    ({"return_routed_experts": True}, "return_routed_experts: expected true or false"),
]


@pytest.mark.parametrize("seed", range(3))
def test_a_batch_with_one_bad_element_is_refused_before_anything_is_scheduled(served, seed):
    engine, base = served
    rng = random.Random(seed)
    for bad, field in BAD_ELEMENTS:
        at = rng.randrange(31)
        before = scheduled(engine)
        status, answer = call(base, "/generate", _batch_with(bad, at))
        assert status == 400 and answer["error"].startswith(f"batch element {at}: {field}"), (bad, answer)
        assert scheduled(engine) == before, bad  # nothing scheduled, nothing thrown away
    status, answers = call(base, "/generate", _batch_with({}, 0))  # the same batch, all good, runs
    assert status == 200 and len(answers) == 31


def test_a_text_batch_names_the_element_that_cannot_be_tokenized(served):
    engine, base = served
    before = scheduled(engine)
    for text, why in ((["12+3=", ""], "text: expected a non-empty string"), (["12+3=", 5], "text: expected"),
                      (["12+3=", "\ud800"], "text: the tokenizer cannot encode it")):
        status, answer = call(base, "/generate", {"text": text, "sampling_params": GREEDY})
        assert status == 400 and answer["error"].startswith(f"batch element 1: {why}"), answer
    assert scheduled(engine) == before


def test_one_request_asks_for_a_bounded_number_of_samples(served):
    engine, base = served
    before = scheduled(engine)
    status, answer = call(base, "/generate", {"input_ids": [[4]] * 3, "sampling_params": {"n": MAX_SAMPLES // 2}})
    assert status == 400 and answer["error"].startswith("sampling_params.n: this request asks for 98304 samples")
    assert f"at most {MAX_SAMPLES}" in answer["error"]
    assert scheduled(engine) == before


# -- malformed bodies: 400 naming the field, never 500 --------------------------------------------

NOT_A_STRING = [True, 1, -1, 1.5, 2**63, float("nan"), [], ["a"], {}, {"a": 1}, DEEP]
NOT_A_BOOL = [1, 0, 1.5, "true", "yes", "", [], [True], {}, DEEP]
NOT_A_LIST = [True, 1, 1.5, "w", "", {}, {"a": 1}]  # of one entry per tensor (the good body has one)
INTS = [True, False, 1.5, float("nan"), float("inf"), "1", "abc", "", [], [1], {}, DEEP]

GENERATE_FIELDS = {
    "input_ids": [5, "4 13", {}, [[4], 5], [4, "13"], [4, 1.0], [4, -1], [4, 2**63], [4, float("nan")], DEEP],
    "text": [5, True, "", [], [5], {}, DEEP],
    "rid": NOT_A_STRING,
    "return_logprob": NOT_A_BOOL,
    "logprob_start_len": [*INTS, -2, 4, 2**63, -(2**63)],
    "top_logprobs_num": [*INTS, -1, VOCAB + 1, 2**63],
    "return_entropy": NOT_A_BOOL,
    "return_text_in_logprobs": NOT_A_BOOL,
    "return_routed_experts": [*NOT_A_BOOL, True],
    "sampling_params": [5, "x", True, [1], DEEP],
    "stream": [True, 1, "yes", [1], {"a": 1}, DEEP],
    "return_hidden_states": [True, 2**63, "x"],
}


@pytest.mark.parametrize("field", sorted(GENERATE_FIELDS))
def test_a_generate_field_of_the_wrong_type_is_a_400_naming_it(served, field):
    engine, base = served
    before = scheduled(engine)
    for value in GENERATE_FIELDS[field]:
        body = {"input_ids": PROMPTS[0], "sampling_params": GREEDY, field: value}
        if field == "text":
            del body["input_ids"]
        status, answer = call(base, "/generate", body)
        assert status == 400 and field in answer["error"], (value, answer)
    assert scheduled(engine) == before


def test_bodies_json_cannot_hold_as_python_values_are_400(served):
    _, base = served
    for raw, why in ((b'{"input_ids": [' + b"1" * 5000 + b"]}", "body is not valid JSON"),
                     (b'{"input_ids": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
                     (b'{"input_ids": [4], "sampling_params": {"top_k": 1e999}}', "sampling_params.top_k"),
                     (b"\xff\xfe", "body is not valid JSON")):
        status, answer = call(base, "/generate", data=raw)
        assert status == 400 and why in answer["error"], answer


@pytest.fixture(scope="module")
def weight_group(served):
    """A weight group joined by the engine as /init_weights_update_group does, with this process as rank 0."""
    from miles.weights.wire import open_weight_group

    _, base = served
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    joined = {}
    thread = threading.Thread(target=lambda: joined.update(answer=call(base, "/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
        "group_name": "fuzz"})))
    thread.start()
    group = open_weight_group("127.0.0.1", port, 0, 2)
    thread.join(60)
    assert joined["answer"] == (200, {"success": True, "rank": 1})
    return group


def _admin_fields(tiny_model_dir, free_port):
    """endpoint: (a body good but for the field under test, {field: values of the wrong type or range})."""
    versions = {"weight_version": [*INTS[:2], 1.5, -1, 2**63, "-1", "1" * 20, "\u00b2", "abc", [], {}, DEEP],
                "allow_non_finite": NOT_A_BOOL}
    group = {"master_address": "127.0.0.1", "master_port": free_port, "rank_offset": 1, "world_size": 2}
    descriptor = {"path": "/dev/shm/miles-weights-none", "names": ["w"], "dtypes": ["float32"], "shapes": [[1]],
                  "offsets": [4096], "sequence": 0, "weight_version": 1}
    layout = {"group_name": "fuzz", "names": ["w"], "dtypes": ["float32"], "shapes": [[1]]}
    return {
        "/pause_generation": ({}, {"mode": [*NOT_A_STRING, "hold", "ABORT"]}),
        "/abort_request": ({"rid": "x"}, {"rid": NOT_A_STRING, "abort_all": NOT_A_BOOL}),
        "/release_memory_occupation": ({}, {"tags": ["weights", 5, True, [5], ["gpu"], [["weights"]], {}, DEEP]}),
        "/resume_memory_occupation": ({}, {"tags": ["weights", 5, True, [5], ["gpu"], {}, DEEP]}),
        "/update_weights_from_disk": ({"model_path": str(tiny_model_dir)}, {
            "model_path": [*NOT_A_STRING, "", "/no/such/dir", "a\x00b", "x" * 5000], **versions}),
        "/update_weights_from_tensor": ({"serialized_named_tensors": ""}, {
            "serialized_named_tensors": [*NOT_A_STRING, ["x"]]}),
        "/init_weights_update_group": (group, {
            "master_address": [*NOT_A_STRING, ""], "master_port": [*INTS, 0, -1, 65536, 2**63],
            "rank_offset": [*INTS, 0, -1, 2, 2**63], "world_size": [*INTS, 0, 1, 2**63],
            "backend": [*NOT_A_STRING, "nccl"], "group_name": NOT_A_STRING}),
        "/update_weights_from_distributed": (layout, {
            "group_name": [*NOT_A_STRING, "nope"], "names": [*NOT_A_LIST, [1], [None], ["w", "w"], [DEEP]],
            "dtypes": [*NOT_A_LIST, ["float33"], [["float32"]], [{}], [5]],
            "shapes": [*NOT_A_LIST, [1], [["1"]], [[-1]], [[1.5]], [[2**63]], [[1 << 40]], [[True]], [None]],
            **versions}),
        "/update_weights_from_shm": (descriptor, {
            "path": [*NOT_A_STRING, "/etc/passwd", "/dev/shm/miles-weights-\x00"],
            "names": [*NOT_A_LIST, [1], ["w", "w"]], "dtypes": [*NOT_A_LIST, ["float33"], [[1]]],
            "shapes": [*NOT_A_LIST, [[-1]], [["1"]]], "offsets": [*NOT_A_LIST, [1], ["4096"], [2**63 + 1]],
            "sequence": [*INTS, -1], "snapshot": NOT_A_BOOL, **versions}),
    }


def test_a_malformed_admin_or_weight_body_is_a_400_naming_the_field(served, weight_group, tiny_model_dir):
    """Every field of every admin and weight endpoint, one at a time, at values of the wrong type or range: a
    400 that names it, and nothing applied."""
    engine, base = served
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    version = engine.weight_version
    for path, (good, fields) in _admin_fields(tiny_model_dir, port).items():
        for field, values in fields.items():
            for value in values:
                status, answer = call(base, path, {**good, field: value})
                assert status == 400 and field in answer["error"], (path, field, value, answer)
    assert engine.weight_version == version and not engine.released
    assert engine.stats()["waiting_requests"] == 0 and call(base, "/health")[0] == 200
    status, answer = call(base, "/generate", {"input_ids": PROMPTS[0], "sampling_params": GREEDY})
    assert status == 200 and len(answer["output_ids"]) == 3  # not paused, not released


# -- an error raised inside the batcher fails its request only -------------------------------------


def test_an_error_raised_for_one_request_in_the_batcher_fails_that_request_only(tiny_model_dir):
    """Requests that reach the batcher past the door's checks (made directly), each raising at another stage
    (its sampling settings, its prefill, its answer, its caller's callback), join a batch with a row already
    decoding and good requests admitted with them: only they fail, the others run to their end as if alone."""
    engine = LocalEngine(seed=1)  # inline: the test steps the batcher itself
    engine.load_model(str(tiny_model_dir))
    batcher = engine.batcher
    answers = {}

    def request(name, prompt, params=GREEDY, **kwargs):
        deliver = kwargs.pop("deliver", lambda answer: answers.__setitem__(name, answer))
        return Request(list(prompt), SamplingParams.parse(params), deliver, rid=name, **kwargs)

    def alone(prompt, params):
        fresh = LocalEngine(seed=1)
        fresh.load_model(str(tiny_model_dir))
        return asyncio.run(fresh.generate(prompt, params))["output_ids"]

    long_params = {**GREEDY, "max_new_tokens": 12}
    batcher.submit([request("long", PROMPTS[3], long_params)])
    batcher._iteration()  # admitted, then one decode step
    batcher._iteration()
    assert [r.rid for r in batcher._rows] == ["long"]

    bad_settings = Request(list(PROMPTS[1]), SamplingParams(**GREEDY, top_k=2**63),  # what the door refuses
                           lambda answer: answers.__setitem__("bad_settings", answer), rid="bad_settings")
    raising = request("raising_callback", PROMPTS[2], deliver=lambda answer: 1 / 0)
    batcher.submit([request("good_1", PROMPTS[0]), bad_settings, request("bad_prompt", [4, VOCAB + 5]),
                    request("bad_answer", PROMPTS[1], return_routed_experts=True), raising,
                    request("good_2", PROMPTS[1], {**GREEDY, "max_new_tokens": 5})])
    batcher.drain()

    assert set(answers) == {"long", "good_1", "good_2", "bad_settings", "bad_prompt", "bad_answer"}
    for name, prompt, params in (("long", PROMPTS[3], long_params), ("good_1", PROMPTS[0], GREEDY),
                                 ("good_2", PROMPTS[1], {**GREEDY, "max_new_tokens": 5})):
        assert answers[name]["meta_info"]["finish_reason"]["type"] == "length", name
        assert answers[name]["output_ids"] == alone(prompt, params), name
    for name, why in (("bad_settings", "sampling_params.top_k"), ("bad_prompt", "IndexError"),
                      ("bad_answer", "Error")):
        finish = answers[name]["meta_info"]["finish_reason"]
        assert finish["type"] == "abort" and why in finish["message"], (name, finish)
    assert answers["bad_settings"]["output_ids"] == answers["bad_prompt"]["output_ids"] == []
    assert batcher.stats["requests_failed"] == 3
    assert raising.finish == {"type": "length", "length": 3}  # generated; only its own callback raised
    assert not batcher._rows and not batcher._queue
    engine.close()


# -- a client that disconnects aborts its requests -------------------------------------------------


class ForwardGate:
    """Lets the engine's model run only the forward passes the test allows (each prefill or decode step takes
    one permit), through real hooks on the model; ``passed`` counts those that ran."""

    def __init__(self, model):
        self.passed, self.opened = 0, False
        self._permits, self._cond = threading.Semaphore(0), threading.Condition()
        model.register_forward_pre_hook(self._wait)
        model.register_forward_hook(self._count)

    def _wait(self, module, args):
        if not self.opened:
            self._permits.acquire()

    def _count(self, module, args, output):
        with self._cond:
            self.passed += 1
            self._cond.notify_all()

    def allow(self, count):
        for _ in range(count):
            self._permits.release()

    def wait_passed(self, count):
        with self._cond:
            assert self._cond.wait_for(lambda: self.passed >= count, timeout=60), f"{self.passed} of {count} passes"

    def open(self):
        self.opened = True
        self.allow(1)  # the pass waiting at the gate, if any

    def close(self):
        """Gate the passes again (call it while the engine is idle)."""
        self._permits, self.opened = threading.Semaphore(0), False


@pytest.fixture
def gated(tiny_model_dir):
    """(engine, gate, base URL): an engine served from a thread, its forward passes gated."""
    engine = make_engine(tiny_model_dir)
    gate = ForwardGate(engine.model)
    with serve_in_thread(engine) as base:
        try:
            yield engine, gate, base
        finally:
            gate.open()
    engine.close()


def send_generate(base, body):
    """A /generate request written on a socket of its own, which the caller closes to disconnect."""
    host, port = base.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"POST /generate HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def stat(engine, name):
    return engine.stats()[name]


MAX_NEW = 40


@pytest.mark.parametrize("seed", range(2))
def test_a_client_that_disconnects_mid_generation_aborts_its_rows(gated, seed):
    """At seeded moments (after k forward passes, the prefill being the first), the client of a single or a
    batched /generate closes its connection: its rows leave the batch before another step."""
    engine, gate, base = gated
    rng = random.Random(seed)
    for _ in range(4):
        prompts = rng.choice([PROMPTS[0], PROMPTS[:3]])
        rows = 3 if isinstance(prompts[0], list) else 1
        passes = rng.randrange(1, MAX_NEW - 1)  # a pass ran: the request is in the engine
        cancelled, aborted = stat(engine, "requests_cancelled"), stat(engine, "requests_aborted")
        start = gate.passed
        sock = send_generate(base, {"input_ids": prompts,
                                    "sampling_params": {"max_new_tokens": MAX_NEW, "ignore_eos": True}})
        try:
            gate.allow(passes)
            gate.wait_passed(start + passes)
        finally:
            sock.close()
        wait_for(lambda: stat(engine, "requests_cancelled") == cancelled + rows, "the engine to hear of the disconnect")
        gate.open()  # the pass already waiting at the gate may finish; none after it
        wait_for(lambda: stat(engine, "requests_aborted") == aborted + rows, "the rows to be aborted")
        wait_for(lambda: engine.stats()["running_requests"] == 0, "the batch to empty")
        assert gate.passed <= start + passes + 1 < start + MAX_NEW, (passes, gate.passed - start)
        assert stat(engine, "requests_failed") == 0
        gate.close()


def test_a_client_that_disconnects_while_its_request_waits_never_runs_it(gated):
    """Held by the engine's pause: a disconnected client's request is aborted without a forward pass."""
    engine, gate, base = gated
    gate.open()
    before = scheduled(engine)
    call(base, "/pause_generation", {})
    sock = send_generate(base, {"input_ids": PROMPTS[:2], "sampling_params": GREEDY})
    try:
        wait_for(lambda: engine.stats()["waiting_requests"] == 2, "the requests to wait in the engine")
    finally:
        sock.close()
    wait_for(lambda: stat(engine, "requests_cancelled") == 2, "the engine to hear of the disconnect")
    call(base, "/continue_generation", {})
    wait_for(lambda: stat(engine, "requests_aborted") == 2, "the requests to be aborted")
    after = scheduled(engine)
    assert after["prefill_batches"] == before["prefill_batches"] and after["decode_steps"] == before["decode_steps"]
    status, answer = call(base, "/generate", {"input_ids": PROMPTS[0], "sampling_params": GREEDY})
    assert status == 200 and len(answer["output_ids"]) == 3  # the engine serves on


def test_a_cancelled_in_process_call_aborts_its_request(tiny_model_dir):
    """The same contract without HTTP: cancelling ``LocalEngine.generate`` aborts the row."""
    engine = make_engine(tiny_model_dir)
    gate = ForwardGate(engine.model)

    async def go():
        task = asyncio.ensure_future(engine.generate(PROMPTS[0], {"max_new_tokens": MAX_NEW, "ignore_eos": True}))
        other = asyncio.ensure_future(engine.generate(PROMPTS[1], GREEDY))
        await asyncio.sleep(0)  # the turn is submitted
        gate.allow(3)
        await asyncio.get_running_loop().run_in_executor(None, gate.wait_passed, 3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.open()
        return await other

    try:
        other = asyncio.run(go())
        wait_for(lambda: engine.stats()["requests_aborted"] == 1, "the row to be aborted")
        assert other["meta_info"]["finish_reason"]["type"] == "length"  # its neighbour ran to its end
        assert engine.stats()["requests_cancelled"] == 1 and gate.passed <= 4
        assert len(other["output_ids"]) == 3
    finally:
        gate.open()
        engine.close()

