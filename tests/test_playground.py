"""The playground page at ``GET /``, in a real browser: Debian's headless Chromium driven by
Selenium through Debian's chromedriver (nothing downloads a browser), against a real server on the
default model. Screenshots of a finished chat and of a step's tree are saved under ``artifacts/``."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import httpx
import pytest

from triedec.bench.load import serving
from triedec.server import ApiKeys, ServerConfig, create_app
from triedec.server.playground import CSP, FILES

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts" / "playground"
COUNTING = "List the numbers from 1 to 20, separated by commas."
SCRIPT = "Write the HTML tag that starts a JavaScript block, exactly: <script>"
"""a prompt whose greedy answer on the default model contains ``<script>`` (checked below)"""


def browser_paths() -> tuple[str, str]:
    found = shutil.which("chromium"), shutil.which("chromedriver")
    if not all(found):
        pytest.fail("the playground's tests need Debian's chromium and chromium-driver: run scripts/setup.sh")
    return found  # type: ignore[return-value]


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary, driver = browser_paths()
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,1000",
                "--no-first-run", "--disable-background-networking"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    chrome = webdriver.Chrome(service=Service(driver), options=options)
    yield chrome
    chrome.quit()


@pytest.fixture(scope="module")
def open_url(default_lm):
    with serving(create_app(default_lm, ServerConfig())) as url:
        yield url


def by(css):
    from selenium.webdriver.common.by import By

    return By.CSS_SELECTOR, css


def wait(browser, condition, seconds=120):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(browser, seconds).until(condition)


def load(browser, url):
    """The page, fresh: no key stored, and the console record holding this load's messages only."""
    browser.get(url + "/")
    browser.execute_script("sessionStorage.clear()")
    browser.get_log("browser")  # drop what the first visit logged
    browser.get(url + "/")


def ready(browser):
    wait(browser, lambda b: b.find_elements(*by("#method option")))


def errors(browser):
    return [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]


def set_value(browser, element_id, value):
    browser.execute_script("document.getElementById(arguments[0]).value = arguments[1]", element_id, str(value))


def chat(browser, prompt, method=None, temperature=0, seed="", max_tokens=48, compare=False, schema=""):
    """Send ``prompt`` from the page and wait until every answer it asked for is done; the last
    answer's element."""
    from selenium.webdriver.support.ui import Select

    if method is not None:
        Select(browser.find_element(*by("#method"))).select_by_value(method)
    set_value(browser, "temperature", temperature)
    set_value(browser, "seed", seed)
    set_value(browser, "max-tokens", max_tokens)
    set_value(browser, "schema", schema)
    box = browser.find_element(*by("#compare"))
    if box.is_selected() != compare:
        box.click()
    browser.find_element(*by("#clear")).click()  # each chat starts a new conversation
    field = browser.find_element(*by("#prompt"))
    field.clear()
    field.send_keys(prompt)
    browser.find_element(*by("#send")).click()
    want = 2 if compare else 1
    wait(browser, lambda b: len(b.find_elements(*by(".message.assistant[data-done=true]"))) >= want
         or b.find_element(*by("#error")).is_displayed())
    error = browser.find_element(*by("#error"))
    assert not error.is_displayed(), error.text
    return browser.find_elements(*by(".message.assistant"))[-1]


def api_text(url, prompt, key=None, **body):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.post(url + "/v1/chat/completions", headers=headers, timeout=120,
                   json={"messages": [{"role": "user", "content": prompt}], **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_the_page_and_its_files_carry_a_strict_policy_and_need_no_key(default_lm):
    config = ServerConfig(api_keys=ApiKeys({"sk-right-0123456789": "alice"}))
    with serving(create_app(default_lm, config)) as url:
        for path in ["/", *(f"/playground/{name}" for name in FILES)]:
            r = httpx.get(url + path)
            assert r.status_code == 200, path
            assert r.headers["content-security-policy"] == CSP
            assert r.headers["x-content-type-options"] == "nosniff"
        assert "'unsafe-inline'" not in CSP and "script-src 'self'" in CSP
        page = httpx.get(url + "/").text
        assert "<script>" not in page and 'content="required"' in page  # no inline script; asks for a key
        key = {"Authorization": "Bearer sk-right-0123456789"}
        for other in ("/playground/../app.py", "/playground/secret.txt", "/playground/%2e%2e%2fapp.py"):
            assert httpx.get(url + other).status_code == 401  # not a page file: the key is asked for
            assert httpx.get(url + other, headers=key).status_code == 404
        assert httpx.get(url + "/triedec/info").status_code == 401  # the API needs the key
        info = httpx.get(url + "/triedec/info", headers=key).json()
        assert {m["name"] for m in info["methods"]} >= {"auto", "ar", "beam", "pld"}
        assert "model" in info["origins"] and "store" in info["origins"]


def test_a_chat_streams_and_the_page_text_equals_the_api_text(browser, open_url):
    load(browser, open_url)
    ready(browser)
    answer = chat(browser, COUNTING, method="auto", max_tokens=64)
    body = answer.find_element(*by(".body"))
    text = browser.execute_script("return arguments[0].textContent", body)
    assert text == api_text(open_url, COUNTING, method="auto", max_tokens=64)
    assert errors(browser) == []
    # each token shows its logprob and the likeliest alternatives on hover: the API's values
    r = httpx.post(open_url + "/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": COUNTING}], "method": "auto", "max_tokens": 64, "logprobs": True,
        "top_logprobs": 5})
    want = [c["logprob"] for c in r.json()["choices"][0]["logprobs"]["content"]]
    spans = answer.find_elements(*by(".body .tok"))
    assert [float(s.get_attribute("data-logprob")) for s in spans] == want
    assert all(" · logprob " in s.get_attribute("title") and "likeliest: " in s.get_attribute("title")
               for s in spans)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    browser.save_screenshot(str(ARTIFACTS / "chat.png"))


