"""Every hookspec is documented with its exact signature, and the reference is up to date."""

import importlib.util
import inspect
import sys
from pathlib import Path

from miles import hookspecs

DOCS = Path(__file__).resolve().parent.parent / "docs"


def hookspec_functions():
    return [getattr(hookspecs, n) for n in dir(hookspecs) if n.startswith("miles_") and callable(getattr(hookspecs, n))]


def test_every_hookspec_is_documented_with_its_signature():
    text = (DOCS / "hooks.md").read_text()
    for fn in hookspec_functions():
        assert fn.__doc__, f"{fn.__name__} has no docstring"
        assert f"### `{fn.__name__}({', '.join(inspect.signature(fn).parameters)})`" in text, fn.__name__


def test_hook_reference_is_generated_from_hookspecs():
    spec = importlib.util.spec_from_file_location("gen", DOCS / "generate_hook_reference.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert (DOCS / "hooks.md").read_text() == gen.render(), "run: python docs/generate_hook_reference.py"


def test_config_reference_names_every_section_and_key():
    from omegaconf import OmegaConf

    from miles.config.schema import structured_defaults

    text = (DOCS / "config.md").read_text()
    schema = structured_defaults()

    def keys(node, prefix=""):
        for key, value in node.items():
            full = f"{prefix}{key}"
            if OmegaConf.is_dict(value) and OmegaConf.get_type(value) is not dict:
                yield from keys(value, f"{full}.")
            else:
                yield full

    missing = [k for k in keys(schema) if f"`{k}`" not in text]
    assert not missing, f"docs/config.md does not describe: {missing}"


def python_blocks(path):
    return code_blocks(path, "python")


def code_blocks(path, language):
    """The fenced blocks of ``language`` in a Markdown file, in order."""
    text = path.read_text()
    blocks, inside, current = [], False, []
    for line in text.splitlines():
        if line.strip() == f"```{language}":
            inside, current = True, []
        elif inside and line.strip() == "```":
            inside = False
            blocks.append("\n".join(current))
        elif inside:
            current.append(line)
    return blocks


def test_plugin_guide_examples_register(tmp_path):
    import types

    from miles.testing import make_registry

    blocks = python_blocks(DOCS / "plugins.md")
    assert len(blocks) >= 8
    for i, code in enumerate(blocks):
        module = types.ModuleType(f"docs_example_{i}")
        exec(compile(code, f"docs/plugins.md[block {i}]", "exec"), module.__dict__)
        registry = make_registry(module)
        hooks = [n for n in vars(module) if n.startswith("miles_register_")]
        for hook in hooks:
            kind = next(k for k in __import__("miles.registry").registry.KINDS.values() if k.hook == hook)
            assert any(not e.builtin for e in registry.entries(kind.name)), (i, hook)


def test_plugin_guide_examples_train_together(tmp_path):
    """All examples of the guide in one plugin, each selected in one short run."""
    import json
    import types

    from miles.run.runner import prepare, train

    module = types.ModuleType("docs_examples")
    sys.modules["docs_examples"] = module  # importable, as a plugin's module is (the engine rebuilds its scheme)
    exec(compile("\n\n".join(python_blocks(DOCS / "plugins.md")), "docs/plugins.md", "exec"), module.__dict__)
    train(prepare("configs/quickstart.yaml", [
        f"run.dir={tmp_path}", "run.steps=3", "sft.steps=0", "run.eval_size=0", "run.progress=false",
        "rollout.prompts_per_step=4", "rollout.n_samples=4",
        "reward.name=last_number", "advantage.name=mean_baseline", "loss.name=vanilla_pg",
        "selection=[{name: min_mean_reward, threshold: 0.0}]", "rollout.fn.name=answer_then_check",
        "backend.name=sgd", "rollout.weight_sync.name=counting",
        "run.loggers=[{name: jsonl}, {name: print, every: 1}]", "data.generator.name=subtraction",
        "model.tokenizer.alphabet=0123456789+-=", "rollout.precision.name=fp8_tensor",
    ], extra_plugins=[("docs", module)]))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["custom/step_parity"] == r["step"] % 2 for r in rows)  # the lifecycle example ran
    assert all(r["samples/failed"] == 0 for r in rows)
    assert rows[-1]["weight_version"] == 3
    assert all(0 < r["weight_sync/stored_bytes"] < r["weight_sync/bf16_bytes"] for r in rows)  # the scheme's pushes


