"""The course's JupyterLab in a real browser: headless Chromium driven by Selenium.

Run by `make browser-test`, which installs Debian's chromium, chromium-driver and a CJK font and
sets TPEDU_BROWSER_TEST=1; without it this module is skipped (`make test` does not start a browser).

What it does: serves a copy of notebooks/ with JupyterLab (free port, known token, throw-away
settings, workspace and runtime dirs, the course's overrides from jupyter/overrides.json), opens
lesson 00 in Chromium, runs it with Run All Cells, moves the memory calculator's `layers` slider
and changes its `tp` dropdown, and checks each time that the numbers on screen changed and equal
tpedu.analysis.memory.ledger computed here; then opens lesson 07 and checks that its Chinese text
is in the page and drawn with a CJK font. Screenshots go to runs/browser/. Every process it
started (JupyterLab, its kernels, chromedriver, chromium) is checked gone at the end.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

if os.environ.get("TPEDU_BROWSER_TEST") != "1":
    pytest.skip("the browser test runs under `make browser-test`", allow_module_level=True)

# Selenium must use the Debian driver and browser below, never fetch its own or report usage.
os.environ["SE_AVOID_STATS"] = "true"
os.environ["SE_OFFLINE"] = "true"

from selenium import webdriver
from selenium.common.exceptions import TimeoutException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.ui import Select, WebDriverWait

from tpedu.analysis.memory import GB, ledger
from tpedu.analysis.shape import ModelShape

ROOT = Path(__file__).resolve().parents[2]
SHOTS = ROOT / "runs" / "browser"
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
CALCULATOR_LESSON = "00_why_parallelism.ipynb"
CHINESE_LESSON = "07_tensor_parallel_gpt.ipynb"
CJK = re.compile(r"[\u4e00-\u9fff]{2,}")


# --- processes: everything started here must be gone at the end ------------------------------


def _stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, start time) of a live process, None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # the name in parentheses may hold spaces
    return int(fields[1]), fields[19]


def _tree(pid: int) -> dict[int, str]:
    """pid -> start time for `pid` and all its descendants (start time tells a reused pid)."""
    parents: dict[int, list[int]] = {}
    starts: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (st := _stat(int(entry.name))) is not None:
            parents.setdefault(st[0], []).append(int(entry.name))
            starts[int(entry.name)] = st[1]
    found, todo = {}, [pid]
    while todo:
        p = todo.pop()
        if p in starts:
            found[p] = starts[p]
            todo += parents.get(p, [])
    return found


def _alive(procs: dict[int, str]) -> list[int]:
    return [p for p, start in procs.items() if (st := _stat(p)) is not None and st[1] == start]


def _reap(procs: dict[int, str], what: str, grace: float = 15.0) -> None:
    """Wait for `procs` to exit; kill any left after `grace` seconds and fail naming them."""
    deadline = time.monotonic() + grace
    while (left := _alive(procs)) and time.monotonic() < deadline:
        time.sleep(0.2)
    if left:
        for p in left:
            os.kill(p, signal.SIGKILL)
        pytest.fail(f"{what} left processes running after shutdown (killed): {left}")


# --- JupyterLab ----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Lab:
    def __init__(self, home: Path) -> None:
        self.token = secrets.token_hex(16)
        self.url = f"http://127.0.0.1:{_free_port()}"
        self.home = home
        self.log = home / "lab.log"

    def api(self, path: str, method: str = "GET") -> dict:
        req = urllib.request.Request(
            self.url + path, method=method, headers={"Authorization": f"token {self.token}"}
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            body = r.read()
        return json.loads(body) if body else {}

    def page(self, notebook: str) -> str:
        return f"{self.url}/lab/tree/{notebook}?token={self.token}"


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    home = tmp_path_factory.mktemp("lab")
    lab = Lab(home)
    # A copy, so Run All's outputs never reach the repository's notebooks.
    served = shutil.copytree(
        ROOT / "notebooks", home / "notebooks", ignore=shutil.ignore_patterns(".ipynb_checkpoints")
    )
    user_settings = home / "user-settings"
    docmanager = (
        user_settings / "@jupyterlab" / "docmanager-extension" / "plugin.jupyterlab-settings"
    )
    docmanager.parent.mkdir(parents=True)
    docmanager.write_text('{"autosave": false}')
    env = dict(
        os.environ,
        JUPYTER_CONFIG_DIR=str(home / "config"),
        JUPYTER_DATA_DIR=str(home / "data"),
        JUPYTER_RUNTIME_DIR=str(home / "runtime"),
        JUPYTERLAB_SETTINGS_DIR=str(user_settings),
        JUPYTERLAB_WORKSPACES_DIR=str(home / "workspaces"),
        IPYTHONDIR=str(home / "ipython"),
        TPEDU_IMPL="solutions",
        TPEDU_BACKEND="gloo",
    )
    env.pop("JUPYTER_PATH", None)
    port = lab.url.rsplit(":", 1)[1]
    cmd = [str(Path(sys.executable).parent / "jupyter"), "lab", "--no-browser", "--ip=127.0.0.1"]
    cmd += [f"--port={port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={lab.token}"]
    cmd += ["--allow-root"] if os.geteuid() == 0 else []
    with open(lab.log, "w") as log:
        server = subprocess.Popen(
            cmd, cwd=served, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 60
        while True:
            if server.poll() is not None:
                pytest.fail(f"JupyterLab exited ({server.returncode}):\n{lab.log.read_text()}")
            try:
                lab.api("/api/status")
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"JupyterLab did not answer in 60 s:\n{lab.log.read_text()}")
                time.sleep(0.3)
        yield lab
    finally:
        procs = _tree(server.pid)  # the server and the kernels it started
        try:
            lab.api("/api/shutdown", method="POST")  # shuts its kernels down, then exits
        except OSError:
            server.terminate()
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        _reap(procs, "JupyterLab")


@pytest.fixture(scope="module")
def browser(lab: Lab) -> Iterator[webdriver.Chrome]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",  # its sandbox cannot start as root or in most containers
        "--disable-dev-shm-usage",
        f"--user-data-dir={lab.home / 'chromium'}",
        "--window-size=1400,1300",  # the whole calculator on screen, for its screenshots
        "--lang=en-US",
    ):
        options.add_argument(arg)
    service = Service(executable_path=CHROMEDRIVER, log_output=str(lab.home / "chromedriver.log"))
    driver = webdriver.Chrome(service=service, options=options)
    try:
        yield driver
    finally:
        procs = _tree(service.process.pid)  # chromedriver, chromium and its helpers
        try:
            driver.quit()
        finally:
            _reap(procs, "Chromium")


# --- the page ----------------------------------------------------------------------------------


def _shot(element: WebElement | webdriver.Chrome, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    if isinstance(element, WebElement):
        element.screenshot(str(SHOTS / name))
    else:
        element.save_screenshot(str(SHOTS / name))


def _open(driver: webdriver.Chrome, lab: Lab, notebook: str) -> None:
    """Open `notebook` and wait until its kernel is connected and idle."""
    driver.get(lab.page(notebook))

    def ready(d: webdriver.Chrome) -> bool:
        # Lab asks for a kernel when the page wins the race with the kernel specs: accept.
        for button in d.find_elements(
            By.CSS_SELECTOR, ".jp-Dialog .jp-Dialog-button.jp-mod-accept"
        ):
            button.click()
        status = [e.text for e in d.find_elements(By.CSS_SELECTOR, ".jp-StatusBar-TextItem")]
        return notebook in status and any(t.endswith("| Idle") for t in status)

    WebDriverWait(driver, 60, poll_frequency=0.3).until(
        ready, f"{notebook}: the kernel never became idle"
    )


def _menu(driver: webdriver.Chrome, menu: str, command: str) -> None:
    driver.find_element(
        By.XPATH, f"//div[contains(@class,'lm-MenuBar-itemLabel') and text()='{menu}']"
    ).click()
    driver.find_element(By.CSS_SELECTOR, f"li.lm-Menu-item[data-command='{command}']").click()


def _prompts(driver: webdriver.Chrome) -> list[str]:
    return driver.execute_script(
        "return [...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')]"
        ".map(e => e.textContent.trim())"
    )


def _errors(driver: webdriver.Chrome) -> list[str]:
    """Tracebacks shown in the notebook's outputs (Lab draws an error as stderr text)."""
    return driver.execute_script(
        "return [...document.querySelectorAll("
        "'.jp-OutputArea-output[data-mime-type=\"application/vnd.jupyter.stderr\"]')]"
        ".map(e => e.textContent).filter(t => t.includes('Traceback (most recent call last)'))"
    )