def page_counts(browser, answer):
    spans = answer.find_elements(*by(".body .tok"))
    origins = Counter(s.get_attribute("data-origin") for s in spans)
    per_step = Counter(int(s.get_attribute("data-step")) for s in spans)
    return origins, [per_step[k] for k in sorted(per_step)]


def test_the_origin_counts_on_the_page_equal_the_request_stats(browser, open_url):
    load(browser, open_url)
    ready(browser)
    for method in ("auto", "ngram-trie", "pld", "recycling", "lookahead"):
        answer = chat(browser, COUNTING, method=method, max_tokens=64)
        stats = json.loads(answer.get_attribute("data-stats"))
        origins, per_step = page_counts(browser, answer)
        assert dict(origins) == stats["accepted_by_origin"], method
        assert sum(origins.values()) == stats["new_tokens"]
        assert per_step == [1, *stats["accepted_per_step"]]  # step 0: the prefill's token
        shown = {li.get_attribute("data-origin"): int(li.get_attribute("data-count"))
                 for li in browser.find_elements(*by("#origin-counts li"))}
        assert shown == dict(origins)
        if method == "auto":
            assert set(origins) - {"model"}, "no draft was accepted: the check above proves nothing"


def drawn_tree(browser):
    """The drawn tree's node count and the indices marked accepted."""
    nodes = browser.find_elements(*by("#tree g[data-node]"))
    return len(nodes), [int(g.get_attribute("data-node")) for g in nodes if g.get_attribute("data-accepted") == "true"]


def test_clicking_a_token_draws_its_step_tree(browser, open_url):
    """Every step's tree as the stream sent it: its accepted path is the tokens the step committed.
    Whether a step's tree also held rejected nodes depends on the machine's calibration (a small tree
    can be a chain the model accepts whole), so rejected nodes are checked on a tree of known shape
    in the next test."""
    load(browser, open_url)
    ready(browser)
    answer = chat(browser, COUNTING, method="auto", max_tokens=64)
    spans = answer.find_elements(*by(".body .tok"))
    assert any(s.get_attribute("data-origin") != "model" for s in spans)
    by_step: dict[int, list] = {}
    for span in spans:
        by_step.setdefault(int(span.get_attribute("data-step")), []).append(span)
    last = max(by_step)
    for step, committed in sorted(by_step.items()):
        committed[-1].click()
        title = browser.find_element(*by("#tree-title")).text
        if step == 0:
            assert "prefill" in title and drawn_tree(browser)[0] == 0
            continue
        n, accepted = drawn_tree(browser)
        assert accepted == sorted(accepted) and accepted[0] == 0 and n >= len(accepted), step
        # the root plus each accepted draft; the step commits those drafts and the bonus token, cut
        # at a stop only in the last step
        assert len(committed) == len(accepted) or (step == last and len(committed) < len(accepted)), step
        assert f"Tree of step {step} ({n} nodes, {len(accepted) - 1} accepted)" in title
    box = browser.find_element(*by("#tree-box"))
    box.screenshot(str(ARTIFACTS / "tree.png"))
    (ARTIFACTS / "tree-page.png").write_bytes(browser.get_screenshot_as_png())


def test_a_tree_marks_its_accepted_path_and_only_that(browser, open_url):
    """The page's own drawing function on a tree of known shape: two branches at the root, the
    second accepted two deep; the rejected nodes and their edges are drawn unmarked."""
    load(browser, open_url)
    ready(browser)
    tree = {"tokens": [7, 8, 9, 10, 11, 12], "parents": [-1, 0, 1, 0, 3, 3],
            "sources": [[], ["context"], ["context"], ["recycling"], ["recycling", "store"], ["store"]],
            "accepted": [0, 3, 4]}
    browser.execute_script("drawTree(arguments[0], 'auto')", {"step": 5, "tree": tree})
    assert drawn_tree(browser) == (6, [0, 3, 4])
    assert len(browser.find_elements(*by("#tree path.edge.accepted"))) == 2
    assert len(browser.find_elements(*by("#tree path.edge"))) == 5
    assert browser.find_element(*by("#tree-title")).text.startswith("Tree of step 5 (6 nodes, 2 accepted)")
    browser.execute_script("drawTree(arguments[0], 'auto')", {"step": 5, "tree": {**tree, "pruned": 3}})
    assert "2 accepted; 3 drafted nodes pruned by the grammar" in browser.find_element(*by("#tree-title")).text
    assert errors(browser) == []


