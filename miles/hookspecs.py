"""Every hook Miles calls, in one module. The docstrings are the reference documentation.

A plugin is a module (or object) whose functions are marked with :data:`miles.hookimpl` and named
after the hooks below. Hooks are always called with keyword arguments, so an implementation may
accept only the arguments it needs (``def miles_rollout_end(groups): ...`` is valid).

Registration hooks receive a ``register(name, obj, *, override=False)`` callable. Miles records which
plugin (and which distribution version) registered each name. Two plugins registering the same name
of the same kind is an error; a plugin replaces a builtin only with ``override=True``. ``obj`` may be
the component's import path, ``"package.module:attr"``: it is imported when a run first uses it, so
that a plugin whose component needs torch or an SDK costs nothing to commands that only list plugins.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import pluggy

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from miles.types import Group

__all__ = ["hookspec", "Register", "takes_option", "ChecksArgs", "NeedsLabel", "NeedsValues", "LossDefaults",
           "NeedsRefLogprobs", "ClosingRolloutFn", "BackgroundEngine", "LoraEngine", "LogprobsOfEngine",
           "ServerLauncher", "is_server_launcher", "ProtocolLauncher", "MemorySaverLauncher",
           "RoutedExpertsLauncher", "TurnLayout", "DescribedSandbox", "CheckedSandbox", "HostedSandbox",
           "RayBackend", "uses_ray", "ClosingTransport", "DiskTransportSwitch", "ReportingTransport",
           "SnapshotTransport", "RewindableLogger"]

hookspec = pluggy.HookspecMarker("miles")


class Register(Protocol):
    def __call__(self, name: str, obj: Any, *, override: bool = False) -> None: ...


# Optional capabilities: a component may offer more than its hook requires. Each is a Protocol below the hook
# of its kind, and Miles asks for it with ``isinstance(component, Protocol)`` (its class, before it is built),
# nowhere else; docs/hooks.md lists them.


@runtime_checkable
class ChecksArgs(Protocol):
    """A component of any kind with ``check_args(args)`` is asked at validation, with its arguments over its
    defaults, whether they work alone and together; what it raises refuses the config, naming the node."""

    def check_args(self, args: dict[str, Any]) -> None: ...


def takes_option(factory: Any, name: str) -> bool:
    """Whether ``factory`` (a class or function, or a ``functools.partial`` of one) takes keyword ``name`` and has
    not been given it yet: how Miles offers a sandbox the run's ``workspace_root`` and ``run_id``."""
    given = getattr(factory, "keywords", None) or {}
    try:
        return name in inspect.signature(factory).parameters and name not in given
    except (TypeError, ValueError):
        return False


# -------------------------------------------------------------------------------------------------
# Registration: the components a config can select by name
# -------------------------------------------------------------------------------------------------


@hookspec
def miles_register_rewards(register: Register) -> None:
    """Register reward functions, selected with ``reward.name``.

    A reward is ``fn(sample, **args) -> float | dict`` (a dict must hold a ``"score"`` entry), or an
    ``async def`` of the same shape, or a batched ``fn(samples, **args) -> list`` marked with
    :func:`miles.batched`. A class is accepted too: it is constructed with the config arguments and
    its instances are called like the function. The config node's other keys are passed as ``args``.
    A reward that raises or returns a non-finite value fails that sample with the reason recorded.
    """


@runtime_checkable
class NeedsLabel(Protocol):
    """A reward with ``label_types`` (``exact_match``: ``(str, int, float)``; ``list``: a list of those) scores against
    the label: data without one is refused at start, a sample without one fails uncalled (docs/rewards.md#labels)."""

    label_types: tuple[type, ...]


@hookspec
def miles_register_advantages(register: Register) -> None:
    """Register advantage estimators, selected with ``advantage.name``.

    An estimator is ``fn(batch: TrainBatch, **args) -> Tensor[B, L-1]``: one advantage per
    target-aligned token (only positions where ``batch.loss_mask`` is 1 are used).
    """


