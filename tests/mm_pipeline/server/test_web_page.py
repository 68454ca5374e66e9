"""The upload page (``GET /``) in a real browser: Debian's headless Chromium driven by Selenium
against the server on 127.0.0.1, over the committed demo model, which captions the committed
samples exactly.

What is proven: files go in by picker, drop and paste; each modality's caption streams onto the
page; a second question about the same video reports encoder-cache hits and cached prompt tokens;
broken, unsupported and too-large files show the server's message; the many-files table completes
and its JSONL download equals ``mmserve caption`` on the same files; a server with an API key
refuses a page without one, in words, and accepts the key once typed (kept across reloads); themes,
phone width and keyboard order.  Every state is saved as a PNG in the test's tmp dir.

Browser tests skip with a reason when chromium / chromedriver are missing (``.ci/run`` installs
them); the checks that need no browser (the page's files, the response header) always run.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import httpx
import pytest

from mm_pipeline.server import ServerSettings, ServerThread, create_app
from mm_pipeline.server.web.routes import WEB_FILES

from tests.support.paths import DEMO_MODEL, REPO, SAMPLE_MEDIA

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
WAIT_S = 60  # one answer on a busy 2-core box is well under this; every browser wait is bounded by it
UPLOAD_LIMIT = 64 * 1024  # above every sample (<= 44 KB), so a 100 KB file shows the 413 message
LABELS = {r["path"]: r for r in map(json.loads, (SAMPLE_MEDIA / "labels.jsonl").read_text().splitlines())}
WEB_DIR = REPO / "mm_pipeline" / "server" / "web"


# ---- server and browser ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine():
    from mm_pipeline.runtime.config import OmniEngineConfig
    from mm_pipeline.runtime.omni_engine import OmniEngine

    # Prefix caching is off by default (mmserve serve --enable-prefix-caching turns it on), and with
    # the demo model's 31-token sliding window a *different* question about the same video reuses
    # the shared prefix only if SWA checkpoints were kept along it -- so both are on here, as the
    # README tells a user who wants to see cached tokens on the page.
    config = OmniEngineConfig.from_kwargs(num_full_tokens=8192, num_swa_tokens=4096, enable_prefix_caching=True,
                              prefix_checkpoint_every=16)
    eng = OmniEngine.from_pretrained(DEMO_MODEL, config)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(engine, tmp_path_factory):
    app = create_app(engine, ServerSettings(files_dir=str(tmp_path_factory.mktemp("files")),
                                            max_upload_bytes=UPLOAD_LIMIT))
    with ServerThread(app) as srv:
        srv.app = app
        yield srv


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if not (CHROMIUM.is_file() and CHROMEDRIVER.is_file()):
        pytest.skip(f"needs Debian's chromium and chromium-driver ({CHROMIUM}, {CHROMEDRIVER}); "
                    f"apt-get install -y chromium chromium-driver")
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install selenium)")
    from selenium.webdriver.chrome.service import Service

    downloads = tmp_path_factory.mktemp("downloads")
    opts = webdriver.ChromeOptions()
    opts.binary_location = str(CHROMIUM)  # Debian's browser; a driver path given = no selenium-manager download
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,1000", "--force-device-scale-factor=1", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"):
        opts.add_argument(arg)
    opts.add_experimental_option("prefs", {"download.default_directory": str(downloads),
                                           "download.prompt_for_download": False})
    driver = webdriver.Chrome(options=opts, service=Service(executable_path=str(CHROMEDRIVER)))
    try:
        driver.set_page_load_timeout(WAIT_S)
        driver.set_script_timeout(WAIT_S)
        driver.execute_cdp_cmd("Page.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(downloads)})
        driver.downloads = downloads
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def page(browser, server, tmp_path):
    """The page freshly loaded (no stored key or theme) and a ``shot(name)`` that saves a PNG."""
    browser.set_window_size(1280, 1000)
    browser.get(server.base_url + "/")
    browser.execute_script("localStorage.clear()")
    browser.get(server.base_url + "/")
    wait(browser, lambda d: d.execute_script("return document.readyState") == "complete")

    def shot(name: str) -> Path:
        path = tmp_path / f"{name}.png"
        browser.save_screenshot(str(path))
        return path

    browser.shot = shot
    return browser


def wait(driver, condition, timeout: float = WAIT_S, what: str = "condition"):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.1).until(condition, f"timed out waiting for {what}")


def pick(driver, *paths: Path) -> None:
    """Choose files with the page's file picker (several at once)."""
    from selenium.webdriver.common.by import By

    driver.find_element(By.ID, "files").send_keys("\n".join(str(p) for p in paths))


