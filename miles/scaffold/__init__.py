"""``miles new plugin NAME --kind KIND``: a plugin package, ready to install, test and select by name.

The files of each kind are :class:`string.Template` texts under ``templates/<kind>/`` (``templates/common/`` for
those every kind shares): ``$dist`` is NAME (the distribution's and the plugin's name), ``$module`` its package,
``$name`` the registered name and ``$cls`` a class name, all derived from NAME. Nothing is overwritten: the package
is written to a temporary folder beside the target and renamed into place.
"""

from __future__ import annotations

import importlib.metadata
import importlib.resources
import importlib.util
import keyword
import os
import re
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from string import Template

from miles.errors import ConfigError

__all__ = ["KINDS", "MAX_NAME_CHARS", "KindTemplate", "Scaffolded", "derived_names", "new_plugin"]


@dataclass(frozen=True)
class KindTemplate:
    summary: str  # what the component does, for the README
    contract: str  # what a component of the kind is, for the README
    config: str  # the YAML that selects it
    command: str  # a config file and the overrides that select it: `miles train COMMAND`
    guide: str  # the page of Miles' docs that describes the kind


KINDS: dict[str, KindTemplate] = {
    "reward": KindTemplate(
        "1.0 when the response, stripped of surrounding spaces, equals the label, else 0.0",
        "A reward is `fn(sample, **args) -> float` (or a dict with a `\"score\"`): `sample.response_text` is the "
        "decoded response, `sample.label` the data's label.",
        "reward: {name: $name, ignore_case: true}",
        "configs/quickstart.yaml reward.name=$name reward.ignore_case=true", "docs/rewards.md"),
    "env": KindTemplate(
        "the model answers the sample's label, told to try again after each wrong answer",
        "An env class (or factory) is called once per trajectory as `factory(ctx, **args)`; the env has `tools`, "
        "`async reset(sample)`, `async step(action) -> StepResult` and `async close()`, which is always called.",
        "rollout:\n  fn: {name: multi_turn, max_turns: 3}\n  env: {name: $name, max_attempts: 3}\nreward: {name: env}",
        "configs/retool.yaml 'rollout.env={name: $name, max_attempts: 3}' reward.name=env", "docs/agentic.md"),
    "tool": KindTemplate(
        "it counts how often a word occurs in a text",
        "A tool is a `miles.Tool`: a function whose annotations give the JSON schema the model's calls are checked "
        "against; what it returns is the observation, an exception becomes an error observation.",
        "rollout:\n  fn: {name: multi_turn, max_turns: 3}\n  env: {name: tool_env, tools: [$name]}\n"
        "  tool_parser: {name: hermes}",
        "configs/retool.yaml 'rollout.env.tools=[execute_python_code, $name]' rollout.tool_parser.name=hermes",
        "docs/agentic.md"),
    "advantage": KindTemplate(
        "each sample's reward less the mean reward of its group, on every response token",
        "An estimator is `fn(batch, **args) -> Tensor[B, L-1]`, one advantage per target-aligned token (positions "
        "where `batch.loss_mask` is 0 do not count).",
        "advantage: {name: $name, scale: 1.0}",
        "configs/quickstart.yaml advantage.name=$name advantage.scale=2.0", "docs/algorithms/advantages.md"),
    "loss": KindTemplate(
        "PPO's clipped surrogate, summed over the loss tokens and divided by the batch's count",
        "A loss is `fn(inputs, **args) -> (loss, metrics)`, the loss already divided by `inputs.token_normalizer` "
        "so that the losses of micro-batches add up to the batch's.",
        "loss: {name: $name, clip: 0.2}",
        "configs/quickstart.yaml loss.name=$name loss.clip=0.1", "docs/algorithms/losses.md"),
    "data_selector": KindTemplate(
        "it keeps the prompts the policy solves sometimes but not always",
        "A selector is `fn(groups, **args) -> the groups to keep`; selectors run in the order `selection` lists.",
        "selection:\n  - {name: $name, low: 0.1, high: 0.9}",
        "configs/quickstart.yaml 'selection=[{name: $name, low: 0.1, high: 0.9}]'", "docs/algorithms/selection.md"),
}

# Where each template file goes in the package; tests/test_plugin.py is the kind's tests, then the shared one.
_DESTINATIONS = {"pyproject.toml": "pyproject.toml", "README.md": "README.md", "__init__.py": "$module/__init__.py",
                 "plugin.py": "$module/plugin.py", "conftest.py": "tests/conftest.py",
                 "test_plugin.py": "tests/test_plugin.py", "test_entry_point.py": "tests/test_plugin.py"}

# The registered names of the example package in contrib/, which users install beside their own.
_BUNDLED = {("reward", "numeric_closeness"): "contrib/miles-reward-template"}

_NAME = re.compile(r"^[A-Za-z]([A-Za-z0-9_-]*[A-Za-z0-9])?$")
# Longer than any published plugin's name, and short enough that the package's folders and its staging folder
# (``.NAME-xxxxxxxx.tmp``) stay within the 255 bytes a file system allows for one name.
MAX_NAME_CHARS = 100


@dataclass(frozen=True)
class Scaffolded:
    folder: Path
    kind: str
    name: str  # the registered name
    command: str  # `miles train COMMAND` selects it
    files: list[str]

    def summary(self) -> str:
        return "\n".join([f"wrote {self.folder}: a plugin registering the {self.kind} {self.name!r}",
                          *(f"  {file}" for file in self.files), "next:",
                          f"  cd {self.folder} && pip install -e . && pytest",
                          f"  miles train {self.command}"])