@runtime_checkable
class NeedsValues(Protocol):
    """An estimator (or a loss) with ``needs_values = True`` uses ``batch.values``, the value model's (which the
    backend then loads beside the policy, from its checkpoint with a new scalar head, and trains): ``ppo``. A loss
    that needs them is refused with an estimator that does not train a value model."""

    needs_values: bool


@runtime_checkable
class LossDefaults(Protocol):
    """An estimator with ``loss_defaults`` (a dict) fills in those arguments of the loss that the config leaves
    unset and the loss accepts (``dr_grpo``: ``agg: constant``; ``gspo``: sequence-level ratios)."""

    loss_defaults: dict[str, Any]


@hookspec
def miles_register_losses(register: Register) -> None:
    """Register policy losses, selected with ``loss.name`` (and ``sft.loss.name`` for SFT).

    A loss is ``fn(inputs: LossInputs, **args) -> (loss, metrics)`` where ``loss`` is a scalar tensor
    already divided by ``inputs.token_normalizer`` (so micro-batch losses add up to the batch loss)
    and ``metrics`` maps names to floats summed the same way.
    """


@runtime_checkable
class NeedsRefLogprobs(Protocol):
    """A loss with ``needs_ref_logprobs = True`` uses the reference model's log-probs (``inputs.ref_logprobs``),
    which load only with ``regularization.kl_coef > 0``."""

    needs_ref_logprobs: bool


@hookspec
def miles_register_data_selectors(register: Register) -> None:
    """Register data selectors (filters), listed in order under ``selection``.

    A selector is ``fn(groups: list[Group], **args) -> list[Group]``: it returns the groups to keep.
    """


@hookspec
def miles_register_rollout_fns(register: Register) -> None:
    """Register rollout functions, selected with ``rollout.fn.name``.

    A rollout function is ``async fn(sample: Sample, ctx: RolloutContext, **args) -> Sample``: it
    fills ``response_ids``, ``loss_mask``, ``rollout_logprobs``, ``status`` and ``weight_versions``
    by calling ``ctx.engine.generate`` (one or more turns). Exceptions fail that sample only.
    """


@runtime_checkable
class ClosingRolloutFn(Protocol):
    """A rollout function (or the object it is a method of) with ``async aclose()`` is closed when the run ends,
    after a failure or Ctrl-C too: e.g. the envs of multi-turn trajectories waiting to be continued."""

    async def aclose(self) -> None: ...


@hookspec
def miles_register_rollout_engines(register: Register) -> None:
    """Register rollout engines, selected with ``rollout.engine.name``.

    The registered factory is called with the node's arguments and returns an object with ``load_model(path)``,
    ``async generate(input_ids, sampling_params, return_logprob)`` returning an SGLang-shaped answer (``output_ids``
    and ``meta_info``), ``update_weights(state_dict, weight_version)`` and ``weight_version``. With
    ``num_engines >= 1`` the engines are served over HTTP with SGLang's protocol and reached through a router.

    A factory with ``server_launcher = True`` is a *server launcher* instead (e.g. ``sglang`` from the
    ``miles-sglang`` plugin, the builtin ``miles_server``): built with the node's arguments, shipped to each engine
    actor, which calls ``start(model_path, *, host, port, admin_token, threads, timeout_s) -> url`` (return once the
    server answers; raise ``RunError`` with its log otherwise), polls ``alive() -> bool`` (the actor exits when it
    turns false, and Ray restarts it), and calls ``stop()``; ``describe() -> dict`` reports it. Its attributes
    ``protocol`` (``"miles"`` or ``"sglang"``: what the weight transports may send it) and ``tp_size`` (ranks it
    takes in a ``distributed`` weight group) are read in the driver. A server launcher needs ``num_engines >= 1``.
    :class:`miles.engine.launchers.SubprocessLauncher` is the base for a server command in its own process group.
    """


@runtime_checkable
class BackgroundEngine(Protocol):
    """An in-process engine with ``background`` generates in a thread of its own when set true: Miles sets it
    for the streaming schedules, where rollouts go on while the trainer trains."""

    background: bool


