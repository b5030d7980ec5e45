"""The SGLang launcher's arguments, and the server-launcher path it shares with ``miles engine serve``.

SGLang cannot run on a CPU: the process handling (start, readiness, failure with the log's tail, stop,
death and restart on Ray), every weight transport and memory release/resume run here against real
``miles engine serve`` processes started by the same :class:`SubprocessLauncher`; the real server is
checked by ``scripts/gpu_check.sh``.
"""

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
import torch

from miles.errors import ConfigError, RunError
from miles.models.hf import load_model
from miles.engine.launchers import MilesServerLauncher, SubprocessLauncher
from miles.hookspecs import is_server_launcher
from miles.rollout.plane import RolloutPlane
from miles.engine.router import Router
from miles.run.runner import prepare
from miles_sglang import SGLangLauncher, sglang_argv
from miles.testing import free_port


def call(url, path, body=None, token=""):
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} if data is not None else {}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url + path, data=data, headers=headers, method="GET" if data is None else "POST")
    try:
        with urllib.request.urlopen(request, timeout=120) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead
        return f.read().split(")")[-1].split()[0] != "Z"


# -- arguments ---------------------------------------------------------------------------------------


def test_argv_has_sglangs_flags_and_values():
    argv = sglang_argv("/models/qwen", host="10.0.0.2", port=31000, tp_size=2, random_seed=7, dtype="bfloat16",
                       mem_fraction_static=0.6, enable_memory_saver=True, enable_return_routed_experts=True,
                       admin_token="tok", extra_args=["--log-level", "warning"], python="/opt/sglang/bin/python")
    assert argv == ["/opt/sglang/bin/python", "-m", "sglang.launch_server", "--model-path", "/models/qwen",
                    "--host", "10.0.0.2", "--port", "31000", "--tp-size", "2", "--weight-version", "0",
                    "--random-seed", "7", "--dtype", "bfloat16", "--mem-fraction-static", "0.6",
                    "--enable-memory-saver", "--enable-return-routed-experts", "--admin-api-key", "tok",
                    "--log-level", "warning"]


def test_argv_leaves_out_what_is_not_set():
    argv = sglang_argv("/m", host="127.0.0.1", port=30000)
    assert argv[1:] == ["-m", "sglang.launch_server", "--model-path", "/m", "--host", "127.0.0.1", "--port", "30000",
                        "--tp-size", "1", "--weight-version", "0", "--random-seed", "0", "--dtype", "auto"]