def js_files(driver, event: str, paths: list[Path], mimes: list[str]) -> None:
    """Drop (``event="drop"``) or paste files the way a browser delivers them: a DataTransfer of
    File objects on a drop / paste event (WebDriver cannot drag from the desktop or use the OS
    clipboard; the page's own handlers run unchanged)."""
    files = [{"name": p.name, "type": m, "bytes": list(p.read_bytes())} for p, m in zip(paths, mimes)]
    driver.execute_script("""
        const [kind, files] = arguments;
        const dt = new DataTransfer();
        for (const f of files) dt.items.add(new File([new Uint8Array(f.bytes)], f.name, {type: f.type}));
        const ev = kind === "drop" ? new DragEvent("drop", {dataTransfer: dt, bubbles: true, cancelable: true})
                                   : new ClipboardEvent("paste", {clipboardData: dt, bubbles: true, cancelable: true});
        (kind === "drop" ? document.getElementById("drop") : document.body).dispatchEvent(ev);
    """, event, files)


def cards(driver) -> dict[str, object]:
    from selenium.webdriver.common.by import By

    return {c.find_element(By.CSS_SELECTOR, ".name").text: c
            for c in driver.find_elements(By.CSS_SELECTOR, "#items .item")}


def finished_answers(driver, card, n: int = 1) -> list:
    """The card's answers (newest first) once ``n`` of them are no longer streaming."""
    from selenium.webdriver.common.by import By

    def done(_):
        answers = card.find_elements(By.CSS_SELECTOR, ".answer")
        return answers if len(answers) >= n and all(a.get_attribute("data-state") != "streaming"
                                                    for a in answers) else False
    return wait(driver, done, what=f"{n} finished answer(s)")


def upload_error(driver, card):
    """The card's upload error once it is shown."""
    from selenium.webdriver.common.by import By

    box = card.find_element(By.CSS_SELECTOR, ".upload-error")
    return wait(driver, lambda _: box.is_displayed() and box, what="the upload error")


def stat(answer, name: str) -> str:
    from selenium.webdriver.common.by import By

    return answer.find_element(By.CSS_SELECTOR, f'[data-stat="{name}"]').get_attribute("textContent")


# ---- without a browser ----------------------------------------------------------------------------
def test_page_files_are_served_self_contained_and_shipped(server):
    with httpx.Client(base_url=server.base_url, timeout=30) as c:
        index = c.get("/")
        assert index.status_code == 200 and index.headers["content-type"].startswith("text/html")
        assert "default-src 'self'" in index.headers["content-security-policy"]
        for name in WEB_FILES:
            r = c.get(f"/web/{name}")
            assert r.status_code == 200 and r.content == (WEB_DIR / name).read_bytes()
            assert not re.search(r"""(src|href)=["']?(https?:)?//|import .* from ["'](https?:)?//|url\(["']?https?:""",
                                 r.text), f"{name} loads something from another origin"
        assert c.get("/web/../app.py").status_code == 404 and c.get("/web/secret.txt").status_code == 404
    assert sorted(WEB_FILES) == sorted(p.name for p in WEB_DIR.iterdir() if p.is_file() and p.suffix != ".py")
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    shipped = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert all(any(Path(name).match(g) for g in shipped["mm_pipeline.server.web"]) for name in WEB_FILES)