def _ran_all(driver: webdriver.Chrome) -> bool:
    """Every code cell has an execution count, or a cell failed (Run All stops there)."""
    prompts = _prompts(driver)
    numbered = prompts and all(re.fullmatch(r"\[\d+\]:", p) for p in prompts)
    return bool(numbered or _errors(driver))


# The calculator's controls by label, read from the DOM: the values the learner sees.
READ_CONTROLS = """
const root = arguments[0], values = {};
for (const row of root.querySelectorAll('.widget-inline-hbox')) {
  const label = (row.querySelector('.widget-label-basic span') || row.querySelector('.widget-label'));
  const name = label ? label.textContent.trim() : '';
  const select = row.querySelector('select'), handle = row.querySelector('.noUi-handle');
  const box = row.querySelector('input[type=checkbox]'), text = row.querySelector('input');
  if (select) values[name] = select.value;
  else if (handle) values[name] = handle.getAttribute('aria-valuenow');
  else if (box) values[name] = box.checked;
  else if (text) values[name] = text.value;
}
return values;
"""

READ_OUTPUT = """
const out = arguments[0].querySelector('.widget-output');
const text = [...out.querySelectorAll('[data-mime-type="application/vnd.jupyter.stdout"]')]
  .map(e => e.textContent).join('');
const img = out.querySelector('img');
const info = arguments[0].querySelector('.widget-html-content');
return [text, img ? img.src : null, info ? info.textContent : null];
"""