@runtime_checkable
class LoraEngine(Protocol):
    """An engine with ``accepts_lora_adapters = True`` merges the LoRA adapters a push sends into the base weights
    it keeps (``backend.lora.sync: adapters``)."""

    accepts_lora_adapters: bool


@runtime_checkable
class LogprobsOfEngine(Protocol):
    """A rollout engine (in-process, or a server launcher) with ``logprobs_of_choices`` reports the sampled tokens'
    log-probs under the distribution its ``logprobs_of`` argument names, one of those (Miles passes
    ``rollout.logprobs_of``). One without it is taken to report them as SGLang does by default (``sampling``)."""

    logprobs_of_choices: tuple[str, ...]


@runtime_checkable
class PrecisionEngine(Protocol):
    """A rollout engine (in-process, or a server launcher) with ``accepts_precision = True`` takes a ``precision``
    argument, a precision scheme's spec (``rollout.precision``): it holds the decoder's linear layers in the scheme's
    stored form, computes as the scheme says, and takes pushes of that form. Miles refuses ``rollout.precision`` for
    an engine without it."""

    accepts_precision: bool


@runtime_checkable
class ServerLauncher(Protocol):
    """A rollout engine registered with ``server_launcher = True`` is a server launcher (above)."""

    server_launcher: bool


def is_server_launcher(factory: Any) -> bool:
    """Whether a registered rollout engine is a server launcher rather than an in-process engine."""
    return isinstance(factory, ServerLauncher) and bool(factory.server_launcher)


@runtime_checkable
class ProtocolLauncher(Protocol):
    """A server launcher's ``protocol``: ``"miles"`` (what it is taken for without one) or ``"sglang"``, whose
    servers take weights only as checkpoints on disk or a broadcast (``auto`` then sends them on disk)."""

    protocol: str


@runtime_checkable
class MemorySaverLauncher(Protocol):
    """A server launcher whose ``enable_memory_saver`` is None leaves it to Miles: true when the run releases the
    engines' memory while training (``rollout.engine.release_memory_during_train``)."""

    enable_memory_saver: bool | None


@runtime_checkable
class RoutedExpertsLauncher(Protocol):
    """A server launcher whose ``enable_return_routed_experts`` is None leaves it to Miles: true when the run asks
    for each token's expert ids (``rollout.return_routed_experts``)."""

    enable_return_routed_experts: bool | None


@hookspec
def miles_register_envs(register: Register) -> None:
    """Register environments (multi-turn tasks), selected with ``rollout.env.name``.

    The registered callable (a class or a function) is the env factory: Miles calls it once per trajectory as
    ``factory(ctx: EnvContext, **args)``, ``args`` being the node's other keys, and gets a fresh env with

    - ``tools``: a list of tool schemas in the OpenAI function format (``[]`` for none); the tool parser validates
      calls against them;
    - ``async reset(sample) -> observation``: the start of the conversation: a list of chat messages, one message,
      a string (one user message) or None (the sample's own prompt);
    - ``async step(action: Action) -> StepResult``: called after each policy turn with its text and its valid tool
      calls (calls that fail to parse or break a schema never reach the env: Miles answers them with an error
      observation and counts them); ``action.cut``: the turn stopped at its token limit. ``StepResult.observation``
      is appended to the conversation (loss mask 0), ``done`` ends the trajectory;
    - ``async close()``: always called once, also when the rollout fails, times out, is aborted or the run stops.

    ``ctx.sandbox`` opens this trajectory's sandbox (``rollout.sandbox``) on first use and Miles closes it after
    ``close``; ``ctx.tool(name)`` finds a registered :class:`miles.Tool`. The reward: the ``env`` reward
    (``reward.name: env``) takes the last non-None ``StepResult.reward``; any other reward plugin scores the sample
    itself and wins (the env's reward stays in ``sample.metadata["env_reward"]``). Exceptions from ``reset`` or
    ``step`` fail that sample only.
    """


