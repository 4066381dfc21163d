"""The web console on a secure cluster (``dev up --secure``, issue 31): HTTPS with the
cluster's certificates, a login with the viewer's own token, and the token's grants: a
produce-only token sees no Cancel button, and a forged cancel (with a valid CSRF token) is
refused by the nodes; an admin token cancels."""

from __future__ import annotations

import pytest

from cluster import certs
from cluster.client import Producer
from cluster.devcluster import LocalCluster
from cluster.discovery import MetaResolver
from cluster.security import Grant
from tests.helpers.console import ConsoleProcess, browser_or_skip, shot, wait_for


@pytest.fixture(scope="module")
def secure(tmp_path_factory):
    c = LocalCluster(tmp_path_factory.mktemp("console-secure"), meta=True, secure=True)
    c.producer_token = certs.add_token(c.security.auth_file, "producer",
                                       [Grant(action="produce", subjects=["console.*"])],
                                       c.security.dir / "producer.token")
    with c:
        c.wait_registered()
        yield c


@pytest.fixture(scope="module")
def console(secure, tmp_path_factory):
    s = secure.security
    p = ConsoleProcess(["--cluster-file", str(secure.root / "cluster.json"), "--https-cert", str(s.node_cert),
                        "--https-key", str(s.node_key)], tmp_path_factory.mktemp("console-log") / "log", https=True)
    try:
        yield p
    finally:
        p.stop()


@pytest.fixture
def browser():
    d = browser_or_skip()  # a fresh one per test: its own cookies, its own login
    try:
        yield d
    finally:
        d.quit()


def _css(driver, selector: str):
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, selector)


def _login(driver, url: str, token: str, then: str) -> None:
    driver.get(url + then)
    assert driver.current_url.startswith(url + "/login"), "a secure console asks for a token first"
    assert not _css(driver, "#open-banner")
    _css(driver, "#token")[0].send_keys(token)
    _css(driver, "#login")[0].click()
    wait_for(driver, lambda d: not d.current_url.startswith(url + "/login"), "logged in")


async def _admin(c: LocalCluster, method: str, msg_id: str, **send):
    r = MetaResolver(c.meta_addresses, security=c.client_security())
    try:
        async with Producer(r) as p:
            if method == "send":
                return await p.send_and_wait("console.secure", b"x", id=msg_id, **send)
            return await getattr(p, method)(msg_id)
    finally:
        await r.close()


async def test_a_produce_only_token_sees_no_cancel_and_a_forged_cancel_is_refused(secure, console, browser):
    assert console.url.startswith("https://")
    await _admin(secure, "send", "sec-1", delay_ms=10 * 60_000)
    _login(browser, console.url, secure.producer_token, "/message?id=sec-1")
    assert not _css(browser, "#cancel"), "a produce-only token is shown no Cancel button"
    body = browser.find_element("tag name", "body").text
    assert "PermissionDenied" in body, body
    shot(browser, "message-produce-only")
    # a hand-made cancel, with this session's valid CSRF token: the nodes refuse it
    csrf = _css(browser, "input[name=csrf]")[0].get_attribute("value")
    browser.execute_script("""
        const f = document.createElement('form'); f.method = 'post'; f.action = '/message/cancel';
        for (const [k, v] of [['csrf', arguments[0]], ['id', 'sec-1']]) {
          const i = document.createElement('input'); i.type = 'hidden'; i.name = k; i.value = v; f.appendChild(i);
        }
        document.body.appendChild(f); f.submit();""", csrf)
    wait_for(browser, lambda d: any("cancel refused: PermissionDenied" in e.text for e in _css(d, ".flash")),
             "the refusal shown")
    assert (await _admin(secure, "lookup", "sec-1")).status == "pending"


async def test_an_admin_token_cancels_over_https(secure, console, browser):
    await _admin(secure, "send", "sec-2", delay_ms=10 * 60_000)
    _login(browser, console.url, secure.security.admin_token_file.read_text().strip(), "/message?id=sec-2")
    assert _css(browser, "#state")[0].text == "pending"
    _css(browser, "#cancel")[0].click()
    wait_for(browser, lambda d: d.switch_to.alert, "the confirmation").accept()
    wait_for(browser, lambda d: _css(d, "#state") and _css(d, "#state")[0].text == "cancelled", "cancelled")
    assert (await _admin(secure, "lookup", "sec-2")).status == "cancelled"


def test_a_wrong_token_is_refused_at_login(secure, console, browser):
    browser.get(console.url + "/schedule")
    _css(browser, "#token")[0].send_keys("hgt_not-a-token")
    _css(browser, "#login")[0].click()
    wait_for(browser, lambda d: any("log in refused" in e.text for e in _css(d, ".flash")), "the refusal")
    assert browser.current_url.startswith(console.url + "/login")
    browser.get(console.url + "/schedule")
    assert browser.current_url.startswith(console.url + "/login"), "no session was made"
    shot(browser, "login")


def test_a_post_without_the_csrf_token_is_refused(secure, console, browser):
    _login(browser, console.url, secure.security.admin_token_file.read_text().strip(), "/cluster")
    groups = {e.get_attribute("data-group") for e in _css(browser, "h3.group")}
    assert groups == {"delay-1", "realtime-1"}
    browser.execute_script("""
        const f = document.createElement('form'); f.method = 'post'; f.action = '/message/cancel';
        const i = document.createElement('input'); i.type = 'hidden'; i.name = 'id'; i.value = 'x'; f.appendChild(i);
        document.body.appendChild(f); f.submit();""")
    wait_for(browser, lambda d: "CSRF" in d.find_element("tag name", "body").text, "the refusal")


def test_the_console_refuses_plain_http_and_a_node_certificate_on_a_secure_cluster(secure):
    import os
    import subprocess
    import sys

    from tests.helpers.console import ROOT

    cf = str(secure.root / "cluster.json")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HOURGLASS_TLS_", "HOURGLASS_TOKEN"))}

    def run(*args, **extra):
        return subprocess.run([sys.executable, "-m", "cluster.cli", "console", "--cluster-file", cf, *args],
                              cwd=ROOT, capture_output=True, text=True, timeout=120, env=env | extra)
    plain = run("--port", "1")
    assert plain.returncode == 2 and plain.stderr.startswith("error: the cluster is secure"), plain.stderr
    s = secure.security
    as_node = run("--https-cert", str(s.node_cert), "--https-key", str(s.node_key),
                  HOURGLASS_TLS_CA_FILE=str(s.ca), HOURGLASS_TLS_CERT_FILE=str(s.node_cert),
                  HOURGLASS_TLS_KEY_FILE=str(s.node_key))
    assert as_node.returncode == 2 and "is a node certificate" in as_node.stderr, as_node.stderr
    assert "Traceback" not in plain.stderr + as_node.stderr