def test_algorithm_page_examples_train(tmp_path):
    """The custom estimator and custom loss of docs/algorithms/ in one short run each."""
    import json
    import types

    from miles.run.runner import prepare, train

    for page, overrides in (("advantages.md", ["advantage.name=max_baseline", "advantage.margin=0.1"]),
                            ("losses.md", ["loss.name=my_reinforce", "loss.scale=0.5"])):
        module = types.ModuleType(f"docs_{page}")
        exec(compile("\n\n".join(python_blocks(DOCS / "algorithms" / page)), page, "exec"), module.__dict__)
        run_dir = tmp_path / page
        train(prepare("configs/quickstart.yaml", [
            f"run.dir={run_dir}", "run.steps=2", "sft.steps=0", "run.eval_size=0", "run.progress=false",
            "rollout.prompts_per_step=4", *overrides], extra_plugins=[(page, module)]))
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [0, 1] and all(r["train/grad_norm"] >= 0 for r in rows)


def test_the_readme_s_plugin_installs_registers_and_scores_as_written(tmp_path):
    """The README's "Write a plugin" files, copied literally into a folder, build as a package (setuptools, no
    network), and installed beside Miles, its entry point registers the reward, which scores a sample."""
    import subprocess
    import sys
    import zipfile

    text = (DOCS.parent / "README.md").read_text()
    section = text[text.index("## Write a plugin"):text.index("\n## ", text.index("## Write a plugin") + 3)]
    readme = tmp_path / "README.md"
    readme.write_text(section)
    files = {}
    for block in code_blocks(readme, "python") + code_blocks(readme, "toml"):
        first, _, body = block.partition("\n")
        assert first.startswith("# "), block[:80]
        files[first[2:].strip()] = block + "\n"
    assert sorted(files) == ["my_plugin.py", "pyproject.toml"]
    folder = tmp_path / "my-plugin"
    folder.mkdir()
    for name, body in files.items():
        (folder / name).write_text(body)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                            str(tmp_path / "wheel"), str(folder)], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-3000:]
    wheel = next((tmp_path / "wheel").glob("my_plugin-0.1.0-*.whl"))
    with zipfile.ZipFile(wheel) as archive:  # installed: its files and metadata on sys.path
        archive.extractall(tmp_path / "site")
    check = ("from miles.testing import make_registry, make_sample\n"
             "registry = make_registry(autoload=True)\n"
             "entry = registry.get('reward', 'my_closeness')\n"
             "reward = registry.build('reward', {'name': 'my_closeness', 'scale': 4.0}, 'reward')\n"
             "print(entry.plugin.name, reward(make_sample('5', label='7')))\n")
    env = {**__import__("os").environ, "PYTHONPATH": str(tmp_path / "site")}
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["my-plugin", "0.5"], result.stdout


def _anchors(path):
    """The anchors GitHub gives the headings of a Markdown file (outside code blocks)."""
    import re

    found, seen, inside = set(), {}, False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            inside = not inside
        elif not inside and (heading := re.match(r"^#{1,6}\s+(.*)$", line)):
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            found.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return found


def test_every_relative_link_of_the_docs_resolves_to_a_file_and_heading():
    import re

    root = DOCS.parent
    pages = [root / "README.md", *sorted(DOCS.rglob("*.md")), *sorted(root.glob("plugins/*/README.md")),
             *sorted(root.glob("contrib/*/README.md"))]
    broken = []
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^[a-z]+:", target):  # a web or mail address
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(root)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(root)}: {target} (no such heading)")
    assert not broken, broken


def test_the_docs_index_links_every_page():
    index = (DOCS / "README.md").read_text()
    pages = [p.relative_to(DOCS).as_posix() for p in sorted(DOCS.rglob("*.md")) if p.name != "README.md"]
    assert not [p for p in pages if f"]({p})" not in index]
    assert "](docs/README.md)" in (DOCS.parent / "README.md").read_text()