@hookspec
def miles_register_sandboxes(register: Register) -> None:
    """Register code sandboxes, selected with ``rollout.sandbox.name``.

    The registered callable is called once per trajectory with the node's arguments and returns a sandbox with
    ``async run(command: str, *, timeout_s: float, files: dict[str, bytes] | None = None) -> ExecResult(stdout,
    stderr, exit_code, timed_out, duration_s)``: a shell command line, run in the sandbox's own workspace after
    ``files`` (relative paths) are written there, killed with all its processes after ``timeout_s`` (``exit_code``
    None, ``timed_out`` True), output capped; and ``async close()``, which stops everything still running and
    removes the workspace. Nothing the command does may reach outside the workspace or the network.
    :class:`miles.testing.SandboxConformance` is the test suite every sandbox plugin runs.
    """


@runtime_checkable
class DescribedSandbox(Protocol):
    """A sandbox class with ``describe(**options) -> str`` says at start what isolation it gives."""

    def describe(self, **options: Any) -> str: ...


@runtime_checkable
class CheckedSandbox(Protocol):
    """A sandbox class with ``async preflight(**options)`` checks at start that its service answers (in bounded
    time); raising fails the start."""

    async def preflight(self, **options: Any) -> None: ...


@runtime_checkable
class HostedSandbox(Protocol):
    """A sandbox class with ``async close_all(run_id=None)`` closes the sandboxes still open when the run ends
    (after a failure or Ctrl-C too); with a ``run_id`` parameter, only that run's.

    Two constructor keywords are offered too (:func:`takes_option`): ``workspace_root``, a folder of the run's
    that goes with it, and ``run_id``, the run's tag (always given to a :class:`miles.agentic.RemoteSandbox`),
    which ``miles sandbox gc`` finds what a killed run left by."""

    async def close_all(self, run_id: str | None = None) -> int: ...


@hookspec
def miles_register_tools(register: Register) -> None:
    """Register tools the model may call, listed by name in an env's config (``tool_env``'s ``tools``).

    A tool is a :class:`miles.Tool` (a function with an OpenAI function schema, made with :func:`miles.tool`). Its
    result is the observation; an exception becomes an error observation.
    """


@hookspec
def miles_register_tool_parsers(register: Register) -> None:
    """Register tool-call parsers, selected with ``rollout.tool_parser.name``.

    The factory is called with the node's arguments and returns an object whose ``parse(text) ->
    list[ToolCall]`` finds the calls in one generated turn (a malformed one as a ToolCall with
    ``error`` set) and whose ``content(text)`` is the turn's text without them. Miles validates the
    arguments against the tools' JSON schemas.
    """


@runtime_checkable
class TurnLayout(Protocol):
    """A tool parser's ``turn_layout`` says how a turn's assistant message holds what it generated, so that the
    template renders it back as generated: ``calls`` (what one without it does: the calls it reads as
    ``tool_calls``, the rest of the text, ``content()``, as the content; a turn with no call, or a call it cannot
    read, is all content), ``inline`` (calls are written in the text, e.g. Python code blocks: the whole turn is the
    content) or ``markup`` (every turn is the family's markup, gpt-oss' harmony channels: the content is
    ``content()`` of the turn, tools offered or not)."""

    turn_layout: str


@hookspec
def miles_register_reasoning_parsers(register: Register) -> None:
    """Register reasoning parsers, named by a chat format's ``reasoning_parser``.

    The factory is called without arguments and returns an object whose ``split(text) ->
    ReasoningSplit(reasoning, content)`` cuts one generated turn into its reasoning (None when it has
    none) and the rest, both as the format's template renders them back.
    """


@hookspec
def miles_register_chat_formats(register: Register) -> None:
    """Register chat formats (:class:`miles.agentic.chat_format.ChatFormat` values), selected with
    ``model.chat_format`` or detected from the tokenizer.

    A format says how one model family talks: the tokens that end a policy turn and stop generation,
    how a generated turn joins the next suffix, the tool-call id and argument forms, where reasoning
    goes, its tool and reasoning parsers (registered names) and the training template to render with.
    ``miles chat-format check`` proves a format token-exact on a scenario matrix.
    """


@hookspec
def miles_register_backends(register: Register) -> None:
    """Register training backends, selected with ``backend.name``.

    The factory is called with the node's arguments and returns a :class:`miles.train.TrainBackend`.
    """