# The first element on screen (not in a hidden tab) whose own text holds arguments[0].
FIND_SHOWN_TEXT = """
for (const el of document.querySelectorAll('.jp-RenderedMarkdown *')) {
  const own = [...el.childNodes].filter(n => n.nodeType === Node.TEXT_NODE).map(n => n.data);
  const box = el.getBoundingClientRect();
  if (own.join('').includes(arguments[0]) && box.width > 0 && el.checkVisibility()) return el;
}
return null;
"""


def _expected(controls: dict) -> tuple[str, str]:
    """What the calculator must show for these controls: the ledger's table and total, and the
    parameter count, computed here with tpedu.analysis.memory.ledger."""
    config = ModelShape(
        n_layers=int(float(controls["layers"])),
        hidden=int(controls["hidden"]),
        n_heads=int(controls["heads"]),
        vocab_size=int(controls["vocab"]),
        seq_len=int(controls["seq len"]),
        micro_batch=int(float(controls["micro-batch"])),
    )
    lg = ledger(
        config,
        tp=int(controls["tp"]),
        pp=int(controls["pp"]),
        dp=int(controls["dp"]),
        sp=controls["sequence parallel"],
        recompute=controls["recompute"],
        zero=int(controls["ZeRO-1 (optimizer / dp)"]),
    )
    return f"{lg.table()}\n{lg.total / GB:.1f} GB per device", f"{config.n_params / 1e9:.3f}B"


def _shows(driver: webdriver.Chrome, calc: WebElement) -> tuple[dict, list]:
    return driver.execute_script(READ_CONTROLS, calc), driver.execute_script(READ_OUTPUT, calc)


def _agrees(controls: dict, shown: list) -> bool:
    table, params = _expected(controls)
    text, image, info = shown
    return text.startswith(table) and image is not None and info.startswith(params)


def _changed_and_agrees(driver: webdriver.Chrome, calc: WebElement, before: tuple) -> tuple:
    """Wait until the controls, the table and the chart differ from `before` and all of it agrees
    with ledger()."""

    def ready(_d: webdriver.Chrome) -> tuple | bool:
        controls, shown = _shows(driver, calc)
        # The table and the bar chart must change; the parameter count only where the shape did.
        moved = controls != before[0] and shown[0] != before[1][0] and shown[1] != before[1][1]
        return (controls, shown) if moved and _agrees(controls, shown) else False

    try:
        return WebDriverWait(driver, 30, poll_frequency=0.2).until(ready)
    except TimeoutException:
        controls, shown = _shows(driver, calc)
        pytest.fail(
            f"calculator did not update to ledger()'s figures:\ncontrols {controls}\n"
            f"shown:\n{shown[0]}\n{shown[2]}\nexpected:\n{_expected(controls)[0]}"
        )


# --- the tests ---------------------------------------------------------------------------------


