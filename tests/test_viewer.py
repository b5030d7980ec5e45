"""The trajectory viewer, as a user meets it: real runs made with ``miles train`` (multi-turn with tool calls, and a
vision-language one whose pictures are files and data URLs), ``miles view`` started as a process of its own, and a
headless Chromium clicking through its pages, and through the static copy ``miles report`` writes, from disk."""

import base64
import json
import re
import select
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.conftest import ROOT, run_miles

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--window-size=1200,1400"]


def records(run_dir, step):
    path = run_dir / "trajectories" / f"step_{step:06d}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def steps_of(run_dir):
    return sorted(int(p.name[5:11]) for p in (run_dir / "trajectories").glob("step_*.jsonl"))


def train(run_dir, *args):
    result = run_miles("train", *args, f"run.dir={run_dir}", "run.eval_size=0", "run.progress=false")
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def retool_run(tmp_path_factory):
    """Multi-turn: code the model writes, the sandbox's output as observation tokens (loss mask 0)."""
    return train(tmp_path_factory.mktemp("viewer") / "retool", "configs/retool.yaml", "sft.steps=40",
                 "data.generator.direct_fraction=0.0", "run.steps=3", "rollout.prompts_per_step=4",
                 "rollout.n_samples=4")


@pytest.fixture(scope="module")
def vlm_run(tmp_path_factory):
    """The dots pictures, every other one as a PNG file (the engine is sent its absolute path), the others as data
    URLs."""
    from miles.builtin.dots import dots

    data = tmp_path_factory.mktemp("dots")
    (data / "images").mkdir()
    rows = dots(seed=0, size=40)["train"]
    for i, row in enumerate(rows[::2]):
        part = row["prompt"][0]["content"][0]
        (data / f"images/{i:03d}.png").write_bytes(base64.b64decode(part["image"].partition(",")[2]))
        part["image"] = f"images/{i:03d}.png"
    (data / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return train(tmp_path_factory.mktemp("viewer") / "vlm", "configs/vlm.yaml", "data.generator=null",
                 f"data.train_path={data / 'train.jsonl'}", "sft.steps=2", "run.steps=3",
                 "rollout.prompts_per_step=2", "rollout.n_samples=2")


@contextmanager
def viewing(run_dir, *extra, cwd=ROOT):
    """``miles view RUN_DIR`` in a process of its own (in ``cwd``); yields the URL it prints."""
    process = subprocess.Popen([sys.executable, "-m", "miles", "view", str(run_dir), *extra], cwd=cwd,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([process.stdout], [], [], 60)
        line = process.stdout.readline() if ready else ""
        match = re.search(r"http://\S+", line)
        assert match, (line, process.poll(), process.stderr.read() if process.poll() is not None else "")
        yield match[0]
    finally:
        process.terminate()
        process.wait(timeout=30)


def fetch(url, host=None):
    """(status, content type, body) of a GET."""
    request = urllib.request.Request(url, headers={"Host": host} if host else {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.headers["Content-Type"], response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read()


@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM.exists() or not CHROMEDRIVER.exists():
        pytest.skip("needs Chromium and its driver: apt-get install chromium chromium-driver")
    webdriver = pytest.importorskip("selenium.webdriver", reason="needs selenium (pip install -e '.[test]')")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    profile = tempfile.mkdtemp(prefix="miles-chromium-")
    for flag in [*CHROMIUM_FLAGS, f"--user-data-dir={profile}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


def wait_for(driver, css, timeout_s=20):
    """The elements matching ``css`` once there is one."""
    from selenium.webdriver.common.by import By

    wait_until(lambda: driver.find_elements(By.CSS_SELECTOR, css), f"no {css!r} in {driver.current_url}", timeout_s)
    return driver.find_elements(By.CSS_SELECTOR, css)


def wait_until(condition, what, timeout_s=20):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def shown_rows(driver):
    """The sample list as shown: (group, index, reward, status, response tokens) per row."""
    cells = driver.execute_script("return [...document.querySelectorAll('#samples tbody tr')]"
                                  ".map(r => [...r.cells].map(c => c.textContent))")
    return [(int(c[0]), int(c[1]), c[2], c[3], int(c[6])) for c in cells]


def reward(record):
    value = record["reward"]
    return value["score"] if isinstance(value, dict) else value


def check_sample(driver, run_dir, step, position):
    """Open sample ``position`` of the step page shown and check its detail against the file."""
    from selenium.webdriver.common.by import By

    record = records(run_dir, step)[position]
    driver.find_element(By.CSS_SELECTOR, f"#samples tr[data-position='{position}']").click()
    wait_until(lambda: driver.current_url.endswith(f"#sample-{position}") and driver.execute_script(
        "const h = document.querySelector('#detail h2'); return h && h.textContent") ==
        f"Group {record['group']}, sample {record['index']}", f"sample {position}'s detail")
    classes = driver.execute_script("return [...document.querySelectorAll('#tokens span')].map(s => s.className)")
    assert len(classes) == len(record["tokens"])  # one span per token
    assert classes == ["tok pol" if m else "tok obs" for m in record["loss_mask"]]
    texts = driver.execute_script(
        "return [...document.querySelectorAll('#tokens span')].map(s => s.firstChild.textContent)")
    assert [t.replace("↵", "").replace("→", "") for t in texts] == [t or "∅" for t in record["tokens"]]
    shown = driver.find_element(By.ID, "d-advantage").text
    assert (shown == "—") if record["advantage"] is None else float(shown) == pytest.approx(record["advantage"],
                                                                                         rel=1e-3, abs=1e-12)
    assert driver.find_element(By.ID, "d-status").text == record["status"]
    assert driver.find_element(By.ID, "response-text").text == record["response_text"].strip()
    names = [e.text for e in driver.find_elements(By.CSS_SELECTOR, "#tool-calls .tool-name")]
    assert names == [call["name"] for call in record["tool_calls"]]
    errors = [e.text for e in driver.find_elements(By.CSS_SELECTOR, "#tool-calls .error")]
    assert errors == [f"error: {call['error']}" for call in record["tool_calls"] if call["error"]]
    return record


def check_values_view(driver, record):
    """The values view: under each token, shown, its rollout log-prob and advantage (· for an observation)."""
    from selenium.webdriver.common.by import By

    driver.find_element(By.ID, "view-values").click()
    assert driver.find_element(By.CSS_SELECTOR, ".legend-values").is_displayed()
    assert not driver.find_element(By.CSS_SELECTOR, ".legend-gap").is_displayed()
    shown = driver.execute_script("return [...document.querySelectorAll('#tokens span')].map(s => "
                                  "[...s.querySelectorAll('.vals i')].map(i => i.innerText))")
    assert len(shown) == len(record["tokens"])
    for i, (mask, (logprob, advantage)) in enumerate(zip(record["loss_mask"], shown)):
        if not mask:
            assert (logprob, advantage) == ("·", "·"), i
            continue
        assert float(logprob) == pytest.approx(record["rollout_logprobs"][i], rel=1e-3, abs=1e-12), i
        assert float(advantage) == pytest.approx(record["advantages"][i], rel=1e-3, abs=1e-12), i
    first = record["loss_mask"].index(1)
    assert driver.find_elements(By.CSS_SELECTOR, "#tokens span")[first].find_element(
        By.CSS_SELECTOR, ".v-logprob").is_displayed()
    driver.find_element(By.ID, "view-mask").click()
    assert not driver.find_elements(By.CSS_SELECTOR, "#tokens span")[first].find_element(
        By.CSS_SELECTOR, ".v-logprob").is_displayed()


def test_served_viewer_shows_the_steps_filters_and_a_multi_turn_sample(retool_run, browser):
    from selenium.webdriver.common.by import By

    steps = steps_of(retool_run)
    assert steps == [0, 1, 2]
    with viewing(retool_run) as url:
        browser.get(url)
        links = wait_for(browser, "a.step-link")
        assert [a.text for a in links] == [f"step {s}" for s in steps]
        for cell, step in zip(browser.find_elements(By.CSS_SELECTOR, "td.mean-reward"), steps):
            rewards = [reward(r) for r in records(retool_run, step) if reward(r) is not None]
            assert float(cell.text) == pytest.approx(sum(rewards) / len(rewards), rel=1e-3, abs=1e-9)
        links[-1].click()
        wait_for(browser, "#samples tbody tr")
        assert browser.current_url == url + "step_000002.html"
        shown = records(retool_run, 2)
        assert [(g, i) for g, i, *_ in shown_rows(browser)] == [(r["group"], r["index"]) for r in shown]
        assert browser.find_element(By.ID, "count").text == f"{len(shown)} of {len(shown)} samples"

        # response length filter: the rows are those of the file whose response is at least that long
        lengths = sorted(len(r["tokens"]) for r in shown)
        bound = lengths[len(lengths) // 2]
        browser.find_element(By.ID, "f-len-min").send_keys(str(bound))
        expected = [(r["group"], r["index"]) for r in shown if len(r["tokens"]) >= bound]
        assert 0 < len(expected) < len(shown) or len(set(lengths)) == 1
        assert [(g, i) for g, i, *_ in shown_rows(browser)] == expected
        assert browser.find_element(By.ID, "count").text == f"{len(expected)} of {len(shown)} samples"
        browser.refresh()  # the filters are the page's, not kept
        wait_for(browser, "#samples tbody tr")
        assert len(shown_rows(browser)) == len(shown)

        # a trajectory that called the tool and got its output (which step has one depends on the sampling: a
        # call in a turn cut by the token limit gets no observation): observation tokens look unlike the policy's
        step, position = next((step, i) for step in steps for i, r in enumerate(records(retool_run, step))
                              if r["tool_calls"] and 0 in r["loss_mask"])
        browser.get(url + f"step_{step:06d}.html")
        wait_for(browser, "#samples tbody tr")
        record = check_sample(browser, retool_run, step, position)
        assert record["tool_calls"] and 0 in record["loss_mask"] and 1 in record["loss_mask"]
        assert "#sample-" in browser.current_url
        backgrounds = browser.execute_script(
            "return ['pol', 'obs'].map(k => getComputedStyle(document.querySelector('#tokens .' + k)).backgroundColor)")
        assert backgrounds[0] != backgrounds[1]
        assert browser.find_element(By.CSS_SELECTOR, ".legend-mask").is_displayed()
        arguments = browser.find_element(By.CSS_SELECTOR, "#tool-calls .arguments").text
        assert json.loads(arguments) == record["tool_calls"][0]["arguments"]

        # the mismatch view: each policy token coloured by its |train - rollout| gap, with the scale shown
        first = record["loss_mask"].index(1)
        title = browser.find_elements(By.CSS_SELECTOR, "#tokens span")[first].get_attribute("title")
        said = dict(line.split(": ", 1) for line in title.splitlines()[1:] if ": " in line)
        assert float(said["rollout log-prob"]) == pytest.approx(record["rollout_logprobs"][first], rel=1e-3)
        assert float(said["train log-prob"]) == pytest.approx(record["train_logprobs"][first], rel=1e-3)
        assert float(said["advantage"]) == pytest.approx(record["advantages"][first], rel=1e-3, abs=1e-12)
        browser.find_element(By.ID, "view-gap").click()
        assert browser.find_element(By.CSS_SELECTOR, ".legend-gap").is_displayed()
        assert not browser.find_element(By.CSS_SELECTOR, ".legend-mask").is_displayed()
        gaps = browser.execute_script("return [...document.querySelectorAll('#tokens span')].map(s => s.dataset.gap)")
        expected_gaps = [abs(t - r) if m else None for m, t, r in
                         zip(record["loss_mask"], record["train_logprobs"], record["rollout_logprobs"])]
        assert [float(g) if g is not None else None for g in gaps] == pytest.approx(expected_gaps, abs=1e-9)
        check_values_view(browser, record)  # the numbers as a visible row, tool output and policy tokens both


def test_served_viewer_shows_images_and_gives_out_only_the_run_s_files(vlm_run, browser):
    from selenium.webdriver.common.by import By

    named = {ref for step in steps_of(vlm_run) for r in records(vlm_run, step) for ref in r["images"]}
    files = {ref for ref in named if not ref.startswith("data:")}
    assert files and len(files) < len(named)  # both kinds shown
    with viewing(vlm_run) as url:
        for step in steps_of(vlm_run):
            browser.get(url + f"step_{step:06d}.html")
            wait_for(browser, "#samples tbody tr")
            for position, record in enumerate(records(vlm_run, step)):
                check_sample(browser, vlm_run, step, position)
                if position == 0:
                    check_values_view(browser, record)
                images = browser.find_elements(By.CSS_SELECTOR, "#images img")
                assert len(images) == len(record["images"]) == 1
                assert browser.execute_script("return arguments[0].complete && arguments[0].naturalWidth",
                                              images[0]) == 56
                src = images[0].get_attribute("src")
                ref, copy = record["images"][0], record["image_files"][0]
                if ref.startswith("data:"):
                    assert src == ref and copy is None
                else:  # the run's copy of the data's file, which lies outside the run directory
                    assert copy.startswith("trajectories/images/") and not Path(ref).is_relative_to(vlm_run)
                    assert src.endswith("image?path=" + urllib.parse.quote(copy, safe=""))

        # the server gives out the run's copies of the image files the trajectories name, and nothing outside the run
        some = sorted(files)[0]
        copy = next(r["image_files"][0] for step in steps_of(vlm_run) for r in records(vlm_run, step)
                    if r["images"][0] == some)
        status, kind, body = fetch(url + "image?path=" + urllib.parse.quote(copy, safe=""))
        assert (status, kind, body) == (200, "image/png", Path(some).read_bytes())
        unnamed = next(p for p in sorted(Path(some).parent.glob("*.png")) if str(p) not in files)
        for path in [some, str(unnamed), "/etc/passwd", str(vlm_run / "config.yaml"), "config.yaml",
                     some + "/../" + unnamed.name, f"{Path(some).parent}/./{Path(some).name}", ""]:
            assert fetch(url + "image?path=" + urllib.parse.quote(path, safe=""))[0] == 404, path
        assert fetch(url + "config.yaml")[0] == 404
        assert fetch(url + "step_000099.html")[0] == 404
        assert fetch(url + "../config.yaml")[0] == 404
        assert fetch(url, host="attacker.example")[0] == 403  # a name rebound to 127.0.0.1 reads nothing


def test_a_run_still_being_written_shows_its_new_steps_on_reload(retool_run, tmp_path, browser):
    from selenium.webdriver.common.by import By

    (tmp_path / "trajectories").mkdir()
    shutil.copy(retool_run / "trajectories/step_000000.jsonl", tmp_path / "trajectories")
    with viewing(tmp_path) as url:
        browser.get(url)
        assert [a.text for a in wait_for(browser, "a.step-link")] == ["step 0"]
        shutil.copy(retool_run / "trajectories/step_000001.jsonl", tmp_path / "trajectories")
        browser.refresh()
        assert [a.text for a in wait_for(browser, "a.step-link")] == ["step 0", "step 1"]
        browser.find_elements(By.CSS_SELECTOR, "a.step-link")[1].click()
        wait_for(browser, "#samples tbody tr")
        assert len(shown_rows(browser)) == len(records(retool_run, 1))


def test_report_writes_the_viewer_as_pages_that_open_from_disk(retool_run, vlm_run, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    result = run_miles("report", str(retool_run))
    assert result.returncode == 0, result.stderr[-3000:]
    report = retool_run / "report"
    viewer = report / "trajectories"
    assert sorted(p.name for p in viewer.glob("*.html")) == ["index.html"] + [f"step_{s:06d}.html" for s in range(3)]
    for page in viewer.glob("*.html"):  # self-contained: no script, style or anything else fetched
        text = page.read_text()
        assert not re.search(r"<(script|img|link)[^>]+(src|href)=", text), page
        assert "http://" not in text and "https://" not in text, page

    browser.get(report.joinpath("index.html").as_uri())
    section = browser.find_element(By.XPATH, "//h2[.='Sample completions']")
    assert section.is_displayed()
    assert [h.text for h in browser.find_elements(By.XPATH, "//h2[.='Sample completions']/following-sibling::h3")] \
        == ["Step 0", "Step 1", "Step 2"]
    completion = browser.find_element(By.CSS_SELECTOR, ".completion").text
    assert "reward" in completion and any(r["prompt"] in completion for r in records(retool_run, 0))
    browser.find_element(By.LINK_TEXT, "the trajectory viewer").click()
    links = wait_for(browser, "a.step-link")
    assert browser.current_url == viewer.joinpath("index.html").as_uri()
    links[1].click()
    wait_for(browser, "#samples tbody tr")
    shown = records(retool_run, 1)
    assert [(g, i) for g, i, *_ in shown_rows(browser)] == [(r["group"], r["index"]) for r in shown]
    position = max(range(len(shown)), key=lambda i: shown[i]["loss_mask"].count(0))
    check_sample(browser, retool_run, 1, position)
    browser.find_element(By.ID, "next").click()
    wait_for(browser, "#samples tbody tr")
    assert browser.current_url.endswith("step_000002.html")

    # the VLM run's pictures: files copied beside the pages, data URLs in them; the status filter
    assert run_miles("report", str(vlm_run)).returncode == 0
    copied = list((vlm_run / "report/trajectories/images").glob("*.png"))
    assert copied
    step = steps_of(vlm_run)[0]
    browser.get((vlm_run / f"report/trajectories/step_{step:06d}.html").as_uri())
    wait_for(browser, "#samples tbody tr")
    shown = records(vlm_run, step)
    for status in sorted({r["status"] for r in shown}):
        Select(browser.find_element(By.ID, "f-status")).select_by_value(status)
        assert [(g, i) for g, i, *_ in shown_rows(browser)] == \
            [(r["group"], r["index"]) for r in shown if r["status"] == status]
    Select(browser.find_element(By.ID, "f-status")).select_by_value("")
    best = max(reward(r) for r in shown)
    browser.find_element(By.ID, "f-reward-min").send_keys(str(best))
    assert [(g, i) for g, i, *_ in shown_rows(browser)] == \
        [(r["group"], r["index"]) for r in shown if reward(r) >= best]
    browser.refresh()
    wait_for(browser, "#samples tbody tr")
    for position in range(len(shown)):
        check_sample(browser, vlm_run, step, position)
        image = browser.find_element(By.CSS_SELECTOR, "#images img")
        assert browser.execute_script("return arguments[0].complete && arguments[0].naturalWidth", image) == 56


def test_view_refuses_what_is_not_a_run_with_trajectories(tmp_path):
    missing = run_miles("view", str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and "is not a directory" in missing.stderr, missing.stderr
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')
    empty = run_miles("view", str(tmp_path))
    assert empty.returncode == 2, empty.stderr
    assert "holds no step_*.jsonl" in empty.stderr and "run.trajectories" in empty.stderr
    assert "Traceback" not in missing.stderr + empty.stderr


# ----- runs written by hand: what a step file may hold that training never writes -------------------------------

def sample_record(group, index, reward=1.0, tokens=3, **fields):
    """One sample as miles.loop.trajectories writes it."""
    return {"step": 0, "group": group, "index": index, "status": "completed", "reason": "", "reward": reward,
            "label": None, "prompt": f"prompt {group}.{index}", "response_text": "answer", "turns": 1,
            "weight_versions": [0], "tool_calls": [], "images": [], "image_files": [], "prompt_tokens": ["p"],
            "tokens": ["t"] * tokens, "loss_mask": [1] * tokens, "rollout_logprobs": [-0.5] * tokens,
            "train_logprobs": [-0.5] * tokens, "advantages": [0.1] * tokens, "advantage": 0.1, **fields}


def hand_run(run_dir, steps):
    """A run directory whose trajectories are ``steps`` ({step: the bytes of its file}), with the metrics.jsonl
    that ``miles report`` needs."""
    (run_dir / "trajectories").mkdir(parents=True)
    for step, content in steps.items():
        (run_dir / f"trajectories/step_{step:06d}.jsonl").write_bytes(content)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward/mean": 0.5}) + "\n" for s in steps))
    return run_dir


def jsonl(*records):
    return "".join(json.dumps(r) + "\n" for r in records).encode()


def page_data(body):
    """The data a viewer page embeds (what its script shows)."""
    text = body.decode() if isinstance(body, bytes) else body
    return json.loads(re.search(r"<script type='application/json' id='miles-data'>(.*?)</script>", text, re.S)[1])


def png(colour, side=8):
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (side, side), colour).save(out, format="PNG")
    return out.getvalue()


def raw_get(url, target):
    """(status, body) of a GET of ``target`` sent exactly as written (no client normalizes its dots or escapes)."""
    import http.client

    address = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(address.hostname, address.port, timeout=30)
    try:
        connection.request("GET", target)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def test_images_outside_the_run_directory_are_neither_served_nor_copied(tmp_path):
    """Whatever path a trajectory names (absolute, ../, a symlink inside the run to a file outside, a file:// URL, a
    name that exists only in the working directory, a file of the run that is no image), only image files inside the
    run directory reach a page: served by miles view, copied by miles report. The legitimate ones still do."""
    secret = png("red")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside/secret.png").write_bytes(secret)
    (tmp_path / "cwd").mkdir()
    (tmp_path / "cwd/only_in_cwd.png").write_bytes(secret)
    legit, relative = png("blue"), png("green")
    run = tmp_path / "run"
    inside = "data:image/png;base64," + base64.b64encode(png("yellow")).decode()
    cases = {  # (images, image_files) of a sample: what is shown, or the reason it is not
        "copy": (["/data/elsewhere/a.png"], ["trajectories/images/legit.png"]),
        "relative": (["pictures/relative.png"], [None]),
        "data": ([inside], [None]),
        "absolute": ([str(tmp_path / "outside/secret.png")], [None]),
        "dotdot": (["../outside/secret.png"], [None]),
        "symlink": (["/data/elsewhere/b.png"], ["trajectories/images/escape.png"]),
        "file-url": (["file://" + str(tmp_path / "outside/secret.png")], [None]),
        "cwd": (["only_in_cwd.png"], [None]),
        "not-image": (["config.yaml"], [None]),
        "copy-dotdot": (["/data/elsewhere/c.png"], ["../outside/secret.png"]),
        "data-html": (["data:text/html;base64,PHNjcmlwdD4="], [None]),
    }
    refused = {"absolute": "outside the run directory", "dotdot": "outside the run directory",
               "symlink": "outside the run directory", "file-url": "outside the run directory",
               "cwd": "no such file in the run directory", "not-image": "not a PNG, JPEG, GIF, WebP or BMP file",
               "copy-dotdot": "outside the run directory", "data-html": "not a base64 image"}
    hand_run(run, {0: jsonl(*(sample_record(0, i, label=name, images=images, image_files=files)
                              for i, (name, (images, files)) in enumerate(cases.items())))})
    (run / "trajectories/images").mkdir()
    (run / "trajectories/images/legit.png").write_bytes(legit)
    (run / "pictures").mkdir()
    (run / "pictures/relative.png").write_bytes(relative)
    (run / "trajectories/images/escape.png").symlink_to(tmp_path / "outside/secret.png")
    (run / "config.yaml").write_text("model: {path: secret}\n")
    (tmp_path / "latest").symlink_to(run)  # the run reached through a symlink of its own: still its files

    def check_page(data):
        by_label = {s["label"]: s["images"][0] for s in data["samples"]}
        assert set(by_label) == set(cases)
        for name, why in refused.items():
            assert by_label[name]["src"] is None and why in by_label[name]["why"], (name, by_label[name])
        assert by_label["data"]["src"] == inside
        return {name: by_label[name]["src"] for name in ("copy", "relative")}

    with viewing(tmp_path / "latest", cwd=tmp_path / "cwd") as url:
        status, kind, body = fetch(url + "step_000000.html")
        assert status == 200
        srcs = check_page(page_data(body))
        assert srcs == {"copy": "image?path=trajectories%2Fimages%2Flegit.png",
                        "relative": "image?path=pictures%2Frelative.png"}
        assert fetch(url + srcs["copy"]) == (200, "image/png", legit)
        assert fetch(url + srcs["relative"]) == (200, "image/png", relative)
        names = [str(tmp_path / "outside/secret.png"), "../outside/secret.png", "trajectories/images/escape.png",
                 "file://" + str(tmp_path / "outside/secret.png"), "only_in_cwd.png", "config.yaml", "/etc/passwd",
                 "../../../../../../../../etc/passwd", "trajectories/../../outside/secret.png",
                 f"{run}/../outside/secret.png", "", ".", "trajectories", "pictures/relative.png\0.txt"]
        for name in names:
            status, _, body = fetch(url + "image?path=" + urllib.parse.quote(name, safe=""))
            assert (status, body) == (404, b"not an image file of this run\n"), name
        for target in ["/image?path=../outside/secret.png", "/image?path=..%2F..%2Foutside%2Fsecret.png",
                       "/image?path=%2e%2e%2foutside%2fsecret.png", "/image?path=%252e%252e%252foutside%252fsecret.png",
                       "/image?path=trajectories/images/escape.png", "/..%2Foutside%2Fsecret.png",
                       "/../outside/secret.png", "/%2e%2e/%2e%2e/etc/passwd", "/image/../../outside/secret.png",
                       "/config.yaml", "/trajectories/step_000000.jsonl"]:
            status, body = raw_get(url, target)
            assert status == 404 and secret not in body and b"secret" not in body, target

    report = run_miles("report", str(tmp_path / "latest"), cwd=tmp_path / "cwd")
    assert report.returncode == 0, report.stderr[-3000:]
    viewer = run / "report/trajectories"
    srcs = check_page(page_data((viewer / "step_000000.html").read_text()))
    assert sorted((viewer / src).read_bytes() for src in srcs.values()) == sorted([legit, relative])
    assert sorted(p.read_bytes() for p in (viewer / "images").iterdir()) == sorted([legit, relative])
    encoded = base64.b64encode(secret)
    for path in (run / "report").rglob("*"):  # nothing of the files outside the run, copied or embedded
        if path.is_file():
            assert secret not in path.read_bytes() and encoded not in path.read_bytes(), path
        assert not path.is_symlink(), path


def test_unreadable_lines_are_named_and_every_other_sample_shown(tmp_path):
    """A cut line, one that is not UTF-8, one that is JSON but no object, and a file that ends inside a line: each
    named on the index and the step's page (file, line, why), served and in the report; the other samples shown,
    a NaN reward as NaN, an infinite advantage as Infinity."""
    good = json.dumps(sample_record(0, 0, reward=1.0))
    content = b"\n".join([
        good.encode(),                                                              # line 1
        good[:60].encode(),                                                         # 2: cut
        json.dumps(sample_record(0, 1, reward=float("nan"), advantage=float("inf"))).encode(),  # 3
        b'{"step": 0, "prompt": "\xff\xfe"}',                                       # 4: not UTF-8
        b"[1, 2]",                                                                  # 5: an array
        b"",                                                                        # 6: blank, not a sample
        json.dumps(sample_record(1, 0, reward=0.0)).encode(),                       # 7
        good[:80].encode(),                                                         # 8: the file ends inside it
    ])
    run = hand_run(tmp_path / "run", {0: content, 1: jsonl(sample_record(0, 0, reward=0.25))})
    expected = [(2, "not JSON"), (4, "not UTF-8"), (5, "expected a JSON object (one sample), got an array"),
                (8, "cut short")]

    def check(index, step):
        first = index["steps"][0]
        assert [s["step"] for s in index["steps"]] == [0, 1]
        assert (first["source"], first["samples"], first["mean_reward"], first["unreadable_count"]) == \
            ("trajectories/step_000000.jsonl", 3, "NaN", 4)
        assert [(u["line"], why in u["why"]) for u, (_, why) in zip(first["unreadable"], expected)] == \
            [(line, True) for line, _ in expected]
        assert index["steps"][1]["mean_reward"] == 0.25 and index["steps"][1]["unreadable_count"] == 0
        assert [(s["group"], s["index"]) for s in step["samples"]] == [(0, 0), (0, 1), (1, 0)]
        assert [s["reward"] for s in step["samples"]] == [1.0, "NaN", 0.0]
        assert step["samples"][1]["advantage"] == "Infinity"
        assert step["unreadable"] == first["unreadable"] and step["source"] == first["source"]

    with viewing(run) as url:
        index, step = fetch(url), fetch(url + "step_000000.html")
        assert index[0] == step[0] == 200, (index[2][:300], step[2][:300])
        check(page_data(index[2]), page_data(step[2]))

    report = run_miles("report", str(run))
    assert report.returncode == 0, report.stderr[-3000:]
    viewer = run / "report/trajectories"
    check(page_data((viewer / "index.html").read_text()), page_data((viewer / "step_000000.html").read_text()))
    assert "trajectories/step_000000.jsonl: 4 line(s) cannot be read" in (run / "report/index.html").read_text()


def test_a_large_step_is_shown_a_page_at_a_time(tmp_path):
    """Many samples: pages of PAGE_SAMPLES, each holding only its own samples and linking the others; large
    samples: a page stops once past PAGE_BYTES of the file. The same pages served and written by miles report."""
    from miles.run.viewer import PAGE_BYTES, PAGE_SAMPLES

    many = [sample_record(i // 4, i % 4, reward=i % 3) for i in range(3 * PAGE_SAMPLES + 7)]
    big_line = PAGE_BYTES * 3 // 8  # three lines pass PAGE_BYTES: a page of three, then one of two
    large = [sample_record(0, i, response_text="x" * big_line) for i in range(5)]
    run = hand_run(tmp_path / "run", {0: jsonl(*many), 1: jsonl(*large)})
    files = ["step_000000.html", "step_000000_page2.html", "step_000000_page3.html", "step_000000_page4.html"]
    firsts = [0, PAGE_SAMPLES, 2 * PAGE_SAMPLES, 3 * PAGE_SAMPLES]

    def check(index, pages, large_pages):
        assert [(s["samples"], s["pages"]) for s in index["steps"]] == [(len(many), 4), (5, 2)]
        for number, data in enumerate(pages):
            assert data["page_number"] == number + 1 and data["first"] == firsts[number]
            assert data["total"] == len(many)
            assert data["pages"] == [[file, first, min(PAGE_SAMPLES, len(many) - first)]
                                     for file, first in zip(files, firsts)]
            assert [(s["group"], s["index"]) for s in data["samples"]] == \
                [(r["group"], r["index"]) for r in many[firsts[number]:firsts[number] + PAGE_SAMPLES]]
        assert [[(s["group"], s["index"]) for s in data["samples"]] for data in large_pages] == \
            [[(0, 0), (0, 1), (0, 2)], [(0, 3), (0, 4)]]

    with viewing(run) as url:
        bodies = [fetch(url + file) for file in files]
        large_bodies = [fetch(url + file) for file in ("step_000001.html", "step_000001_page2.html")]
        assert all(status == 200 for status, _, _ in bodies + large_bodies)
        check(page_data(fetch(url)[2]), [page_data(body) for _, _, body in bodies],
              [page_data(body) for _, _, body in large_bodies])
        assert len(large_bodies[0][2]) < 4 * big_line  # three samples' worth, never the step's five
        for missing in ("step_000000_page5.html", "step_000000_page1.html", "step_000000_page0.html",
                        "step_000001_page3.html", "step_000002.html"):
            assert fetch(url + missing)[0] == 404, missing

    report = run_miles("report", str(run))
    assert report.returncode == 0, report.stderr[-3000:]
    viewer = run / "report/trajectories"
    assert sorted(p.name for p in viewer.glob("step_*.html")) == \
        sorted(files + ["step_000001.html", "step_000001_page2.html"])
    check(page_data((viewer / "index.html").read_text()), [page_data((viewer / f).read_text()) for f in files],
          [page_data((viewer / f).read_text()) for f in ("step_000001.html", "step_000001_page2.html")])
    # the report's sample completions link the page that holds each sample
    links = re.findall(r"href='trajectories/(step_000000[^']*)#sample-(\d+)'", (run / "report/index.html").read_text())
    assert links and all(files[int(position) // PAGE_SAMPLES] == file for file, position in links)


def test_the_pages_show_unreadable_lines_nan_and_the_pager(tmp_path, browser):
    """What the script makes of it: the notice naming each unreadable line, NaN as NaN, the pager, and a
    #sample-N address that takes the reader to the page holding sample N."""
    from selenium.webdriver.common.by import By

    from miles.run.viewer import PAGE_SAMPLES

    good = json.dumps(sample_record(0, 0, reward=1.0))
    many = [sample_record(i // 4, i % 4, reward=i % 3) for i in range(2 * PAGE_SAMPLES + 3)]
    run = hand_run(tmp_path / "run", {
        0: "\n".join([good, good[:50], json.dumps(sample_record(0, 1, reward=float("nan")))]).encode() + b"\n",
        1: jsonl(*many)})
    with viewing(run) as url:
        browser.get(url)
        wait_for(browser, "a.step-link")
        notice = [li.text for li in browser.find_elements(By.CSS_SELECTOR, "#unreadable li")]
        assert len(notice) == 1 and notice[0].startswith("trajectories/step_000000.jsonl, line 2: not JSON"), notice
        means = [c.text for c in browser.find_elements(By.CSS_SELECTOR, "td.mean-reward")]
        assert means[0] == "NaN" and float(means[1]) == pytest.approx(sum(r["reward"] for r in many) / len(many),
                                                                      rel=1e-3)
        assert [c.text for c in browser.find_elements(By.CSS_SELECTOR, "td.unreadable-count")] == ["1", ""]

        browser.get(url + "step_000000.html")
        wait_for(browser, "#samples tbody tr")
        assert [row[2] for row in shown_rows(browser)] == ["1", "NaN"]
        assert browser.find_element(By.CSS_SELECTOR, "#unreadable li").text == notice[0]
        browser.find_element(By.CSS_SELECTOR, "#samples tr[data-position='1']").click()
        wait_until(lambda: browser.find_elements(By.ID, "d-reward"), "the NaN sample's detail")
        assert browser.find_element(By.ID, "d-reward").text == "NaN"

        browser.get(url + "step_000001.html")
        wait_for(browser, "#samples tbody tr")
        assert len(shown_rows(browser)) == PAGE_SAMPLES
        assert browser.find_element(By.ID, "count").text == (f"{PAGE_SAMPLES} of {PAGE_SAMPLES} samples on this page "
                                                             f"(samples 1 to {PAGE_SAMPLES} of the step's {len(many)})")
        assert [a.text for a in browser.find_elements(By.CSS_SELECTOR, "#pager a.page-link")] == ["2", "3", "page 2 →"]
        browser.find_element(By.ID, "next-page").click()
        wait_until(lambda: browser.current_url.endswith("step_000001_page2.html"), "page 2")
        wait_for(browser, "#samples tbody tr")
        assert [(g, i) for g, i, *_ in shown_rows(browser)] == \
            [(r["group"], r["index"]) for r in many[PAGE_SAMPLES:2 * PAGE_SAMPLES]]

        position = 2 * PAGE_SAMPLES + 1  # on page 3: the address of page 1 takes the reader there
        browser.get(url + f"step_000001.html#sample-{position}")
        wait_until(lambda: browser.current_url.endswith(f"step_000001_page3.html#sample-{position}"), "page 3")
        wait_until(lambda: browser.execute_script("const h = document.querySelector('#detail h2'); "
                                                  "return h && h.textContent") ==
                   f"Group {many[position]['group']}, sample {many[position]['index']}", "sample's detail")
        assert browser.find_element(By.CSS_SELECTOR, "#samples tr.selected").get_attribute("data-position") == \
            str(position)


def test_the_run_keeps_a_copy_of_each_image_file_its_samples_name(tmp_path):
    """The writer copies an image file from outside the run into trajectories/images/ (once per content), names a
    file already inside the run as it is, and records none for a data URL or a file gone by then."""
    import torch

    from miles.loop.trajectories import TrajectoryWriter
    from miles.models.hf import build_char_tokenizer
    from miles.models.vision import ProcessedImage
    from miles.types import Sample

    picture = png("blue")
    (tmp_path / "data").mkdir()
    for name in ("a.png", "same_as_a.png"):
        (tmp_path / "data" / name).write_bytes(picture)
    run = tmp_path / "run"
    (run / "pictures").mkdir(parents=True)
    (run / "pictures/own.png").write_bytes(png("green"))
    refs = [str(tmp_path / "data/a.png"), str(tmp_path / "data/same_as_a.png"), str(run / "pictures/own.png"),
            "data:image/png;base64," + base64.b64encode(picture).decode(), str(tmp_path / "data/gone.png")]
    images = [ProcessedImage(torch.zeros(1, 1), (1, 1, 1), b"", ref) for ref in refs]
    writer = TrajectoryWriter(run, build_char_tokenizer("ab"), groups_per_step=1)
    sample = Sample(prompt_ids=[0], response_ids=[1], loss_mask=[1], rollout_logprobs=[-0.5], reward=1.0,
                    images=images)
    record = writer.record(0, sample, None, None)
    assert record["images"] == refs  # as the engine was sent them
    copy = record["image_files"][0]
    assert record["image_files"] == [copy, copy, "pictures/own.png", None, None]
    assert copy.startswith("trajectories/images/") and copy.endswith(".png")
    assert (run / copy).read_bytes() == picture
    assert [p.name for p in (run / "trajectories/images").iterdir()] == [Path(copy).name]
