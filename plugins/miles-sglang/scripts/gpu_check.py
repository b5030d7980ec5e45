"""The real SGLang server through Miles' launcher and router, on one GPU with SGLang installed.

    python plugins/miles-sglang/scripts/gpu_check.py MODEL_DIR [--out DIR]

Checks, in order (each prints one line, the first failure stops with exit 1): the launcher's argv against
the installed SGLang's own parser; a server started by SGLangLauncher answering /health_generate; /generate
through the router with weight_version "0"; a disk push and a distributed push (the version read back from
meta_info); release/resume of memory with --enable-memory-saver (GPU memory used falls, then returns) and
generation after the push; the server SIGKILLed and a new one started by the same launcher. Writes
timings to OUT/gpu_check.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def gpu_used_mib() -> int:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True).stdout.split()
    return int(out[0]) if out else -1


class Backend:
    def __init__(self, model_dir: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)

    def export_weights(self):
        return self.model.state_dict()

    def save_pretrained(self, path, tokenizer=None, meta=None):
        self.model.save_pretrained(path)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    report: dict = {}

    from sglang.srt.server_args import ServerArgs
    from sglang.version import __version__ as sglang_version

    from miles.rollout.plane import RolloutPlane
    from miles.engine.router import Router
    from miles.weights.transports import DiskTransport, DistributedTransport
    from miles.testing import free_port
    from miles_sglang import SGLangLauncher, sglang_argv

    report["sglang"] = sglang_version
    real = argparse.ArgumentParser()
    ServerArgs.add_cli_args(real)
    argv = sglang_argv(args.model, host="127.0.0.1", port=30000, tp_size=1, random_seed=3, dtype="bfloat16",
                       mem_fraction_static=0.5, enable_memory_saver=True, admin_token="t")
    ns = real.parse_args(argv[3:])
    assert (ns.model_path, ns.tp_size, ns.weight_version, ns.random_seed, ns.dtype, ns.mem_fraction_static,
            ns.enable_memory_saver, ns.admin_api_key) == (args.model, 1, "0", 3, "bfloat16", 0.5, True, "t"), ns
    print(f"ok argv parses with sglang {sglang_version}", flush=True)

    launcher = SGLangLauncher(mem_fraction_static=0.5, dtype="bfloat16", enable_memory_saver=True,
                              log_dir=tempfile.mkdtemp(prefix="miles-sglang-"))
    start = time.perf_counter()
    url = launcher.start(args.model, host="127.0.0.1", port=free_port(), admin_token="", threads=4, timeout_s=420)
    report["start_s"] = time.perf_counter() - start
    print(f"ok server ready in {report['start_s']:.1f} s: {url}", flush=True)
    router = Router([url], health_interval_s=1.0)
    router.engines[0].meta.update(protocol="sglang", tp_size=1)
    plane = RolloutPlane(router=router)
    try:
        async def generate():
            return await router.generate([1, 2, 3, 4], {"max_new_tokens": 8, "temperature": 0}, True)

        answer = plane.run(generate())
        assert len(answer["output_ids"]) == 8 and answer["meta_info"]["weight_version"] == "0", answer["meta_info"]
        print("ok /generate through the router", flush=True)
        backend = Backend(args.model)
        for version, transport in ((1, DiskTransport()), (2, DistributedTransport())):
            start = time.perf_counter()
            transport.push(backend, plane, version=version)
            report[f"push_{type(transport).__name__}_s"] = time.perf_counter() - start
            answer = plane.run(generate())
            assert answer["meta_info"]["weight_version"] == str(version), answer["meta_info"]
            print(f"ok {type(transport).__name__} push, version {version} served", flush=True)
        before = gpu_used_mib()
        plane.post_all("/release_memory_occupation", {"tags": None})
        released = gpu_used_mib()
        plane.post_all("/resume_memory_occupation", {"tags": ["weights"]})
        DiskTransport().push(backend, plane, version=3)
        plane.post_all("/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]})
        after = gpu_used_mib()
        report.update(gpu_mib_before=before, gpu_mib_released=released, gpu_mib_resumed=after)
        assert released < before, report
        assert plane.run(generate())["meta_info"]["weight_version"] == "3"
        print(f"ok release/resume: GPU memory {before} -> {released} -> {after} MiB", flush=True)
        pid = launcher.pid
        os.killpg(pid, signal.SIGKILL)
        for _ in range(300):
            if not launcher.alive():
                break
            time.sleep(0.1)
        assert not launcher.alive()
        url = launcher.start(args.model, host="127.0.0.1", port=free_port(), admin_token="", threads=4, timeout_s=420)
        print(f"ok killed and started again: {url}", flush=True)
    finally:
        plane.close()
        launcher.stop()
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gpu_check.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