def test_encoder_cache_hits_header_counts_this_request(server):
    body = (SAMPLE_MEDIA / "video_000001.webm").read_bytes()
    with httpx.Client(base_url=server.base_url, timeout=WAIT_S) as c:
        fid = c.post("/v1/files", files={"file": ("clip.webm", body)}, data={"purpose": "user_data"}).json()["id"]
        ask = {"messages": [{"role": "user", "content": [{"type": "file", "file": {"file_id": fid}},
                                                          {"type": "text", "text": "Describe this video."}]}],
               "temperature": 0, "max_tokens": 32}
        first = c.post("/v1/chat/completions", json=ask)
        again = c.post("/v1/chat/completions", json=ask)
        with c.stream("POST", "/v1/chat/completions", json={**ask, "stream": True}) as streamed:
            streamed.read()
        text = c.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
    units = int(again.headers["x-encoder-cache-hits"])
    assert first.headers["x-encoder-cache-hits"] == "0" and units > 0  # every frame group of the clip
    assert streamed.headers["x-encoder-cache-hits"] == str(units)
    assert text.headers["x-encoder-cache-hits"] == "0"


# ---- in the browser -------------------------------------------------------------------------------
def test_each_modality_uploads_previews_and_streams_its_caption(page):
    names = ["image_000001.png", "video_000000.mp4", "audio_000003.wav"]
    pick(page, *(SAMPLE_MEDIA / n for n in names))
    found = wait(page, lambda d: len(cards(d)) == 3 and cards(d), what="three cards")
    from selenium.webdriver.common.by import By

    rates = []
    for name in names:
        card = found[name]
        kind = LABELS[name]["modality"]
        assert card.get_attribute("data-kind") == kind
        card.find_element(By.CSS_SELECTOR, {"image": ".preview img", "video": ".preview video",
                                            "audio": ".preview audio"}[kind])
        assert card.find_element(By.CSS_SELECTOR, ".prompt").get_attribute("value") == LABELS[name]["prompt"]
        answer = finished_answers(page, card)[0]
        assert answer.get_attribute("data-state") == "done", answer.text
        assert answer.find_element(By.CSS_SELECTOR, ".text").text == LABELS[name]["caption"]
        assert card.find_element(By.CSS_SELECTOR, "progress").get_attribute("value") == "1"
        # a caption's tokens can all arrive in one read (no time after the first token: the page
        # shows no rate, "–"); on a loaded machine even the video's 15 tokens did (CI at a4e717d,
        # while the image's 3 and the audio's 4 had rates), so one of the three must show one
        assert re.fullmatch(r"\d+ ms", stat(answer, "ttft")) and re.fullmatch(r"[\d.]+|–", stat(answer, "tps"))
        rates.append(stat(answer, "tps"))
        assert re.fullmatch(r"\d+ of \d+", stat(answer, "cached")) and stat(answer, "encoder").isdigit()
    assert any(re.fullmatch(r"[\d.]+", r) for r in rates), rates
    page.shot("captions")


def test_second_question_about_the_video_shows_cache_hits(page):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    video = SAMPLE_MEDIA / "video_000001.webm"
    js_files(page, "drop", [video], ["video/webm"])
    card = wait(page, lambda d: cards(d).get(video.name), what="the video's card")
    first = finished_answers(page, card)[0]
    assert first.find_element(By.CSS_SELECTOR, ".text").text == LABELS[video.name]["caption"]
    # by keyboard: a new question in the field, Tab to "Ask", Enter
    prompt = card.find_element(By.CSS_SELECTOR, ".prompt")
    prompt.clear()
    prompt.send_keys("Describe this video again.")
    prompt.send_keys(Keys.TAB)
    assert page.switch_to.active_element == card.find_element(By.CSS_SELECTOR, ".ask-button")
    page.switch_to.active_element.send_keys(Keys.ENTER)
    second = finished_answers(page, card, 2)[0]
    assert second.find_element(By.CSS_SELECTOR, ".question").text == "Describe this video again."
    assert second.get_attribute("data-state") == "done", second.text
    cached, prompt_tokens = map(int, stat(second, "cached").split(" of "))
    assert int(stat(second, "encoder")) > 0  # the frame groups came from the encoder cache
    assert 0 < cached < prompt_tokens  # the prefix up to the new question came from the prefix cache
    page.shot("second-question")