def test_launcher_builds_its_command_and_environment():
    launcher = SGLangLauncher(tp_size=4, mem_fraction_static=0.5, enable_memory_saver=True,
                              extra_args=["--trust-remote-code"])
    argv = launcher.command("/m", host="127.0.0.1", port=1234, admin_token="", threads=2)
    assert (argv[argv.index("--tp-size") + 1] == "4" and "--enable-memory-saver" in argv
            and argv[-1] == "--trust-remote-code")
    assert "--admin-api-key" not in argv
    env = launcher.environment(threads=2, admin_token="")
    assert env["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] == "false" and env["OMP_NUM_THREADS"] == "2"
    assert launcher.ready_path == "/health_generate" and launcher.protocol == "sglang" and launcher.tp_size == 4
    assert is_server_launcher(SGLangLauncher) and not is_server_launcher(object)


def test_rollout_logprobs_of_reaches_sglang_as_its_environment_switch():
    """SGLang reports log-probs at the request's temperature unless SGLANG_RETURN_ORIGINAL_LOGPROB is set."""
    for logprobs_of, value in (("sampling", "false"), ("model", "true")):
        env = SGLangLauncher(logprobs_of=logprobs_of).environment(threads=1, admin_token="")
        assert env["SGLANG_RETURN_ORIGINAL_LOGPROB"] == value


@pytest.mark.parametrize("name, flag, stored", [
    ("fp8_block", "fp8", "weight_scale_inv"), ("int4_w4a16", "compressed-tensors", "weight_packed"),
    ("nvfp4", "modelopt_fp4", "weight_scale_2"),
])
def test_rollout_precision_starts_sglang_on_the_stored_form_with_its_quantization_flag(name, flag, stored,
                                                                                       tiny_model_dir, tmp_path):
    """SGLang loads quantized checkpoints itself: the server starts from a copy of the model in the scheme's stored
    form (the layout and config block its --quantization reads), removed when it stops."""
    from safetensors import safe_open

    from miles.precision import BUILTIN_SCHEMES

    pytest.importorskip("torchao")
    launcher = SGLangLauncher(precision=BUILTIN_SCHEMES[name]().spec(), log_dir=str(tmp_path))
    argv = launcher.command(str(tiny_model_dir), host="127.0.0.1", port=1234, admin_token="", threads=1)
    assert argv[argv.index("--quantization") + 1] == flag
    model = argv[argv.index("--model-path") + 1]
    assert model != str(tiny_model_dir) and model.startswith(str(tmp_path))
    config = json.load(open(os.path.join(model, "config.json")))["quantization_config"]
    assert config["miles_precision"]["scheme"]["path"].endswith(type(BUILTIN_SCHEMES[name]()).__name__)
    with safe_open(os.path.join(model, "model.safetensors"), "pt") as f:
        assert f"model.layers.0.mlp.down_proj.{stored}" in f.keys()
    launcher.stop()
    assert not os.path.exists(model)
    with pytest.raises(ValueError, match="SGLang loads fp8_block, fp8_channel, int4_w4a16, nvfp4 checkpoints"):
        SGLangLauncher(precision=BUILTIN_SCHEMES["mxfp8"]().spec())
    with pytest.raises(ValueError, match="--quantization are set by Miles"):
        SGLangLauncher(extra_args=["--quantization", "fp8"])


def test_a_speculative_draft_starts_sglang_with_its_standalone_flags(tiny_model_dir, tmp_path):
    """rollout.engine.speculative with SGLang: the draft directory, k proposals in one chain (top-k 1, k + 1 draft
    tokens verified); what SGLang cannot do (a draft built by Miles, the tail only, a draft that trains) is refused."""
    spec = {"draft": {"path": str(tmp_path / "draft")}, "num_tokens": 3, "when": "always"}
    argv = SGLangLauncher(speculative=spec).command(str(tiny_model_dir), host="127.0.0.1", port=1234,
                                                    admin_token="", threads=1)
    flags = {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--speculative")}
    assert flags == {"--speculative-algorithm": "STANDALONE", "--speculative-draft-model-path": spec["draft"]["path"],
                     "--speculative-num-steps": "3", "--speculative-eagle-topk": "1",
                     "--speculative-num-draft-tokens": "4"}
    assert "--speculative-algorithm" not in SGLangLauncher().command(str(tiny_model_dir), host="127.0.0.1",
                                                                     port=1234, admin_token="", threads=1)
    for bad, message in (({**spec, "when": "tail"}, "set when: always"),
                         ({**spec, "train": True}, "reach the target model only"),
                         ({**spec, "draft": {"build": {"num_layers": 1}}}, "SGLang loads a draft model from a dir"),
                         ({**spec, "num_tokens": 0}, r"num_tokens: expected an integer in \[1, 16\]")):
        with pytest.raises(ValueError, match=message):
            SGLangLauncher(speculative=bad)
    with pytest.raises(ValueError, match="--speculative-algorithm are set by Miles"):
        SGLangLauncher(extra_args=["--speculative-algorithm", "EAGLE"])


def test_an_mtp_draft_starts_sglang_with_its_eagle_flags_on_the_heads_checkpoint(tiny_model_dir, tmp_path):
    """``draft: mtp`` with SGLang: the EAGLE (NEXTN) worker runs the MTP layers the checkpoint ships, one chain of
    k proposals; a checkpoint that ships no head is refused naming it (only the local engine builds one)."""
    import json
    import shutil

    from safetensors.torch import save_file

    from miles.errors import ConfigError
    from miles.models.hf import load_model_config
    from miles.models.mtp import build_head, published_tensors

    spec = {"draft": "mtp", "num_tokens": 2, "when": "always"}
    with pytest.raises(ConfigError, match="ships no MTP head"):
        SGLangLauncher(speculative=spec).command(str(tiny_model_dir), host="127.0.0.1", port=1234, admin_token="",
                                                 threads=1)
    model = shutil.copytree(tiny_model_dir, tmp_path / "with_head")
    config = json.loads((model / "config.json").read_text())
    head = build_head(load_model_config(model), seed=0)
    save_file(published_tensors(head, config["num_hidden_layers"]), str(model / "mtp.safetensors"))
    (model / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    argv = SGLangLauncher(speculative=spec).command(str(model), host="127.0.0.1", port=1234, admin_token="",
                                                    threads=1)
    flags = {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--speculative")}
    assert flags == {"--speculative-algorithm": "EAGLE", "--speculative-num-steps": "2",
                     "--speculative-eagle-topk": "1", "--speculative-num-draft-tokens": "3"}
    with pytest.raises(ValueError, match="reach the target model only"):
        SGLangLauncher(speculative={**spec, "train": True})


@pytest.mark.parametrize("args, message", [
    ({"tp_size": 0}, "tp_size"), ({"mem_fraction_static": 1.5}, "mem_fraction_static"), ({"dtype": "fp8"}, "dtype"),
    ({"extra_args": ["--port", "1"]}, "--port are set by Miles"), ({"extra_args": "--x"}, "extra_args"),
    ({"logprobs_of": "truncated"}, "SGLang reports log-probs at the request's temperature"),
])
def test_bad_arguments_are_refused_naming_them(args, message):
    with pytest.raises(ValueError, match=message):
        SGLangLauncher(**args)


def test_sglang_without_engines_over_http_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"rollout.engine.num_engines: engine 'sglang' runs as a server"):
        prepare("configs/quickstart.yaml" if os.path.exists("configs/quickstart.yaml") else _quickstart(),
                [f"run.dir={tmp_path}", "rollout.engine.name=sglang"])


def test_sglang_arguments_are_checked_with_the_config(tmp_path):
    with pytest.raises(ConfigError, match="mem_fraction_static"):
        prepare(_quickstart(), [f"run.dir={tmp_path}", "rollout.engine.name=sglang", "rollout.engine.num_engines=1",
                                "+rollout.engine.mem_fraction_static=2"])


def test_release_memory_needs_the_sync_schedule(tmp_path):
    with pytest.raises(ConfigError, match="release_memory_during_train.*needs run.schedule sync"):
        prepare(_quickstart(), [f"run.dir={tmp_path}", "rollout.engine.num_engines=1", "run.schedule=async",
                                "rollout.engine.release_memory_during_train=true"])


def _quickstart():
    from pathlib import Path

    import miles

    return str(Path(miles.__file__).resolve().parent.parent / "configs" / "quickstart.yaml")


# -- the process: start, serve, stop, fail -------------------------------------------------------------


def test_launch_health_generate_stop(tiny_model_dir, tmp_path):
    launcher = MilesServerLauncher(log_dir=str(tmp_path))
    url = launcher.start(str(tiny_model_dir), host="127.0.0.1", port=free_port(), admin_token="s3cret", threads=1,
                         timeout_s=120)
    pid = launcher.pid
    try:
        assert launcher.alive()
        assert call(url, "/health")[0] == 200 and call(url, "/health_generate")[0] == 200
        status, answer = call(url, "/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 3},
                                                  "return_logprob": True})
        assert status == 200 and len(answer["output_ids"]) == 3
        assert call(url, "/flush_cache", {})[0] == 401  # the admin token reached the server (not through argv)
        assert "s3cret" not in " ".join(launcher.argv)
        assert launcher.describe()["log"].startswith(str(tmp_path))
    finally:
        launcher.stop()
    assert not launcher.alive() and not alive(pid)


def test_the_served_engine_reports_the_distribution_the_launcher_names(tiny_model_dir, tmp_path):
    """``miles engine serve --logprobs-of``: the launcher passes rollout.logprobs_of to the process it starts."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    for logprobs_of, temperature in (("model", 1.0), ("sampling", 0.5)):
        launcher = MilesServerLauncher(log_dir=str(tmp_path), logprobs_of=logprobs_of)
        url = launcher.start(str(tiny_model_dir), host="127.0.0.1", port=free_port(), admin_token="", threads=1,
                             timeout_s=120)
        try:
            status, answer = call(url, "/generate", {"input_ids": [1, 2, 3], "return_logprob": True,
                                                      "sampling_params": {"max_new_tokens": 1, "temperature": 0.5}})
        finally:
            launcher.stop()
        assert status == 200 and launcher.argv[launcher.argv.index("--logprobs-of") + 1] == logprobs_of
        [(logprob, token, _)] = answer["meta_info"]["output_token_logprobs"]
        import torch

        with torch.no_grad():
            logits = reference(input_ids=torch.tensor([[1, 2, 3]])).logits[0, -1].float()
        assert abs(logprob - float((logits / temperature).log_softmax(-1)[token])) < 1e-4


class ExitingServer(SubprocessLauncher):
    name = "exiting server"

    def command(self, model_path, *, host, port, admin_token, threads):
        return [sys.executable, "-c", "import sys; print('loading weights ...'); print('CUDA out of memory', "
                                      "file=sys.stderr); sys.exit(3)"]


class SilentServer(SubprocessLauncher):
    """Never answers: a shell that starts a child of its own and waits (both must be gone after stop)."""

    name = "silent server"

    def command(self, model_path, *, host, port, admin_token, threads):
        return ["sh", "-c", "sleep 300 & echo child $!; wait"]


def test_a_server_that_exits_early_fails_with_its_log(tmp_path):
    launcher = ExitingServer(log_dir=str(tmp_path))
    with pytest.raises(RunError, match=r"(?s)exiting server exited with code 3 before it answered /health.*"
                                        r"CUDA out of memory"):
        launcher.start("/m", host="127.0.0.1", port=free_port(), admin_token="", threads=1, timeout_s=60)
    assert not launcher.alive()


def test_a_command_that_does_not_exist_fails_clearly(tmp_path):
    launcher = SGLangLauncher(python=str(tmp_path / "no-such-python"), log_dir=str(tmp_path))
    with pytest.raises(RunError, match="SGLang server: could not run"):
        launcher.start("/m", host="127.0.0.1", port=free_port(), admin_token="", threads=1, timeout_s=60)


def test_sglang_missing_fails_with_the_servers_log(tmp_path):
    """This machine has no SGLang: the real command fails, and the error shows why."""
    if subprocess.run([sys.executable, "-c", "import sglang"], capture_output=True).returncode == 0:
        pytest.skip("SGLang is installed here")
    launcher = SGLangLauncher(log_dir=str(tmp_path))
    with pytest.raises(RunError, match=r"(?s)SGLang server exited with code 1 .*No module named 'sglang'"):
        launcher.start("/m", host="127.0.0.1", port=free_port(), admin_token="", threads=1, timeout_s=60)


def test_a_server_that_never_answers_is_stopped_with_its_children(tmp_path):
    launcher = SilentServer(startup_timeout_s=2, stop_timeout_s=5, log_dir=str(tmp_path))
    with pytest.raises(RunError, match=r"(?s)did not answer /health within 2 s.*child \d+"):
        launcher.start("/m", host="127.0.0.1", port=free_port(), admin_token="", threads=1, timeout_s=60)
    child = int(open(launcher.log_path).read().split("child ")[1].split()[0])
    assert not alive(launcher.pid) and not alive(child)


# -- weights and memory through a launched server ------------------------------------------------------


class FakeBackend:
    """What a transport reads of a backend: the weights, or a checkpoint of them."""

    def __init__(self, model_dir, seed):
        self.model = load_model(model_dir)
        torch.manual_seed(seed)
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(torch.randn_like(p) * 0.1)

    def export_weights(self):
        return self.model.state_dict()

    def save_pretrained(self, path, tokenizer=None, meta=None):
        self.model.save_pretrained(path)


@pytest.fixture
def launched(tiny_model_dir, tmp_path):
    launcher = MilesServerLauncher(log_dir=str(tmp_path))
    url = launcher.start(str(tiny_model_dir), host="127.0.0.1", port=free_port(), admin_token="", threads=1,
                         timeout_s=120)
    router = Router([url], health_interval_s=0.2)
    plane = RolloutPlane(router=router)
    yield launcher, url, plane
    plane.close()
    launcher.stop()


def greedy(url):
    status, answer = call(url, "/generate", {"input_ids": [1, 2, 3], "return_logprob": True,
                                             "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    return status, answer


@pytest.mark.parametrize("name", ["tensor", "disk", "distributed", "shm", "auto"])
def test_every_weight_transport_reaches_the_launched_server(launched, tiny_model_dir, name):
    from miles.testing import make_registry

    launcher, url, plane = launched
    transport = make_registry().build("weight_transport", {"name": name}, "rollout.weight_sync")
    backend = FakeBackend(tiny_model_dir, seed=1)
    try:
        transport.push(backend, plane, version=3)
    finally:
        getattr(transport, "close", lambda: None)()
    assert call(url, "/health")[1]["weight_version"] == 3 and plane.weight_version == 3
    status, answer = greedy(url)
    assert status == 200 and answer["meta_info"]["weight_version"] == 3


def test_transports_refuse_sglang_servers_naming_the_alternatives(launched, tiny_model_dir):
    from miles.weights.transports import SharedMemoryTransport, TensorTransport

    _, _, plane = launched
    plane.router.engines[0].meta["protocol"] = "sglang"  # as launch_engines marks an SGLang server
    for transport in (TensorTransport(), SharedMemoryTransport()):
        with pytest.raises(ConfigError, match="cannot update SGLang servers.*Use disk .* or distributed"):
            transport.push(FakeBackend(tiny_model_dir, seed=1), plane, version=1)


def test_weight_versions_go_as_strings_and_answers_without_one_are_understood(launched, tiny_model_dir, tmp_path):
    """SGLang's weight_version is a string, and it answers updates with {success, message} only."""
    _, url, plane = launched
    backend = FakeBackend(tiny_model_dir, seed=2)
    backend.save_pretrained(tmp_path / "v5")

    async def post():
        engine = plane.router.engines[0]
        engine.weight_version = -1
        await plane.router.post(engine, "/update_weights_from_disk", {"model_path": str(tmp_path / "v5"),
                                                                       "weight_version": "5"})
        return engine.weight_version

    assert plane.run(post()) == 5


def test_memory_release_and_resume(launched, tiny_model_dir):
    launcher, url, plane = launched
    assert greedy(url)[0] == 200
    assert call(url, "/release_memory_occupation", {"tags": ["bogus"]})[0] == 400
    assert call(url, "/release_memory_occupation", {"tags": None}) == (
        200, {"success": True, "released": ["cuda_graph", "kv_cache", "weights"]})
    status, answer = greedy(url)
    assert status == 503 and "release_memory_occupation" in answer["error"]
    assert call(url, "/health")[0] == 200 and call(url, "/health_generate")[0] == 503  # alive, not ready
    assert call(url, "/resume_memory_occupation", {"tags": ["weights"]})[0] == 200
    status, answer = greedy(url)
    assert status == 503 and "released (cuda_graph, kv_cache" in answer["error"]
    assert call(url, "/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]})[0] == 200
    status, answer = greedy(url)
    assert status == 503 and "push weights first" in answer["error"]  # resumed weights hold nothing
    from miles.weights.transports import TensorTransport

    TensorTransport().push(FakeBackend(tiny_model_dir, seed=3), plane, version=1)
    status, answer = greedy(url)
    assert status == 200 and answer["meta_info"]["weight_version"] == 1
    assert call(url, "/resume_memory_occupation", {"tags": ["weights"]})[0] == 400  # not released


def test_pause_in_place_holds_requests_and_abort_mode_ends_them(launched):
    _, url, plane = launched
    assert call(url, "/pause_generation", {"mode": "nope"})[0] == 400
    assert call(url, "/pause_generation", {"mode": "in_place"})[0] == 200
    assert call(url, "/continue_generation", {})[0] == 200
    assert greedy(url)[0] == 200


# -- on Ray: the server dies, the actor dies, Ray restarts it ------------------------------------------


@pytest.mark.slow
def test_server_killed_restarts_its_actor_and_is_caught_up(ray_cluster, tiny_model_dir):
    from miles.engine.ray_actors import launch_engines, shutdown_engines
    from miles.weights.transports import TensorTransport

    ray = ray_cluster.ray
    router, actors, group, _ = launch_engines(ray, 1, str(tiny_model_dir), MilesServerLauncher(), cpus_per_engine=1,
                                              multi_node=False, startup_timeout_s=120,
                                              router_args={"health_interval_s": 0.2})
    plane = RolloutPlane(router=router)
    transport = TensorTransport()
    router.on_readmit = lambda endpoint: transport.catch_up(plane, endpoint)
    try:
        plane.run(router.wait_healthy(timeout_s=120))
        transport.push(FakeBackend(tiny_model_dir, seed=4), plane, version=2)
        info = ray.get(actors[0].describe.remote())
        actor_pid = ray.get(actors[0].pid.remote())
        assert info["protocol"] == "miles" and alive(info["pid"])
        os.kill(info["pid"], signal.SIGKILL)

        async def generate():  # waits for the engine to come back, caught up
            return await router.generate([1, 2, 3], {"max_new_tokens": 2}, True)

        answer = plane.run(generate(), timeout_s=300)
        assert answer["meta_info"]["weight_version"] == 2
        assert router.stats["engine_failures"] == 1 and router.stats["readmissions"] == 1
        new = ray.get(actors[0].describe.remote())
        assert new["pid"] != info["pid"] and ray.get(actors[0].pid.remote()) != actor_pid
        assert not alive(actor_pid)
    finally:
        plane.close()
        shutdown_engines(ray, actors, group)
    # the actor was killed: its server went with it
    for _ in range(600):
        if not alive(new["pid"]):
            break
        import time

        time.sleep(0.1)
    assert not alive(new["pid"])


@pytest.mark.slow
def test_quickstart_with_a_server_per_engine_and_memory_released_during_training(tmp_path):
    from miles.run.runner import train

    summary = train(prepare(_quickstart(), [
        f"run.dir={tmp_path}", "run.progress=false", "run.steps=4", "sft.steps=0", "run.eval_size=0",
        "rollout.engine.name=miles_server", "rollout.engine.num_engines=1",
        "rollout.engine.release_memory_during_train=true", "rollout.prompts_per_step=4", "rollout.n_samples=4",
        "cluster.num_cpus=2"]))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if "reward/mean" in line]
    assert [r["weight_version"] for r in rows] == [1, 2, 3, 4]
    assert all(r["samples/failed"] == 0 and r["rollout/engine_failures"] == 0 for r in rows)
    assert summary["final_model"]


@pytest.mark.slow
def test_an_engine_reserves_a_gpu_per_tensor_parallel_rank(ray_cluster, tiny_model_dir):
    """An SGLang server's bundle asks Ray for tp_size GPUs: on a cluster without them, placement fails clearly
    (no server is started)."""
    from miles.errors import RunError
    from miles.engine.ray_actors import launch_engines

    launcher = SGLangLauncher(tp_size=2)
    assert launcher.gpus == 2.0
    with pytest.raises(RunError, match=r"'GPU': 2.0.*GPU=0"):
        launch_engines(ray_cluster.ray, 1, str(tiny_model_dir), launcher, cpus_per_engine=1, multi_node=False,
                       startup_timeout_s=2, router_args={})