@runtime_checkable
class RayBackend(Protocol):
    """A backend whose workers are Ray actors (``uses_ray = True``): Miles starts or joins the cluster before
    building it, reserves its ``ray_cpus``, and sets ``ray_resources`` (``cluster.train_resources``) before
    ``setup``. Any other backend trains in the driver (or, with engines on Ray and the sync schedule, in an
    actor of its own)."""

    uses_ray: bool
    ray_resources: dict[str, float]

    @property
    def ray_cpus(self) -> float: ...


def uses_ray(backend: Any) -> bool:
    """Whether a backend (an instance or its class) trains on Ray actors."""
    return isinstance(backend, RayBackend) and bool(backend.uses_ray)


@hookspec
def miles_register_logprob_kernels(register: Register) -> None:
    """Register log-prob kernels, selected with ``backend.logprob_kernel`` (used when
    ``backend.logprob_chunk_tokens`` > 0).

    The chunked path computes per-token log-probs and entropy ``chunk_tokens`` rows at a time: it makes
    one chunk's logits (``[n, V]``, float32, contiguous) from the final hidden states and the output
    layer, and hands them to the kernel; in the backward pass it makes them again and asks the kernel
    for their gradient. The registered factory is called without arguments and returns an object with

    - ``unavailable(device) -> str | None``: None when the kernel can run on that ``torch.device``,
      otherwise why not, in words (shown in the fallback warning). Keep it cheap and import-free where
      possible: it is asked in every process that computes;
    - ``forward(logits, targets) -> (logprobs, entropy, lse)``: ``targets [n]`` int64; returns float32
      ``[n]`` tensors: ``logits[i, targets[i]] - lse[i]``, the entropy ``-sum_v p log p`` of row ``i``'s
      softmax and its log-sum-exp. It must not change ``logits``;
    - ``backward(logits, targets, lse, entropy, grad_logprobs, grad_entropy) -> grad_logits``: the same
      chunk's logits (recomputed, then not used again), the ``lse`` and ``entropy`` its forward
      returned, and the gradients of the two outputs (``[n]`` float32; ``grad_entropy`` is None when
      the entropy needs none). Returns ``grad_logits [n, V]`` float32,
      ``grad_logprobs * (onehot(targets) - p) - grad_entropy * p * (log p + entropy)``; it may write it
      into the logits' storage and return that.

    Miles resolves the name in each process that computes (training workers too) from the plugins
    installed there: ``torch`` (builtin, torch ops) is the reference and the fallback; ``auto`` takes
    the first other registered kernel, in name order, whose ``unavailable`` says None, else ``torch``;
    a named kernel that cannot run on the device falls back to ``torch`` with one warning naming the
    reason. ``miles-kernels`` registers ``triton`` (CUDA and ROCm).
    """


@hookspec
def miles_register_weight_transports(register: Register) -> None:
    """Register weight transports, selected with ``rollout.weight_sync.name``.

    The factory is called with the node's arguments and returns an object whose
    ``push(backend, plane, version) -> int`` sends the backend's current weights, tagged with the
    policy version, to every engine of the rollout plane and returns the bytes moved, and whose
    ``async catch_up(plane, engine)`` brings a re-admitted engine to the last pushed weights.
    ``plane`` is a :class:`miles.weights.fleet.Engines` (in-process engines, or a
    :class:`~miles.weights.fleet.Fleet` over HTTP as ``plane.router``).
    ``push`` records what it sends before posting, and posts to the engines in service through
    ``plane.router.post_all`` (an engine that fails is quarantined, the push completes on the others);
    ``catch_up`` repeats until the engine holds the last recorded version, so an engine re-admitted
    while a push was under way does not stay behind.
    """


@runtime_checkable
class ClosingTransport(Protocol):
    """A transport with ``close()`` is closed when the run ends (e.g. shm's file under /dev/shm)."""

    def close(self) -> None: ...


@runtime_checkable
class DiskTransportSwitch(Protocol):
    """A transport with ``use_disk()`` is told to send checkpoints on disk from then on, for engines that take
    only those (SGLang servers): ``auto``."""

    def use_disk(self) -> None: ...