def test_errors_are_shown_in_words(page, tmp_path):
    from selenium.webdriver.common.by import By

    broken = tmp_path / "broken.png"
    broken.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(200))  # a PNG signature and nothing decodable
    notes = tmp_path / "notes.txt"
    notes.write_text("not media at all\n" * 4)
    big = tmp_path / "big.wav"
    big.write_bytes(b"RIFF" + bytes(100 * 1024))
    pick(page, broken, big)
    js_files(page, "paste", [notes], ["text/plain"])
    found = wait(page, lambda d: len(cards(d)) == 3 and cards(d), what="three cards")
    errors = {}
    for name, card in found.items():
        if name == big.name:  # refused at upload
            box = upload_error(page, card)
        else:  # uploaded, refused when asked
            answer = finished_answers(page, card)[0]
            assert answer.get_attribute("data-state") == "error"
            box = answer.find_element(By.CSS_SELECTOR, ".error")
        errors[name] = box.text
    assert "(HTTP 400)" in errors["broken.png"] and "image from upload cannot be read" in errors["broken.png"]
    assert "messages[" not in errors["broken.png"]  # the card names the file, not the page's own chat
    assert "(HTTP 415)" in errors["notes.txt"] and "not a supported image, audio or video" in errors["notes.txt"]
    assert "(HTTP 413)" in errors["big.wav"] and f"{UPLOAD_LIMIT}-byte upload limit" in errors["big.wav"]
    page.shot("errors")


def test_many_files_table_downloads_what_mmserve_caption_writes(page, engine, server, tmp_path):
    from selenium.webdriver.common.by import By

    from mm_pipeline.jobs.caption import CaptionJob

    page.find_element(By.CSS_SELECTOR, 'input[name="mode"][value="table"]').click()
    media = sorted(p for p in SAMPLE_MEDIA.iterdir() if p.name in LABELS)
    pick(page, *media)
    wait(page, lambda d: d.find_element(By.ID, "table-view").get_attribute("data-complete") == "true",
         what="every row of the table")
    rows = page.find_elements(By.CSS_SELECTOR, "#captions tbody tr")
    assert [r.get_attribute("data-status") for r in rows] == ["done"] * len(media)
    assert {r.find_elements(By.TAG_NAME, "td")[0].text: r.find_elements(By.TAG_NAME, "td")[2].text
            for r in rows} == {p.name: LABELS[p.name]["caption"] for p in media}
    page.shot("many-files")
    page.find_element(By.ID, "download").click()
    download = page.downloads / "captions.jsonl"
    wait(page, lambda _: download.is_file() and download.read_text().count("\n") == len(media), what="the download")
    downloaded = {r["input"]: r for r in map(json.loads, download.read_text().splitlines())}

    # the caption job, in-process on the same engine and files (it takes over the file resolver:
    # give it back to the server afterwards)
    try:
        asyncio.run(CaptionJob(engine).run([str(p) for p in media], tmp_path / "job.jsonl"))
    finally:
        engine.set_file_resolver(server.app.state.store.resolve)
    job = {Path(r["input"]).name: r for r in map(json.loads, (tmp_path / "job.jsonl").read_text().splitlines())}
    assert downloaded.keys() == job.keys()
    for name, rec in downloaded.items():
        ref = job[name]
        assert rec.keys() == ref.keys() and rec["timings"].keys() == ref["timings"].keys()
        same = ("modality", "caption", "error", "prompt_tokens", "completion_tokens")
        assert {k: rec[k] for k in same} == {k: ref[k] for k in same}, name