def derived_names(dist: str) -> dict[str, str]:
    """The names a package called ``dist`` uses: ``my-reward`` registers ``my_reward`` from package ``my_reward``."""
    name = dist.lower().replace("-", "_")
    return {"dist": dist, "module": name, "name": name, "cls": "".join(p.capitalize() for p in name.split("_"))}


def new_plugin(dist: str, kind: str, parent: str | Path = ".") -> Scaffolded:
    """Write the package of a ``kind`` plugin named ``dist`` to ``parent/dist``; a ConfigError (nothing written)
    when the kind is unknown, the name is not a distribution name or is taken, or the folder holds files."""
    if kind not in KINDS:
        raise ConfigError(f"--kind {kind!r}: expected one of {', '.join(KINDS)}")
    if isinstance(dist, str) and len(dist) > MAX_NAME_CHARS:
        raise ConfigError(f"plugin name {dist[:20]}... ({len(dist)} characters): expected at most {MAX_NAME_CHARS} "
                          f"characters")
    if not isinstance(dist, str) or not _NAME.match(dist):
        raise ConfigError(f"plugin name {dist!r}: expected a distribution name of letters, digits, '-' and '_', "
                          f"starting with a letter and ending with a letter or digit, e.g. my-{kind.replace('_', '-')}")
    names = derived_names(dist)
    if keyword.iskeyword(names["module"]) or names["module"] == "tests":
        raise ConfigError(f"plugin name {dist!r}: its package would be named {names['module']!r}, which Python or "
                          f"the package's own tests/ folder takes; choose another name")
    if Path(parent).exists() and not Path(parent).is_dir():
        raise ConfigError(f"--dir {parent}: not a folder")
    folder = Path(parent) / dist
    if folder.exists() and not (folder.is_dir() and not any(folder.iterdir())):
        raise ConfigError(f"{folder} exists and is not an empty folder; nothing was written (choose another NAME "
                          f"or --dir)")
    _check_free(dist, kind, names)
    meta = KINDS[kind]
    values = {"kind": kind, **names}
    values.update(summary=meta.summary, contract=meta.contract, guide=meta.guide,
                  config=Template(meta.config).substitute(values), command=Template(meta.command).substitute(values))
    files = _render(kind, values)
    staging = folder.parent / f".{dist}-{secrets.token_hex(4)}.tmp"
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging.mkdir()  # beside the target, so that the rename cannot cross file systems
    except OSError as exc:  # a read-only or full disk, a path too long for it
        raise ConfigError(f"--dir {parent}: cannot write the package there ({exc.strerror}); nothing was "
                          f"written") from None
    try:
        for relative, text in files.items():
            (staging / relative).parent.mkdir(parents=True, exist_ok=True)
            (staging / relative).write_text(text)
        if folder.is_dir():
            folder.rmdir()  # empty (checked above); fails rather than overwrite if a file appeared since
        os.rename(staging, folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return Scaffolded(folder, kind, names["name"], values["command"], sorted(files))


def _render(kind: str, values: dict[str, str]) -> dict[str, str]:
    """The package's files (relative path -> text): the kind's templates, then the shared ones (the shared test
    goes after the kind's tests)."""
    templates = importlib.resources.files(__name__) / "templates"
    files: dict[str, str] = {}
    for folder in (kind, "common"):
        for template in sorted((templates / folder).iterdir(), key=lambda t: t.name):
            if not template.name.endswith(".tmpl"):
                continue
            relative = Template(_DESTINATIONS[template.name.removesuffix(".tmpl")]).substitute(values)
            text = Template(template.read_text()).substitute(values)
            files[relative] = f"{files[relative]}\n\n{text}" if relative in files else text
    return files


def _check_free(dist: str, kind: str, names: dict[str, str]) -> None:
    """Refuse a name that a builtin, an installed plugin or distribution, or an importable module has already."""
    from miles.plugins import build_plugin_manager
    from miles.registry import Registry

    pm = build_plugin_manager(autoload=True)
    registry = Registry.from_plugin_manager(pm)
    name = names["name"]
    if name in registry.names(kind):
        owner = registry.get(kind, name).plugin
        which = "the builtin plugin" if owner.builtin else "the plugin"
        raise ConfigError(f"{kind} {name!r} (the name derived from {dist!r}) is registered already, by {which} "
                          f"{owner.name!r} ({owner.distribution} {owner.version}); choose another NAME")
    if (kind, name) in _BUNDLED:
        raise ConfigError(f"{kind} {name!r} (the name derived from {dist!r}) is registered by the example package "
                          f"{_BUNDLED[kind, name]}; choose another NAME")
    if dist in pm.info:
        info = pm.info[dist]
        raise ConfigError(f"a plugin named {dist!r} is installed already ({info.module}, from {info.distribution} "
                          f"{info.version}); choose another NAME")
    try:
        installed = importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        pass
    else:
        raise ConfigError(f"a distribution named {dist!r} is installed already ({installed.metadata['Name']} "
                          f"{installed.version}): installing the plugin would replace it; choose another NAME")
    spec = importlib.util.find_spec(names["module"])
    if spec is not None:
        where = spec.origin or ", ".join(spec.submodule_search_locations or ())
        raise ConfigError(f"a module named {names['module']!r} exists already ({where}): the plugin's package would "
                          f"shadow it or be shadowed by it; choose another NAME")