@runtime_checkable
class ReportingTransport(Protocol):
    """A transport with ``metrics()`` adds what it returns (counts since its last call) to each step's metrics:
    ``shm`` with ``delta: true`` reports ``weight_sync/delta_posts``, ``weight_sync/full_catch_ups``, ..."""

    def metrics(self) -> dict[str, float]: ...


@runtime_checkable
class SnapshotTransport(Protocol):
    """A transport whose push reads only ``backend.export_weights()`` says so with ``exports_only = True``: a
    streaming schedule then pushes a copy of the weights in a thread of its own while the trainer goes on."""

    exports_only: bool


@hookspec
def miles_register_precisions(register: Register) -> None:
    """Register precision schemes, selected with ``rollout.precision`` (the engines' weights) and ``backend.qat``
    (training on the weights the engines serve).

    The factory is called with the node's arguments and returns a :class:`miles.precision.schemes.Scheme` (or None:
    no quantization, the builtin ``bf16``): ``stored`` (the names of its stored tensors, in place of ``weight``),
    ``check(shape)`` (why a ``[out, in]`` weight cannot be taken, or None), ``quantize(weight)`` and
    ``dequantize(stored)``, ``activation(x)`` (a layer's input as the engine computes with it, per token),
    ``quantization_config()`` (its checkpoint's ``config.json`` block), and ``include``/``exclude`` (which linear
    layers). A scheme is passed to engines in other processes by its class's import path and arguments
    (``spec()``): a plugin's scheme must be importable there. Builtins: ``bf16``, ``fp8_block``, ``fp8_channel``,
    ``int4_w4a16``, ``mxfp8`` and ``nvfp4`` (docs/precision.md).
    """


@hookspec
def miles_register_loggers(register: Register) -> None:
    """Register metric loggers, listed under ``run.loggers``.

    The factory is called with the node's arguments and returns an object with
    ``start(run_dir, config)``, ``log(step, metrics)`` and ``close()``; and, optionally,
    ``rewind(step)``, which a resumed run calls after ``start`` with the first step it redoes, so that
    what the interrupted run logged from that step on is dropped. Builtins: ``jsonl``, ``tensorboard``
    and ``wandb`` (docs/observability.md).
    """


@runtime_checkable
class RewindableLogger(Protocol):
    """A logger with ``rewind(step)`` drops what an interrupted run logged from ``step`` on (``run.resume``)."""

    def rewind(self, step: int) -> None: ...


@hookspec
def miles_register_data_generators(register: Register) -> None:
    """Register synthetic data generators, selected with ``data.generator.name``.

    A generator is ``fn(seed, **args) -> dict[str, list[dict]]`` mapping split names (``"train"``,
    ``"eval"``) to rows; Miles writes them as JSONL under the run directory and reads them back
    through the ordinary data path.
    """


# -------------------------------------------------------------------------------------------------
# Lifecycle: observe and adjust a run
# -------------------------------------------------------------------------------------------------


@hookspec
def miles_configure(config: DictConfig) -> None:
    """Called once the config is loaded and validated, before anything is built.

    Implementations may read the config and change values in place (they are validated again).
    """


@hookspec
def miles_run_start(run_dir: str, config: DictConfig, plugins: list[dict]) -> None:
    """Called when a run starts, after the run header (config and plugin stack) is written."""


@hookspec
def miles_rollout_end(step: int, groups: list[Group]) -> None:
    """Called after each step's rollouts are rewarded and selected, before training on them."""


@hookspec
def miles_train_step_end(step: int, metrics: dict[str, float]) -> None:
    """Called after each training step (and its weight sync) with that step's metrics.

    Implementations may add entries to ``metrics``; loggers see them.
    """


@hookspec
def miles_checkpoint_save(path: str, step: int) -> None:
    """Called after a model checkpoint has been written to ``path`` (atomically)."""


@hookspec
def miles_run_end(run_dir: str, summary: dict[str, Any]) -> None:
    """Called when a run finishes, with the summary that is printed and saved."""