def test_course_settings_are_served(lab: Lab) -> None:
    """jupyter/overrides.json is in force: no news prompt, no update check."""
    schema = lab.api("/lab/api/settings/@jupyterlab/apputils-extension:notification")["schema"]
    assert schema["properties"]["fetchNews"]["default"] == "false"
    assert schema["properties"]["checkForUpdates"]["default"] is False


def test_calculator_runs_and_follows_ledger(lab: Lab, browser: webdriver.Chrome) -> None:
    _open(browser, lab, CALCULATOR_LESSON)
    assert "Would you like to get notified" not in browser.page_source  # the news prompt
    _menu(browser, "Edit", "editmenu:clear-all")
    WebDriverWait(browser, 10).until(lambda d: all(p == "[ ]:" for p in _prompts(d)))
    _menu(browser, "Run", "runmenu:run-all")
    try:
        WebDriverWait(browser, 120, poll_frequency=0.5).until(_ran_all)
    except TimeoutException:
        pytest.fail(f"Run All did not finish in 120 s: {_prompts(browser)}")
    _shot(browser, "00_after_run_all.png")
    assert _errors(browser) == [], f"errors in {CALCULATOR_LESSON}: {_errors(browser)}"

    layers = WebDriverWait(browser, 30).until(
        lambda d: d.find_element(
            By.XPATH,
            "//div[contains(@class,'widget-slider')][label[normalize-space()='layers']]",
        )
    )
    calc = layers.find_element(By.XPATH, "ancestor::div[contains(@class,'jp-OutputArea-output')]")
    browser.execute_script("arguments[0].scrollIntoView({block: 'start'})", calc)
    first = WebDriverWait(browser, 30).until(
        lambda d: s if _agrees(*(s := _shows(d, calc))) else False,
        "the calculator's first figures disagree with ledger()",
    )
    _shot(calc, "00_calculator_start.png")

    handle = layers.find_element(By.CSS_SELECTOR, ".noUi-handle")
    ActionChains(browser).drag_and_drop_by_offset(handle, 40, 0).perform()
    after_slider = _changed_and_agrees(browser, calc, first)
    assert int(float(after_slider[0]["layers"])) > int(float(first[0]["layers"]))
    _shot(calc, "00_calculator_layers.png")

    tp = calc.find_element(
        By.XPATH, ".//div[contains(@class,'widget-dropdown')][label[normalize-space()='tp']]/select"
    )
    Select(tp).select_by_value("2")
    after_tp = _changed_and_agrees(browser, calc, after_slider)
    assert after_tp[0]["tp"] == "2" and "tp=2" in after_tp[1][0]
    _shot(calc, "00_calculator_tp2.png")


def test_chinese_renders(lab: Lab, browser: webdriver.Chrome) -> None:
    zh_fonts = subprocess.run(
        ["fc-list", ":lang=zh", "family"], capture_output=True, text=True, check=True
    ).stdout
    families = {f.strip() for line in zh_fonts.splitlines() for f in line.split(",")}
    assert families, "no font covers Chinese (fc-list :lang=zh is empty): install fonts-noto-cjk"

    nb = json.loads((ROOT / "notebooks" / CHINESE_LESSON).read_text())
    markdown = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown"]
    phrase = next(m for text in markdown if (m := CJK.search(text))).group()
    _open(browser, lab, CHINESE_LESSON)
    node = WebDriverWait(browser, 30, poll_frequency=0.3).until(
        lambda d: d.execute_script(FIND_SHOWN_TEXT, phrase),
        f"{phrase!r} from {CHINESE_LESSON} is not in the page",
    )
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", node)
    _shot(browser, "07_chinese.png")

    # Which fonts Chromium really drew the text with (tofu boxes would be a fallback font).
    browser.execute_script("arguments[0].setAttribute('data-tpedu-probe', '1')", node)
    browser.execute_cdp_cmd("DOM.enable", {})
    browser.execute_cdp_cmd("CSS.enable", {})
    doc = browser.execute_cdp_cmd("DOM.getDocument", {"depth": 0})
    found = browser.execute_cdp_cmd(
        "DOM.querySelector", {"nodeId": doc["root"]["nodeId"], "selector": "[data-tpedu-probe]"}
    )
    used = browser.execute_cdp_cmd("CSS.getPlatformFontsForNode", {"nodeId": found["nodeId"]})
    drawn = {f["familyName"] for f in used["fonts"] if f["glyphCount"] > 0}
    assert drawn & families, f"{phrase!r} drawn with {drawn}, none of them a CJK font"