def test_api_key_missing_is_shown_and_typed_key_is_kept(browser, engine, server, tmp_path_factory, tmp_path):
    from selenium.webdriver.common.by import By

    app = create_app(engine, ServerSettings(api_key="s3cret", files_dir=str(tmp_path_factory.mktemp("keyed"))))
    image = SAMPLE_MEDIA / "image_000000.webp"
    try:
        with ServerThread(app) as keyed:
            browser.get(keyed.base_url + "/")
            browser.execute_script("localStorage.clear()")
            browser.get(keyed.base_url + "/")
            pick(browser, image)
            card = wait(browser, lambda d: cards(d).get(image.name), what="the card")
            box = upload_error(browser, card)
            assert "(HTTP 401)" in box.text and "missing or invalid API key" in box.text
            browser.save_screenshot(str(tmp_path / "no-key.png"))

            browser.find_element(By.ID, "api-key").send_keys("s3cret")
            card.find_element(By.CSS_SELECTOR, ".retry").click()
            answer = finished_answers(browser, card)[0]
            assert answer.find_element(By.CSS_SELECTOR, ".text").text == LABELS[image.name]["caption"]
            assert not box.is_displayed()
            browser.save_screenshot(str(tmp_path / "with-key.png"))
            browser.get(keyed.base_url + "/")  # the key survives a reload (local storage)
            assert browser.find_element(By.ID, "api-key").get_attribute("value") == "s3cret"
            wait(browser, lambda d: engine.model_name in d.find_element(By.ID, "model").text,
                 what="the model name (/v1/models needs the key)")
    finally:
        engine.set_file_resolver(server.app.state.store.resolve)  # the keyed app took it over


def test_themes_phone_width_and_keyboard_order(page):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    background = "return getComputedStyle(document.body).backgroundColor"
    light = page.execute_script(background)
    page.find_element(By.ID, "theme").click()
    dark = page.execute_script(background)
    assert light != dark and page.find_element(By.ID, "theme").get_attribute("aria-pressed") == "true"
    page.shot("dark")
    page.get(page.current_url)  # the choice is kept
    assert page.execute_script(background) == dark
    page.find_element(By.ID, "theme").click()
    dark_system = {"features": [{"name": "prefers-color-scheme", "value": "dark"}]}
    page.execute_cdp_cmd("Emulation.setEmulatedMedia", dark_system)
    try:
        page.execute_script("localStorage.removeItem('mmserve.theme')")
        page.get(page.current_url)  # no choice stored: the system's dark scheme
        assert page.execute_script(background) == dark
        assert page.find_element(By.ID, "theme").get_attribute("aria-pressed") == "true"
    finally:
        page.execute_cdp_cmd("Emulation.setEmulatedMedia", {"features": []})

    page.set_window_size(390, 844)  # a phone
    page.get(page.current_url)
    pick(page, SAMPLE_MEDIA / "image_000002.jpg")
    finished_answers(page, wait(page, lambda d: cards(d).get("image_000002.jpg"), what="the card"))
    assert page.execute_script("return document.documentElement.scrollWidth <= window.innerWidth")
    page.shot("phone")

    # keyboard: Tab walks the controls in reading order, all real buttons and inputs with labels
    page.execute_script("document.activeElement.blur()")
    order = []
    for _ in range(5):  # keys to the page, not to an element (one on a file input would pick a file)
        ActionChains(page).send_keys(Keys.TAB).perform()
        order.append(page.switch_to.active_element.get_attribute("id") or
                     page.switch_to.active_element.get_attribute("value"))
    assert order == ["api-key", "theme", "ask", "files", "clear"]
    unlabelled = page.execute_script("""
        return [...document.querySelectorAll('button, input, textarea')].filter(el =>
            !(el.labels && el.labels.length) && !el.getAttribute('aria-label') && !el.textContent.trim()
        ).map(el => el.outerHTML);""")
    assert unlabelled == []
