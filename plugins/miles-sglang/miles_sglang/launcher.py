"""``python -m sglang.launch_server`` as a Miles engine server, one per engine actor.

The flags are SGLang's (checked against ``sglang.srt.server_args.ServerArgs`` of sglang 0.5.23):
``--model-path --host --port --tp-size --weight-version --random-seed --dtype`` always,
``--mem-fraction-static`` when set, ``--enable-memory-saver`` for a colocated trainer, ``--admin-api-key``
when the run uses an admin token (engines off loopback), then ``extra_args`` as given.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from miles.engine.api import ConfigError, SpeculativeConfig, SubprocessLauncher, mtp_head_names
import miles.precision
from miles.precision import from_spec

__all__ = ["SGLangLauncher", "sglang_argv", "DTYPES", "RESERVED_FLAGS"]

DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")  # SGLang's --dtype choices
# Flags Miles sets itself; extra_args may not repeat them (SGLang would take the last one silently).
RESERVED_FLAGS = ("--model-path", "--model", "--host", "--port", "--tp-size", "--tensor-parallel-size",
                  "--weight-version", "--random-seed", "--dtype", "--mem-fraction-static", "--enable-memory-saver",
                  "--enable-return-routed-experts", "--admin-api-key", "--api-key", "--quantization",
                  "--speculative-algorithm", "--speculative-draft-model-path", "--speculative-num-steps",
                  "--speculative-eagle-topk", "--speculative-num-draft-tokens")
# rollout.precision -> SGLang's --quantization for a checkpoint in that stored form (sglang 0.5: fp8 reads the block-FP8
# layout, weight_scale_inv and weight_block_size; compressed-tensors the pack-quantized and float-quantized formats;
# modelopt_fp4 NVIDIA's NVFP4). MXFP8 has no loader of Miles' stored form in SGLang.
QUANTIZATION = {"fp8_block": "fp8", "fp8_channel": "compressed-tensors", "int4_w4a16": "compressed-tensors",
                "nvfp4": "modelopt_fp4"}


def sglang_argv(model_path: str, *, host: str, port: int, tp_size: int = 1, weight_version: int = 0,
                random_seed: int = 0, dtype: str = "auto", mem_fraction_static: float | None = None,
                enable_memory_saver: bool = False, enable_return_routed_experts: bool = False, admin_token: str = "",
                extra_args: list[str] = (), python: str | None = None, quantization: str | None = None,
                speculative: SpeculativeConfig | None = None) -> list[str]:
    """The command line of one SGLang server."""
    argv = [python or sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_path),
            "--host", host, "--port", str(port), "--tp-size", str(tp_size), "--weight-version", str(weight_version),
            "--random-seed", str(random_seed), "--dtype", dtype]
    if mem_fraction_static is not None:
        argv += ["--mem-fraction-static", str(mem_fraction_static)]
    if enable_memory_saver:
        argv.append("--enable-memory-saver")
    if enable_return_routed_experts:  # requests may then ask for return_routed_experts (R3)
        argv.append("--enable-return-routed-experts")
    if admin_token:  # the admin endpoints (weights, memory, pause, abort) need it; /generate does not
        argv += ["--admin-api-key", admin_token]
    if quantization:  # the model path is then a checkpoint in that stored form (rollout.precision)
        argv += ["--quantization", quantization]
    if speculative is not None:  # one chain of k proposals (top-k 1), k + 1 tokens verified
        if "mtp" in speculative.draft:  # the MTP layers the checkpoint ships, run by SGLang's EAGLE (NEXTN) worker
            argv += ["--speculative-algorithm", "EAGLE"]
        else:  # a separate draft model: SGLang's STANDALONE algorithm
            argv += ["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path",
                     str(speculative.draft["path"])]
        argv += ["--speculative-num-steps", str(speculative.num_tokens), "--speculative-eagle-topk", "1",
                 "--speculative-num-draft-tokens", str(speculative.num_tokens + 1)]
    return argv + [str(a) for a in extra_args]


class SGLangLauncher(SubprocessLauncher):
    """Rollout engine ``sglang``: one SGLang server per engine actor (``rollout.engine.num_engines >= 1``).

    ``tp_size``: GPUs (tensor-parallel ranks) per server; ``mem_fraction_static``: the fraction of GPU memory
    for weights and KV cache (SGLang's default when null); ``dtype``; ``random_seed``; ``enable_memory_saver``:
    needed for ``rollout.engine.release_memory_during_train`` to give memory back (default: follows it);
    ``enable_return_routed_experts``: needed for ``rollout.return_routed_experts`` (default: follows it);
    ``extra_args``: more SGLang flags, passed as given; ``python``: the interpreter with SGLang installed (this
    one by default); ``startup_timeout_s``: how long to wait for ``/health_generate`` (default
    ``cluster.engine_startup_timeout_s``); ``log_dir``: where the server logs go (a temp folder by default);
    ``logprobs_of`` (``rollout.logprobs_of``): ``sampling``, SGLang's default, reports the sampled tokens'
    log-probs at the request's temperature; ``model`` starts the server with ``SGLANG_RETURN_ORIGINAL_LOGPROB``
    (temperature 1). SGLang has no log-probs of the top-p/top-k truncated distribution. ``precision``
    (``rollout.precision``): the server starts from a copy of the model in the scheme's stored form with the matching
    ``--quantization`` (:data:`QUANTIZATION`), and the pushes (on disk) are in that form too. ``speculative``
    (:mod:`miles.engine.speculative`): a draft model directory (``draft: {path: ...}``) run by SGLang's
    ``STANDALONE`` algorithm, or the MTP head the checkpoint ships (``draft: mtp``) by its ``EAGLE`` (NEXTN)
    worker, with ``num_tokens`` proposals a step; SGLang speculates at every step (``when: always``), and its weight
    updates reach the target only (``train: false``)."""

    protocol = "sglang"
    logprobs_of_choices = ("sampling", "model")
    accepts_precision = True
    ready_path = "/health_generate"  # the server answers once it has generated a token
    name = "SGLang server"

    def __init__(self, tp_size: int = 1, mem_fraction_static: float | None = None, dtype: str = "auto",
                 random_seed: int = 0, enable_memory_saver: bool | None = None,
                 enable_return_routed_experts: bool | None = None, extra_args: list[str] | None = None,
                 python: str | None = None, startup_timeout_s: float | None = None, log_dir: str | None = None,
                 stop_timeout_s: float = 30.0, logprobs_of: str = "sampling",
                 precision: dict[str, Any] | None = None, speculative: dict[str, Any] | None = None) -> None:
        self.check_args({"tp_size": tp_size, "mem_fraction_static": mem_fraction_static, "dtype": dtype,
                         "random_seed": random_seed, "extra_args": extra_args or [],
                         "startup_timeout_s": startup_timeout_s, "logprobs_of": logprobs_of, "precision": precision,
                         "speculative": speculative})
        self.speculative = SpeculativeConfig.parse(speculative) if speculative is not None else None
        self.scheme = from_spec(precision) if precision is not None else None
        self._stored_form: str | None = None  # the starting checkpoint in the stored form, removed at stop
        self.logprobs_of = logprobs_of
        super().__init__(startup_timeout_s=startup_timeout_s, stop_timeout_s=stop_timeout_s, log_dir=log_dir)
        self._tp_size = tp_size
        self.mem_fraction_static = mem_fraction_static
        self.dtype = dtype
        self.random_seed = random_seed
        self.enable_memory_saver = enable_memory_saver
        self.enable_return_routed_experts = enable_return_routed_experts
        self.extra_args = [str(a) for a in extra_args or []]
        self.python = python

    @staticmethod
    def check_args(args: dict[str, Any]) -> None:
        """A ValueError naming the argument (Miles' config check calls it before anything starts)."""
        tp = args.get("tp_size", 1)
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tp_size: expected a whole number >= 1 (GPUs per server), got {tp!r}")
        fraction = args.get("mem_fraction_static")
        if fraction is not None and (isinstance(fraction, bool) or not isinstance(fraction, (int, float))
                                     or not 0 < fraction < 1):
            raise ValueError(f"mem_fraction_static: expected a fraction in (0, 1) or null (SGLang's choice), "
                             f"got {fraction!r}")
        if args.get("dtype", "auto") not in DTYPES:
            raise ValueError(f"dtype: expected one of {', '.join(DTYPES)}, got {args.get('dtype')!r}")
        seed = args.get("random_seed", 0)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"random_seed: expected an integer, got {seed!r}")
        extra = args.get("extra_args") or []
        if not isinstance(extra, (list, tuple)):
            raise ValueError(f"extra_args: expected a list of command-line arguments, got {extra!r}")
        taken = sorted({str(a).split("=", 1)[0] for a in extra} & set(RESERVED_FLAGS))
        if taken:
            raise ValueError(f"extra_args: {', '.join(taken)} are set by Miles (use the plugin's arguments: "
                             f"tp_size, mem_fraction_static, dtype, random_seed, enable_memory_saver, "
                             f"enable_return_routed_experts)")
        logprobs_of = args.get("logprobs_of", "sampling")
        if logprobs_of not in SGLangLauncher.logprobs_of_choices:
            raise ValueError(f"logprobs_of (rollout.logprobs_of): SGLang reports log-probs at the request's "
                             f"temperature (sampling) or, with SGLANG_RETURN_ORIGINAL_LOGPROB, the model's own "
                             f"(model); got {logprobs_of!r}")
        if (precision := args.get("precision")) is not None:
            name = from_spec(precision).name
            if name not in QUANTIZATION:
                raise ValueError(f"precision (rollout.precision): SGLang loads {', '.join(QUANTIZATION)} checkpoints "
                                 f"(--quantization {', '.join(sorted(set(QUANTIZATION.values())))}); not {name}")
        if (speculative := args.get("speculative")) is not None:
            spec = SpeculativeConfig.parse(speculative)
            if "build" in spec.draft:
                raise ValueError("speculative.draft: SGLang loads a draft model from a directory ({path: DIR}) or the "
                                 "MTP head the checkpoint ships (mtp); a draft built by Miles is for the local engine")
            if spec.when != "always":
                raise ValueError(f"speculative.when: SGLang speculates at every decode step; set when: always "
                                 f"(got {spec.when})")
            if spec.train:
                raise ValueError("speculative.train: SGLang's weight updates reach the target model only, so the "
                                 "draft it runs cannot follow the policy; train the draft with the local engine")
        timeout = args.get("startup_timeout_s")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
            raise ValueError(f"startup_timeout_s: expected a positive number of seconds or null, got {timeout!r}")

    @property
    def tp_size(self) -> int:
        return self._tp_size

    @property
    def gpus(self) -> float:
        """One GPU per tensor-parallel rank: the engine actor's bundle reserves them."""
        return float(self._tp_size)

    def command(self, model_path: str, *, host: str, port: int, admin_token: str, threads: int) -> list[str]:
        if self.speculative is not None and "mtp" in self.speculative.draft and not mtp_head_names(model_path):
            raise ConfigError(f"speculative.draft: mtp: {model_path} ships no MTP head (layers past "
                              f"num_hidden_layers with num_nextn_predict_layers, or mtp.* tensors); SGLang runs the "
                              f"head a checkpoint ships, the local engine also builds one")
        quantization = None
        if self.scheme is not None:  # SGLang loads the stored form itself, from a checkpoint written in it
            self._stored_form = str(miles.precision.stored_form_copy(model_path, self.scheme,
                                                                     self.stored_form_dir(port)))
            model_path = self._stored_form
            quantization = QUANTIZATION[self.scheme.name]
        return sglang_argv(model_path, host=host, port=port, tp_size=self._tp_size, weight_version=0,
                           random_seed=self.random_seed, dtype=self.dtype,
                           mem_fraction_static=self.mem_fraction_static,
                           enable_memory_saver=bool(self.enable_memory_saver),
                           enable_return_routed_experts=bool(self.enable_return_routed_experts),
                           admin_token=admin_token, extra_args=self.extra_args, python=self.python,
                           quantization=quantization, speculative=self.speculative)

    def missing_packages(self) -> list[str]:
        import importlib.util

        if self.python is None and importlib.util.find_spec("sglang") is None:
            return [f"sglang (pip install 'sglang[all]' into {sys.executable}, or set rollout.engine.python to an "
                    f"interpreter that has it)"]
        if self.python is not None and not os.access(self.python, os.X_OK):
            return [f"the interpreter rollout.engine.python={self.python!r} (not an executable file)"]
        return []

    def stop(self) -> None:
        super().stop()
        if self._stored_form is not None:
            import shutil

            shutil.rmtree(self._stored_form, ignore_errors=True)

    def stored_form_dir(self, port: int) -> str:
        """Where the server's starting checkpoint in the stored form is written (beside its log)."""
        import tempfile

        root = self.log_dir or tempfile.gettempdir()
        return os.path.join(root, f"sglang-{port}-{self.scheme.name}-model")

    def environment(self, *, threads: int, admin_token: str) -> dict[str, str]:
        # /health answers without generating a token: the router's health checks must pass while a colocated
        # trainer holds the GPU (memory released). Readiness is /health_generate, polled at start.
        return {**super().environment(threads=threads, admin_token=admin_token),
                "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "false",
                # the sampled tokens' log-probs before the temperature (rollout.logprobs_of: model)
                "SGLANG_RETURN_ORIGINAL_LOGPROB": "true" if self.logprobs_of == "model" else "false",
                "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}
