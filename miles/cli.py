"""The ``miles`` command line."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from miles import __version__, interrupts
from miles.engine.router_cli import add_router_commands
from miles.errors import ConfigError, MilesError, RunError, disk_problem
from miles.interrupts import Terminated

__all__ = ["main"]


def _cmd_train(args: argparse.Namespace) -> int:
    from miles.config.prepared import prepare
    from miles.run.settings import check_settings

    prepared = None
    try:
        with interrupts.handling():
            prepared = prepare(args.config, args.overrides)
            # What `miles config` checks, before torch and transformers are imported: a misspelt key, a refused
            # pair of options or an unusable run directory is reported in a second, not after the imports
            check_settings(prepared)
            from miles.run.runner import train

            train(prepared)
    except BaseException as exc:
        interrupted = interrupts.interruption(exc)
        if interrupted is None:
            raise
        if prepared is not None:  # the run's last checkpoint, and how to continue from it
            from pathlib import Path

            from miles.run.checkpoint import resume_hint

            run = prepared.config.run
            print(resume_hint(Path(run.dir), int(run.save_every), ["miles", "train", args.config, *args.overrides]),
                  file=sys.stderr)
        raise interrupted from None
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    """The eval section's datasets on a trained model: one line per metric, or JSON. What can be checked without
    the model or the data (the config, the files it names, the model's folder) is, before torch is imported."""
    from miles.config.prepared import prepare
    from miles.run.settings import check_eval_paths

    p = prepare(args.config, args.overrides)
    check_eval_paths(p.config, args.model)
    from miles.run.runner import evaluate_model

    with interrupts.handling():
        metrics = evaluate_model(p, args.model)
    if args.json:
        print(json.dumps(metrics, indent=1))
    else:
        width = max(map(len, metrics))
        for key, value in metrics.items():
            print(f"{key.ljust(width)}  {value:.4f}" if isinstance(value, float) else f"{key.ljust(width)}  {value}")
    return 0


def _cmd_config(args: argparse.Namespace) -> int:
    """The resolved config, validated: its keys and values, the plugins it names and their arguments, the backend's
    options, the run directory. With ``--check``, also every check ``miles train`` makes before it starts (model,
    tokenizer, data, checkpoint to resume from), which imports torch and transformers. Nothing is written."""
    from miles.config.prepared import prepare
    from miles.run.settings import check_settings, shown_config

    p = prepare(args.config, args.overrides)
    if args.check or args.target:
        from miles.registry import plugin_stack
        from miles.run.placement import Target
        from miles.run.preflight import preflight

        target = Target.read(args.target) if args.target else None
        preflight(p, plugin_stack(p.pm, p.registry), target).discard()
    else:
        check_settings(p)
    print(shown_config(p.config), end="")
    return 0


def _cmd_plugins(args: argparse.Namespace) -> int:
    from miles.plugins import build_plugin_manager
    from miles.registry import Registry
    from miles.registry import plugin_stack

    pm = build_plugin_manager()
    stack = plugin_stack(pm, Registry.from_plugin_manager(pm))
    if args.json:
        print(json.dumps(stack, indent=1))
        return 0
    rows = [("plugin", "version", "module", "registered")]
    for plugin in stack:
        registered = "; ".join(f"{kind}: {', '.join(names)}" for kind, names in plugin["registered"].items())
        rows.append((plugin["name"], plugin["version"], plugin["module"], registered or "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[3])
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from miles.run.report import write_report

    report = write_report(args.run_dir, args.out)
    print(f"wrote {len(report.plots)} plot(s) and {report.index}")
    for name, why in report.skipped.items():
        print(f"  skipped {name}: {why}")
    return 0


def _cmd_view(args: argparse.Namespace) -> int:
    from miles.run.viewer_server import serve

    serve(args.run_dir, host=args.host, port=args.port)
    return 0


def _cmd_replay(args: argparse.Namespace) -> int:
    from miles.run.replay import replay

    with interrupts.handling():
        replay(args.run_dir, args.overrides, out=args.out, steps=args.steps, overwrite=args.overwrite)
    return 0


def _precision(text: str) -> dict[str, Any]:
    """``--precision``: a builtin scheme's name, or a scheme's spec as JSON."""
    from miles.precision.schemes import BUILTIN_SCHEMES

    if text in BUILTIN_SCHEMES:
        return BUILTIN_SCHEMES[text]().spec()
    try:
        spec = json.loads(text)
    except json.JSONDecodeError:
        spec = None
    if not isinstance(spec, dict):
        raise ConfigError(f"--precision: expected one of {', '.join(BUILTIN_SCHEMES)} or a JSON scheme spec "
                          f"({{\"path\": \"module:Class\", \"args\": {{...}}}}), got {text!r}")
    return spec


def _engine_args(text: str) -> dict[str, Any]:
    """``--engine-args``: a JSON object of the engine's arguments."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--engine-args: expected a JSON object, got {text!r} ({exc})") from exc
    if not isinstance(value, dict):
        raise ConfigError(f"--engine-args: expected a JSON object of the engine's arguments, got {text!r}")
    return value


def _cmd_engine_serve(args: argparse.Namespace) -> int:
    from pathlib import Path

    from miles.engine.server import serve

    if not (Path(args.model) / "config.json").is_file():
        raise ConfigError(f"--model {args.model!r} is not an HF model directory (no config.json there)")
    token = args.admin_token or os.environ.get("MILES_ADMIN_TOKEN", "")
    try:
        serve(args.model, host=args.host, port=args.port, seed=args.seed, admin_token=token, device=args.device,
              dtype=args.dtype, max_request_bytes=int(args.max_request_mib * 2**20),
              max_weight_request_bytes=int(args.max_weight_request_mib * 2**20), allowed_hosts=tuple(args.allowed_host),
              engine_args={"logprobs_of": args.logprobs_of, **_engine_args(args.engine_args),
                           **({"precision": _precision(args.precision)} if args.precision else {})})
    except (ValueError, TypeError) as exc:
        raise ConfigError(str(exc)) from exc
    return 0


def _cmd_session_serve(args: argparse.Namespace) -> int:
    from pathlib import Path

    from miles.plugins import build_plugin_manager
    from miles.registry import Registry
    from miles.session.server import serve

    if not (Path(args.model) / "config.json").is_file():
        raise ConfigError(f"--model {args.model!r} is not an HF model directory (no config.json there)")
    if not 0 <= args.port < 65536:
        raise ConfigError(f"--port {args.port}: expected a port number in [0, 65535] (0: any free port)")
    parser = Registry.from_plugin_manager(build_plugin_manager()).get("tool_parser", args.tool_parser,
                                                                      where="--tool-parser").obj()
    try:
        with interrupts.handling():
            serve(args.model, host=args.host, port=args.port, tool_parser=parser, seed=args.seed)
    except ValueError as exc:  # e.g. a tokenizer without a chat template
        raise ConfigError(str(exc)) from exc
    except OSError as exc:  # the address is taken, or not this machine's
        raise ConfigError(f"--host {args.host} --port {args.port}: cannot listen there: {exc}") from exc
    return 0


def _cmd_chat_format_check(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from miles.agentic.chat_check import check_format
    from miles.agentic.chat_format import bind, generation_eos_ids, resolve
    from miles.models.hf import read_chat_template
    from miles.plugins import build_plugin_manager
    from miles.registry import Registry

    registry = Registry.from_plugin_manager(build_plugin_manager())
    formats = {name: registry.get("chat_format", name).obj for name in registry.names("chat_format")}
    if args.chat_format != "auto" and args.chat_format not in formats:
        registry.get("chat_format", args.chat_format, where="--chat-format")  # the error lists the names
    try:
        kwargs = json.loads(args.template_kwargs)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--template-kwargs: expected a JSON object, got {args.template_kwargs!r} ({exc})") from exc
    if not isinstance(kwargs, dict):
        raise ConfigError(f"--template-kwargs: expected a JSON object, got {args.template_kwargs!r}")
    if args.path is not None:
        from transformers import AutoTokenizer

        if not Path(args.path).is_dir():
            raise ConfigError(f"{args.path!r} is not a directory with a tokenizer (or a model directory)")
        try:
            tokenizer = AutoTokenizer.from_pretrained(args.path)
        except Exception as exc:
            raise ConfigError(f"{args.path!r}: cannot load a tokenizer from it: {type(exc).__name__}: {exc}") from exc
    elif args.vocabulary is not None:
        from miles.models.vocabularies import build_bpe_tokenizer

        if args.chat_format == "auto":
            raise ConfigError("--vocabulary: name the format to check on it with --chat-format")
        fmt = formats[args.chat_format]
        tokenizer = build_bpe_tokenizer(args.vocabulary, (*fmt.identify, *fmt.all_stop_tokens))
    else:
        raise ConfigError("give a tokenizer or model directory, or --vocabulary qwen|deepseek with --chat-format")
    template = read_chat_template(args.chat_template, "--chat-template") if args.chat_template else None
    try:
        fmt, line = resolve(formats, args.chat_format, tokenizer)
        if fmt is None:
            raise ValueError(f"{line}; name one with --chat-format ({', '.join(formats)})")
        options = dict(template_kwargs=kwargs, eos_ids=generation_eos_ids(args.path) if args.path else (),
                       build_parser=lambda kind, name: registry.build(kind, {"name": name}, f"chat format {fmt.name}"))
        bound = bind(fmt, tokenizer, template=template, **options)
        # the turns as a model of the family writes them: its training template's layout (else the tokenizer's own)
        model = bind(fmt, tokenizer, **options) if template else bound
    except (KeyError, ValueError) as exc:
        raise ConfigError(str(exc)) from exc
    print(line)
    if model is not bound:
        source = f"the shipped template {fmt.template!r}" if fmt.template else "the tokenizer's own template"
        print(f"turns generated as {source} writes them; rendered with --chat-template {args.chat_template}")
    results = check_format(bound, model=model)
    width = max(len(r.scenario) for r in results)
    for r in results:
        status = f"skipped ({r.skipped})" if r.skipped else "exact" if r.exact else f"MISMATCH {r.detail}"
        print(f"  {r.scenario:<{width}}  {status}")
        for problem in r.parse_problems:
            print(f"  {'':<{width}}  parse: {problem}")
    bad = [r.scenario for r in results if not r.ok]
    print(f"{len(results) - len(bad)} of {len(results)} scenarios exact" + (f"; not: {', '.join(bad)}" if bad else ""))
    return 1 if bad else 0


def _cmd_sandbox_gc(args: argparse.Namespace) -> int:
    """Delete the hosted sandboxes a run (or every Miles run) left behind, found by their tags."""
    import asyncio

    from miles.plugins import build_plugin_manager
    from miles.registry import Registry

    registry = Registry.from_plugin_manager(build_plugin_manager())
    sandbox_cls = registry.get("sandbox", args.name, where="miles sandbox gc NAME").obj
    if not hasattr(sandbox_cls, "gc"):
        raise ConfigError(f"sandbox {args.name!r} keeps nothing after a run (it has no gc); hosted sandboxes do")
    try:
        deleted = asyncio.run(sandbox_cls.gc(run_id=args.run))
    except Exception as exc:
        raise RunError(f"miles sandbox gc {args.name}: {type(exc).__name__}: {exc}") from exc
    which = f"run {args.run}" if args.run else "any Miles run"
    print(f"deleted {len(deleted)} {args.name} sandbox(es) tagged by {which}" + "".join(f"\n  {i}" for i in deleted))
    return _done_without_finalizing(0)


def _done_without_finalizing(code: int) -> int:
    """As the ``miles`` process: flush and exit at once. A sandbox SDK's client left a native thread that, under
    load, aborted the interpreter's finalization (SIGABRT, exit -6) after the work was done and printed (seen with
    the E2B SDK, about 1 run in 10 on a busy machine; the thread has no Python frame). In-process callers get the
    code back."""
    main_spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if main_spec is not None and main_spec.name == "miles.__main__":
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _cmd_fleet(args: argparse.Namespace) -> int:
    """Ask a running run for a number of engines; it joins or drains engines before its next step."""
    from miles.engine.ray_fleet import request_engines

    path = request_engines(args.run_dir, args.engines)
    print(f"wrote {path}: the run scales to {args.engines} engine(s) before its next step (engines on Ray only)")
    return 0


def _cmd_new(args: argparse.Namespace) -> int:
    """A plugin package to start from: pyproject with the entry point, the plugin module, its tests, a README."""
    from miles.scaffold import new_plugin

    print(new_plugin(args.name, args.kind, args.dir).summary())
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="miles", description="RL post-training of language models.")
    parser.add_argument("--version", action="version", version=f"miles {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="run SFT warm-up (if configured) and RL training from a YAML config")
    train.add_argument("config", help="YAML config file, e.g. configs/quickstart.yaml")
    train.add_argument("overrides", nargs="*", help="key=value overrides, e.g. run.steps=50 reward.name=my_reward")
    train.set_defaults(func=_cmd_train)

    evaluate = sub.add_parser("eval", help="evaluate a model on the config's eval datasets (mean@n, pass@k)")
    evaluate.add_argument("config", help="YAML config file: its eval section, data, engine, rollout function, reward")
    evaluate.add_argument("overrides", nargs="*", help="key=value overrides, e.g. eval.datasets[0].n=8")
    evaluate.add_argument("--model", required=True, metavar="DIR",
                          help="an HF model directory, e.g. RUN_DIR/final_model")
    evaluate.add_argument("--json", action="store_true", help="the metrics as JSON")
    evaluate.set_defaults(func=_cmd_eval)

    config = sub.add_parser("config", help="print the resolved config (defaults, file, overrides) after validation")
    config.add_argument("config")
    config.add_argument("overrides", nargs="*")
    config.add_argument("--check", action="store_true",
                        help="also make every check `miles train` makes before it starts: the model and tokenizer "
                             "load, the data encodes, the checkpoint to resume from fits, the resources exist "
                             "(GPUs and their memory, the packages the engine needs)")
    config.add_argument("--target", metavar="CLUSTER_YAML",
                        help="with --check (implied): check the GPUs against a declared cluster instead of this "
                             "machine (nodes: [{count, gpus, gpu_memory_gib, gpu_model}]) and print the placement")
    config.set_defaults(func=_cmd_config)

    plugins = sub.add_parser("plugins", help="list installed plugins and what each registered")
    plugins.add_argument("--json", action="store_true", help="machine-readable output")
    plugins.set_defaults(func=_cmd_plugins)

    report = sub.add_parser("report", help="plot a run's metrics.jsonl (PNG files) with an HTML index and its summary")
    report.add_argument("run_dir", metavar="RUN_DIR", help="the run's directory (run.dir)")
    report.add_argument("--out", default=None, help="where to write the plots and index.html (default RUN_DIR/report)")
    report.set_defaults(func=_cmd_report)

    view = sub.add_parser("view", help="browse a run's trajectories (run.trajectories) token by token in a browser")
    view.add_argument("run_dir", metavar="RUN_DIR", help="the run's directory (run.dir), finished or still running")
    view.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: this machine only)")
    view.add_argument("--port", type=int, default=0, help="0: any free port (the URL is printed)")
    view.set_defaults(func=_cmd_view)

    replay = sub.add_parser(
        "replay", help="train on a run's saved rollouts (run.save_rollouts) again, without an engine",
        description="Train on the rollouts a run saved (run.save_rollouts=true: RUN_DIR/rollouts/step_*.npz), step "
                    "by step, as the run trained on them: the run's config.yaml with the given overrides, the model "
                    "its RL phase started from, its seed and torch threads, each step's RNG state. No engine is "
                    "started. Without overrides, every train/* metric equals the run's (train/tokens_per_s aside). "
                    "RUN_DIR itself is not changed. See docs/debugging.md.")
    replay.add_argument("run_dir", metavar="RUN_DIR", help="the directory of a run made with run.save_rollouts=true")
    replay.add_argument("overrides", nargs="*", help="key=value overrides of the run's config, e.g. backend.lr=5e-4 "
                                                     "loss.clip_high=0.28 (run.dir is --out)")
    replay.add_argument("--out", default=None, help="where the replay writes config.yaml, metrics.jsonl, replay.json "
                                                    "and summary.json (default RUN_DIR/replay)")
    replay.add_argument("--steps", type=int, default=None, metavar="N", help="replay the first N saved steps "
                                                                              "(default: all)")
    replay.add_argument("--overwrite", action="store_true", help="replace an earlier replay in --out")
    replay.set_defaults(func=_cmd_replay)

    engine = sub.add_parser("engine", help="the embedded inference engine")
    engine_sub = engine.add_subparsers(dest="engine_command", required=True)
    serve = engine_sub.add_parser("serve", help="serve a model over HTTP with SGLang's protocol")
    serve.add_argument("--model", required=True, help="HF-format model directory")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=30000)
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    serve.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "auto"],
                       help="the weights' type (auto: bfloat16 on a GPU that supports it)")
    serve.add_argument("--admin-token", default="", help="required for weight/admin endpoints off loopback")
    serve.add_argument("--max-request-mib", type=float, default=16.0,
                       help="body size limit of /generate and the other small endpoints (MiB)")
    serve.add_argument("--max-weight-request-mib", type=float, default=1024.0,
                       help="body size limit of /update_weights_from_tensor (MiB)")
    serve.add_argument("--allowed-host", action="append", default=[], metavar="NAME[:PORT]",
                       help="another name clients reach the engine by, accepted in the Host header (repeat; '*': any)")
    serve.add_argument("--engine-args", default="{}", metavar="JSON",
                       help="more arguments of the engine, as rollout.engine gives them: "
                            "'{\"max_batch_size\": 256, \"prefix_cache_tokens\": 0}'")
    serve.add_argument("--logprobs-of", default="sampling", choices=["sampling", "truncated", "model"],
                       help="the distribution of the sampled tokens' log-probs: at the request's temperature "
                            "(sampling, SGLang's), also top-p/top-k truncated, or the model's own (temperature 1)")
    serve.add_argument("--precision", default="", metavar="NAME|JSON",
                       help="hold the decoder's linear layers in a precision scheme's stored form: a builtin's name "
                            "(fp8_block, fp8_channel, int4_w4a16, mxfp8, nvfp4) or a scheme's spec, "
                            "'{\"path\": \"module:Class\", \"args\": {...}}'")
    serve.set_defaults(func=_cmd_engine_serve)

    session = sub.add_parser("session", help="the session server for external agent harnesses")
    session_sub = session.add_subparsers(dest="session_command", required=True)
    sserve = session_sub.add_parser("serve", help="serve OpenAI-compatible chat sessions that record their tokens "
                                                  "(docs/sessions.md), on an in-process engine")
    sserve.add_argument("--model", required=True,
                        help="HF-format model directory (its tokenizer needs a chat template)")
    sserve.add_argument("--host", default="127.0.0.1")
    sserve.add_argument("--port", type=int, default=30001, help="0: any free port (the URL is printed)")
    sserve.add_argument("--tool-parser", default="hermes", help="how tool calls are found in generated text")
    sserve.add_argument("--seed", type=int, default=0)
    sserve.set_defaults(func=_cmd_session_serve)

    sandbox = sub.add_parser("sandbox", help="hosted sandboxes (E2B, Modal, Daytona ... plugins)")
    sandbox_sub = sandbox.add_subparsers(dest="sandbox_command", required=True)
    gc = sandbox_sub.add_parser("gc", help="delete the sandboxes a run left behind (a killed run's leftovers)")
    gc.add_argument("name", help="the registered sandbox, e.g. e2b")
    gc.add_argument("--run", default=None, help="only this run's (the id the run printed at start, miles-run=...); "
                                                "default: every sandbox tagged by any Miles run")
    gc.set_defaults(func=_cmd_sandbox_gc)

    fleet = sub.add_parser("fleet", help="grow or shrink a running run's engines (rollout.engine.num_engines >= 1)")
    fleet.add_argument("run_dir", help="the run's directory (run.dir)")
    fleet.add_argument("--engines", type=int, required=True, help="the number of engines wanted")
    fleet.set_defaults(func=_cmd_fleet)

    chat = sub.add_parser("chat-format", help="chat formats: how each model family talks in multi-turn rollouts")
    chat_sub = chat.add_subparsers(dest="chat_command", required=True)
    check = chat_sub.add_parser("check", help="play the scenario matrix (tool calls, parallel calls, reasoning on and "
                                              "off, follow-up user) token in, token out; exit 1 on a mismatch")
    check.add_argument("path", nargs="?", help="a tokenizer or model directory")
    check.add_argument("--chat-format", default="auto", help="a registered chat format (default: detected)")
    check.add_argument("--chat-template", help="a Jinja file or shipped template to render with instead")
    check.add_argument("--template-kwargs", default="{}", help='JSON, e.g. \'{"enable_thinking": false}\'')
    check.add_argument("--vocabulary", choices=("qwen", "deepseek"),
                       help="without a directory: a real BPE vocabulary with the format's tokens added")
    check.set_defaults(func=_cmd_chat_format_check)

    new = sub.add_parser("new", help="start something from a template: miles new plugin NAME --kind KIND")
    new_sub = new.add_subparsers(dest="new_command", required=True)
    new_plugin = new_sub.add_parser(
        "plugin", help="write a plugin package (entry point, plugin module, tests, README) to install and fill in",
        description="Write PARENT/NAME: a package whose plugin registers one component of KIND under a name derived "
                    "from NAME (my-reward: reward 'my_reward'), with its tests and a README. Refused when the name "
                    "is taken or the folder is not empty. See docs/plugins.md.")
    new_plugin.add_argument("name", metavar="NAME", help="the distribution's name, e.g. my-reward")
    new_plugin.add_argument("--kind", required=True,
                            help="what it registers: reward, env, tool, advantage, loss or data_selector")
    new_plugin.add_argument("--dir", default=".", metavar="PARENT", help="where to write NAME/ (default: here)")
    new_plugin.set_defaults(func=_cmd_new)

    add_router_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # key=value overrides may also come after options (miles eval CONFIG --model DIR k=v)
        if not hasattr(args, "overrides") or any(e.startswith("-") for e in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    try:
        return args.func(args)
    except MilesError as exc:
        print(f"miles: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except OSError as exc:
        if (problem := disk_problem(exc)) is None:
            raise
        print(f"miles: error: {problem}", file=sys.stderr)
        return 1
    except BaseException as exc:  # an interruption, or an error raised while one unwound the run (interruption())
        interrupted = interrupts.interruption(exc)
        if interrupted is None:
            raise
        if isinstance(interrupted, Terminated):
            print("miles: terminated (SIGTERM)", file=sys.stderr)
            return 128 + signal.SIGTERM
        print("miles: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT


if __name__ == "__main__":
    sys.exit(main())