def test_a_json_schema_marks_the_tokens_the_grammar_forced(browser, open_url):
    """With a JSON schema in the page, the answer is the API's under the same schema, valid JSON,
    and the tokens the grammar forced are marked with their own origin."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    ask = "Reply with a JSON object with the keys name and age for Ada Lovelace, aged 36."
    load(browser, open_url)
    ready(browser)
    answer = chat(browser, ask, method="auto", max_tokens=48, schema=json.dumps(schema))
    text = browser.execute_script("return arguments[0].textContent", answer.find_element(*by(".body")))
    assert text == api_text(open_url, ask, method="auto", max_tokens=48, guided_json=schema)
    assert set(json.loads(text)) == {"name", "age"}
    forced = answer.find_elements(*by(".body .tok.o-grammar"))
    assert forced and all(s.get_attribute("data-origin") == "grammar" for s in forced)
    set_value(browser, "schema", "")


def test_beam_shows_its_live_hypotheses(browser, open_url):
    load(browser, open_url)
    ready(browser)
    answer = chat(browser, COUNTING, method="beam", max_tokens=16)
    assert not browser.find_element(*by("#compare")).is_enabled()  # beam's contract is transformers' beam search
    answer.find_elements(*by(".body .tok"))[3].click()
    assert "Live hypotheses" in browser.find_element(*by("#tree-title")).text
    assert len(browser.find_elements(*by("#tree g[data-node]"))) > 1


@pytest.mark.parametrize("temperature", [0, 0.8])
def test_compare_mode_says_equal_for_every_method(browser, open_url, temperature):
    load(browser, open_url)
    ready(browser)
    info = httpx.get(open_url + "/triedec/info").json()
    methods = [m["name"] for m in info["methods"] if m["equals"] == "greedy"]
    # sampled: the page sends the same seed to both sides whatever the method (the API's own tests
    # check every method's sampled tokens against ar's): two methods keep the suite inside its time
    for method in methods if temperature == 0 else ["pld", "auto"]:
        chat(browser, "Name three colours and one animal for each.", method=method, temperature=temperature, seed=11,
             max_tokens=32, compare=True)
        result = browser.find_element(*by("#compare-result"))
        pair = browser.find_elements(*by(".pair"))[-1].find_elements(*by(".message.assistant"))
        ar_tokens, tokens = (json.loads(m.get_attribute("data-tokens")) for m in pair)
        assert ar_tokens and tokens == ar_tokens, method
        assert result.get_attribute("data-equal") == "true", (method, result.text)
        assert result.text.startswith("equal") and "x ar's tokens/s" in result.text
    assert errors(browser) == []


def test_with_keys_the_page_asks_for_one_and_shows_the_server_error(browser, default_lm):
    config = ServerConfig(api_keys=ApiKeys({"sk-right-0123456789": "alice"}))
    with serving(create_app(default_lm, config)) as url:
        load(browser, url)
        wait(browser, lambda b: b.find_element(*by("#key-dialog")).is_displayed())
        browser.find_element(*by("#key-input")).send_keys("sk-wrong")
        browser.find_element(*by("#key-save")).click()
        wait(browser, lambda b: b.find_element(*by("#error")).is_displayed())
        expected = httpx.get(url + "/triedec/info", headers={"Authorization": "Bearer sk-wrong"}).json()
        assert expected["error"]["message"] in browser.find_element(*by("#error")).text
        assert "sk-wrong" not in browser.current_url
        browser.find_element(*by("#key-input")).send_keys("sk-right-0123456789")
        browser.find_element(*by("#key-save")).click()
        ready(browser)
        assert browser.execute_script("return sessionStorage.getItem('triedec-api-key')") == "sk-right-0123456789"
        assert browser.execute_script("return localStorage.length") == 0
        assert "sk-right" not in browser.current_url

        answer = chat(browser, SCRIPT, method="ar", max_tokens=48)
        want = api_text(url, SCRIPT, key="sk-right-0123456789", method="ar", max_tokens=48)
        assert "<script>" in want  # the model prints the tag, so the check below means something
        body = answer.find_element(*by(".body"))
        assert browser.execute_script("return arguments[0].textContent", body) == want
        assert body.find_elements(*by("script")) == []  # shown as text, never run as HTML
        asked = browser.find_elements(*by(".message.user .body"))[-1]
        assert asked.text == SCRIPT and asked.find_elements(*by("script")) == []
